"""`proxima serve` hands over to `vllm serve` with PROXIMA_POLICY set (no engine started)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from proxima.integration.vllm import cli

ROOT = Path(__file__).resolve().parents[3]


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
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from proxima.integration.vllm import POLICY_ENV, plugin

    monkeypatch.delenv(POLICY_ENV, raising=False)
    before = (EngineArgs.create_engine_config, AttentionBackendEnum.CPU_ATTN.get_path())
    plugin.register()
    assert (EngineArgs.create_engine_config, AttentionBackendEnum.CPU_ATTN.get_path()) == before


def test_plugin_with_a_policy_installs_backend_and_connector_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends import registry

    from proxima.integration.vllm import CONNECTOR_NAME, POLICY_ENV, plugin

    # vLLM's own create_engine_config needs a real model: a stand-in returns the connector
    # configuration it was handed. monkeypatch restores vLLM's globals afterwards.
    monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self, *a, **k: self.kv_transfer_config)
    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", dict(registry._ATTN_OVERRIDES))
    monkeypatch.setenv(POLICY_ENV, str(ROOT / "configs" / "balanced.yaml"))
    plugin.register()
    wrapped = EngineArgs.create_engine_config
    plugin.register()  # vLLM loads plugins in every process, possibly more than once: idempotent
    assert EngineArgs.create_engine_config is wrapped
    assert registry.AttentionBackendEnum.CPU_ATTN.get_path().endswith("ProximaCPUAttentionBackend")
    cfg = EngineArgs(model="unused").create_engine_config()
    assert cfg is not None and cfg.kv_connector == CONNECTOR_NAME


def test_plugin_refuses_unsupported_vllm() -> None:
    from proxima.integration.vllm._patches import check_vllm_version

    check_vllm_version("0.32.0")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32"):
        check_vllm_version("0.40.1")
