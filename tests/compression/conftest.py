"""Compression tests run the Triton kernels under the interpreter on CPU.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels (at import of
proxima.compression.triton_ops), so it is set here, at collection, unless a GPU is present.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a64, b64 = a.double(), b.double()
    den = float(b64.norm())
    num = float((a64 - b64).norm())
    return num if den == 0 else num / den
