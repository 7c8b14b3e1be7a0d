"""The client commands against an in-process API, and `api serve` refusing without --simulate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from api_helpers import CONFIGS, TOKEN
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import proxima.api.cli as api_cli
from proxima.api.server import SimulatedServer
from proxima.cli import app

runner = CliRunner()


@pytest.fixture
def cli(server: SimulatedServer, monkeypatch: pytest.MonkeyPatch):
    def client(url: str | None) -> TestClient:
        return TestClient(server.app, headers={"Authorization": f"Bearer {TOKEN}"})

    monkeypatch.setattr(api_cli, "_client", client)
    return lambda *args: runner.invoke(app, list(args))


def test_policy_get_patch_history_rollback(cli) -> None:
    res = cli("policy", "get")
    assert res.exit_code == 0, res.output
    assert res.output.startswith("# version 1") and "name: balanced" in res.output
    res = cli("policy", "patch", "budget.max_blocks_per_step=64", "protect.sink_tokens=16", "--comment", "cli")
    assert res.exit_code == 0, res.output
    assert "policy version 2" in res.output and "budget.max_blocks_per_step: 1024 -> 64" in res.output
    res = cli("policy", "patch", '{"description": "json form"}')
    assert res.exit_code == 0 and "policy version 3" in res.output
    res = cli("policy", "history")
    assert res.exit_code == 0 and "(live)" in res.output and "cli" in res.output
    res = cli("policy", "rollback", "1")
    assert res.exit_code == 0 and "policy version 4 (rollback:1)" in res.output


def test_policy_set_and_error_with_field(cli, tmp_path: Path) -> None:
    res = cli("policy", "set", str(CONFIGS / "conservative.yaml"))
    assert res.exit_code == 0, res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (CONFIGS / "balanced.yaml").read_text().replace("max_blocks_per_step: 1024", "max_blocks_per_step: -1")
    )
    res = cli("policy", "set", str(bad))
    assert res.exit_code == 2
    assert "error 422" in res.output and "budget.max_blocks_per_step (line" in res.output
    res = cli("policy", "set", str(CONFIGS / "balanced.yaml"), "--if-version", "1")
    assert res.exit_code == 2 and "error 412" in res.output


def test_stats_alerts_fallback(cli, server: SimulatedServer) -> None:
    for _ in range(30):
        server.driver.tick()
    res = cli("stats")
    assert res.exit_code == 0 and json.loads(res.output)["total_blocks"] > 0
    res = cli("fallback", "int8-only")
    assert res.exit_code == 0 and "level 2 (int8-only), pinned at 2" in res.output
    res = cli("alerts")
    assert res.exit_code == 0 and "fallback_forced" in res.output
    res = cli("fallback", "release")
    assert res.exit_code == 0 and res.output.strip() == "level 0 (full)"


def test_unreachable_server_exits_1() -> None:
    res = runner.invoke(app, ["stats", "--url", "http://127.0.0.1:9"])
    assert res.exit_code == 1 and "cannot reach" in res.output


def test_serve_without_simulate_explains() -> None:
    res = runner.invoke(app, ["api", "serve"])
    assert res.exit_code == 2 and "--simulate" in res.output
