"""Triton kernels for every compression op; semantics are those of `reference.py`, step for step.

The kernels live one op per module under `proxima.compression.kernels` (common helpers,
quantize, dequantize, sparsify, cluster); this module is the entry point callers import.
Importing it imports triton. On CPU the kernels run under the interpreter (TRITON_INTERPRET=1
set before triton is imported), which the tests use; on CUDA they compile.

Launch settings (`CLUSTER_WARPS`, ...) are read from their kernel module at launch: change them
there (`kernels.cluster.CLUSTER_WARPS = ...`), not on this module, whose names are copies.
"""

from __future__ import annotations

from proxima.compression.kernels.cluster import (
    CLUSTER_BF16,
    CLUSTER_MAX_REGISTERS,
    CLUSTER_WARPS,
    _cluster_kernel,
    cluster,
)
from proxima.compression.kernels.common import INTERPRET, ROW_TILE, _floor_code, _p2, _round_to_e4m3
from proxima.compression.kernels.dequantize import dequantize
from proxima.compression.kernels.lean import dequantize_lean, quantize_lean
from proxima.compression.kernels.quantize import KEY_ROWS, KEY_TILE_W, quantize
from proxima.compression.kernels.sparsify import sparsify

__all__ = [
    "CLUSTER_BF16",
    "CLUSTER_MAX_REGISTERS",
    "CLUSTER_WARPS",
    "INTERPRET",
    "KEY_ROWS",
    "KEY_TILE_W",
    "ROW_TILE",
    "_cluster_kernel",
    "_floor_code",
    "_p2",
    "_round_to_e4m3",
    "cluster",
    "dequantize",
    "dequantize_lean",
    "quantize",
    "quantize_lean",
    "sparsify",
]
