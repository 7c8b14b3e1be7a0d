"""`proxima serve`'s own checks, run through the real `proxima` console script, and the plugin
loaded by vLLM's own plugin loader. The server itself starts for real in `test_serve_e2e.py`
(which also checks that `--api-port`, `--api-host` and vLLM's own options reach the engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxima.integration.vllm._patches import check_vllm_version

ROOT = Path(__file__).resolve().parents[4]
PROXIMA = Path(sys.executable).with_name("proxima")


def _proxima(*args: str) -> subprocess.CompletedProcess[str]:
    # A wide terminal: typer's error box would otherwise wrap the message mid-sentence.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")} | {"COLUMNS": "400"}
    return subprocess.run([str(PROXIMA), *args], capture_output=True, text=True, timeout=60, env=env)


def test_serve_rejects_an_unknown_policy_name() -> None:
    r = _proxima("serve", "--model", "/m", "--policy", "nope")
    assert r.returncode == 2, r.stderr
    assert "'nope' is neither a file nor a shipped policy (aggressive, balanced, conservative, off)" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("schema_version: 1\nname: x\nbudget: [\n", ":4:1:", "invalid YAML"),
        ("schema_version: 1\nname: x\nbudget:\n  max_blocks_per_step: -3\n", ":4:24:",
         "budget.max_blocks_per_step: Input should be greater than or equal to 1"),
    ],
    ids=["yaml-syntax", "schema"],
)
def test_serve_reports_an_invalid_policy_file_by_line_and_exits_2(
    tmp_path: Path, text: str, where: str, what: str
) -> None:
    """Checked before vLLM starts: a clear FILE:LINE:COL message, exit 2, no traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    r = _proxima("serve", "--model", "/m", "--policy", str(path))
    assert r.returncode == 2, r.stderr
    assert f"{path}{where}" in r.stderr and what in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_plain_vllm_serve_reports_an_invalid_policy_file_by_line_and_exits_2(tmp_path: Path) -> None:
    """`PROXIMA_POLICY=bad.yaml vllm serve MODEL`: the plugin stops vLLM's command line with the
    same message as `proxima serve` (the plugin loads while vLLM builds its parser)."""
    path = tmp_path / "bad.yaml"
    path.write_text("schema_version: 1\nname: x\nbands: 7\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")} | {"PROXIMA_POLICY": str(path)}
    vllm = Path(sys.executable).with_name("vllm")
    r = subprocess.run([str(vllm), "serve", "/m"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{path}:3:8: bands: Input should be a valid list" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_serve_refuses_an_api_port_out_of_range() -> None:
    r = _proxima("serve", "--model", "/m", "--api-port", "70000")
    assert r.returncode == 2, r.stderr
    assert "Invalid value for '--api-port'" in r.stderr and "65535" in r.stderr


@pytest.mark.slow
def test_plugin_does_nothing_without_policy_and_hooks_in_with_one() -> None:
    """The entry point as vLLM loads it (`load_general_plugins`), in a fresh process: without
    PROXIMA_POLICY vLLM's CPU attention backend and engine configuration stay vLLM's own; with it,
    both are Proxima's."""
    code = f"""
import json, os
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum
original = EngineArgs.create_engine_config
def state():
    return [AttentionBackendEnum.CPU_ATTN.get_path(), EngineArgs.create_engine_config is not original]
load_general_plugins()
without = state()
os.environ["PROXIMA_POLICY"] = {str(ROOT / "proxima" / "policies" / "off.yaml")!r}
from proxima.integration.vllm import plugin
plugin.register()
print(json.dumps({{"without": without, "with": state()}}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["without"] == ["vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend", False]
    assert seen["with"] == ["proxima.integration.vllm.attention.cpu.ProximaCPUAttentionBackend", True]


def test_plugin_refuses_unsupported_vllm() -> None:
    check_vllm_version("0.32.0")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32"):
        check_vllm_version("0.40.1")
