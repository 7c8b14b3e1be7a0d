"""`proxima serve` hands over to `vllm serve` with PROXIMA_POLICY set (no engine started)."""

from __future__ import annotations

import os

import pytest
import typer
from typer.testing import CliRunner

from proxima.integration.vllm import cli


def _app() -> typer.Typer:
    app = typer.Typer()
    cli.register(app)
    return app


def test_serve_execs_vllm_with_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict = {}

    def fake_exec(path: str, argv: list[str], env: dict[str, str]) -> None:
        seen.update(path=path, argv=argv, env=env)

    monkeypatch.setattr(os, "execvpe", fake_exec)
    r = CliRunner().invoke(_app(), ["serve", "--model", "/m", "--policy", "conservative", "--port", "8001"])
    assert r.exit_code == 0, r.output
    assert seen["argv"][2:] == ["vllm.entrypoints.cli.main", "serve", "/m", "--port", "8001"]
    assert seen["env"]["PROXIMA_POLICY"].endswith("configs/conservative.yaml")


def test_serve_rejects_unknown_policy() -> None:
    r = CliRunner().invoke(_app(), ["serve", "--model", "/m", "--policy", "nope"])
    assert r.exit_code != 0 and "shipped policy" in r.output


def test_plugin_is_a_noop_without_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxima.integration.vllm import plugin

    monkeypatch.delenv(plugin.POLICY_ENV, raising=False)
    plugin.register()
    assert plugin._registered is False


def test_plugin_refuses_unsupported_vllm() -> None:
    from proxima.integration.vllm.plugin import check_vllm_version

    check_vllm_version("0.32.0")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32"):
        check_vllm_version("0.40.1")
