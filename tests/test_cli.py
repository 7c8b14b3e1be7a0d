import json
from pathlib import Path

from typer.testing import CliRunner

from proxima.cli import app

ROOT = Path(__file__).parents[1]
runner = CliRunner()


def test_validate_shipped_configs() -> None:
    res = runner.invoke(app, ["validate", *[str(p) for p in sorted((ROOT / "proxima" / "policies").glob("*.yaml"))]])
    assert res.exit_code == 0, res.output
    assert "balanced.yaml: ok" in res.output


def test_validate_wrong_type_reports_file_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    text = (
        (ROOT / "proxima" / "policies" / "balanced.yaml")
        .read_text()
        .replace("max_blocks_per_step: 1024", "max_blocks_per_step: lots")
    )
    bad.write_text(text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "max_blocks_per_step" in ln)
    res = runner.invoke(app, ["validate", str(bad)])
    assert res.exit_code == 2
    assert f"{bad}:{line}:" in res.output and "budget.max_blocks_per_step" in res.output
    assert "Traceback" not in res.output


def test_validate_missing_file() -> None:
    res = runner.invoke(app, ["validate", "/nonexistent/p.yaml"])
    assert res.exit_code == 2 and "cannot read policy file" in res.output


def test_policy_schema_is_json() -> None:
    res = runner.invoke(app, ["policy", "schema"])
    assert res.exit_code == 0
    schema = json.loads(res.output)
    assert "bands" in schema["properties"]


def test_simulate_json_meets_headline_on_default_workload() -> None:
    res = runner.invoke(app, ["simulate", "--policy", "balanced", "--seed", "0", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["policy"]["peak_resident_requests"] >= 2 * data["baseline"]["peak_resident_requests"]
    assert data["policy"]["steps"] < data["baseline"]["steps"]


def test_simulate_plot(tmp_path: Path) -> None:
    png = tmp_path / "p.png"
    res = runner.invoke(
        app,
        [
            "simulate",
            "--policy",
            str(ROOT / "proxima" / "policies" / "conservative.yaml"),
            "--requests",
            "16",
            "--total-blocks",
            "512",
            "--plot",
            str(png),
        ],
    )
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_bad_trace(tmp_path: Path) -> None:
    tr = tmp_path / "t.jsonl"
    tr.write_text("not json\n")
    res = runner.invoke(app, ["simulate", "--policy", "balanced", "--trace", str(tr)])
    assert res.exit_code == 2 and "invalid JSON" in res.output


def test_version_and_help() -> None:
    assert "proxima 0.1.0" in runner.invoke(app, ["version"]).output
    for cmd in (["--help"], ["simulate", "--help"], ["policy", "--help"], ["validate", "--help"]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 0 and "Usage" in res.output
