"""`proxima serve --api-port/--api-host` hand the runtime API settings to vLLM's processes (no engine started)."""

from __future__ import annotations

import os

import pytest
import typer
from typer.testing import CliRunner

from proxima.integration.vllm import cli


def _serve(monkeypatch: pytest.MonkeyPatch, *args: str) -> dict:
    seen: dict = {}

    def fake_exec(path: str, argv: list[str], env: dict[str, str]) -> None:
        seen.update(path=path, argv=argv, env=env)

    monkeypatch.setattr(os, "execvpe", fake_exec)
    monkeypatch.delenv("PROXIMA_API_PORT", raising=False)
    monkeypatch.delenv("PROXIMA_API_HOST", raising=False)
    app = typer.Typer()
    cli.register(app)
    r = CliRunner().invoke(app, ["serve", "--model", "/m", *args])
    assert r.exit_code == 0, r.output
    return seen


def test_api_options_become_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _serve(monkeypatch, "--api-port", "8765", "--api-host", "0.0.0.0", "--port", "8001")
    assert seen["env"]["PROXIMA_API_PORT"] == "8765" and seen["env"]["PROXIMA_API_HOST"] == "0.0.0.0"
    # vLLM's own options still pass through untouched.
    assert seen["argv"][2:] == ["vllm.entrypoints.cli.main", "serve", "/m", "--port", "8001"]


def test_no_api_options_no_api(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _serve(monkeypatch)
    assert "PROXIMA_API_PORT" not in seen["env"] and "PROXIMA_API_HOST" not in seen["env"]


def test_api_port_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    execs: list[str] = []
    monkeypatch.setattr(os, "execvpe", lambda path, argv, env: execs.append(path))
    app = typer.Typer()
    cli.register(app)
    r = CliRunner().invoke(app, ["serve", "--model", "/m", "--api-port", "70000"])
    # A usage error (exit 2) naming the option and the bound, and vLLM never started.
    assert r.exit_code == 2 and "--api-port" in r.output and "65535" in r.output, r.output
    assert execs == []
