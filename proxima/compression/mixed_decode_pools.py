"""The one-pass decode's pool descriptors: one int64 row per format code saying where and how the
kernel (`mixed_decode.py`) reads that code's slots.

Named apart from the kernel so that the lean reader (`mixed_decode_lean.py`) and the kernel read
the same fields through one `_desc` without importing each other.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from proxima.compression.blocks import CompressedBlocks, kept_count
from proxima.compression.reference import rotation
from proxima.compression.spec import LEAN_BITS, QUANT_CODE

# descriptor fields (one int64 row per format code; row 0, the hot code, is unused and all zeros)
F_QUANT, F_TOKENS, F_REDUCED, F_GROUP = 0, 1, 2, 3
F_DATA_SLOT, F_DATA_T, F_DATA_H, F_V_DATA = 4, 5, 6, 7
F_KS, F_KZ, F_VS, F_VZ, F_LC = 8, 9, 10, 11, 12
F_KS_SLOT, F_KS_T, F_KS_H, F_VS_SLOT, F_VS_T, F_VS_H, F_LC_SLOT, F_LC_T, F_LC_H = range(13, 22)
F_K_DATA = 22
F_KZ_SLOT, F_KZ_H, F_ROT = 23, 24, 25
"""Lean codes only: the key mean's slot and head strides (its shape, [N, 1, H, D], is not its
scale's [N, C, H]) and the address of the rotation's first column (`lean_rotation_column`)."""
NUM_FIELDS = 26  # `_desc` spells it out: a jitted function reads no module global
READS_QUANTS = frozenset({"fp8", "int8", "int4", "int2", *LEAN_BITS})
"""Quantizations of the slots the one-pass kernel reads (bf16 slots, e.g. `cluster(2)` alone, are
read by the split path only)."""
MAX_CODES = 16
"""Rows of a layer's persistent descriptor table (format codes 1..15; 0 is vLLM's pages)."""


@functools.cache
def lean_rotation_column(head_dim: int, device: torch.device) -> torch.Tensor:
    """float32 [D]: column 0 of `reference.rotation(D)` = diag(s) H / sqrt(D), i.e. the signs s
    over sqrt(D) (H's first column is all ones). With H built in registers it is all the kernel
    needs of the rotation. The rotation is global (a constant seed, a function of D only), so one
    tensor per (D, device) serves every layer; cached without eviction because descriptor rows hold
    its address and CUDA graphs replay them for the life of the process."""
    return rotation(head_dim, device)[:, 0].contiguous().clone()


def pool_descriptors(pools: Mapping[int, CompressedBlocks], block_size: int, device: torch.device) -> torch.Tensor:
    """int64 [max code + 1, NUM_FIELDS]: how the kernel reads the slots of each format code.

    `pools[code]` is that code's slot pool in this layer (`layer.slot_pool`-like views: k_data
    and v_data alias the KV cache bytes, metadata in side tables). Addresses are raw pointers:
    the table is valid while the pools' tensors live (the worker's pools live as long as the
    caches). Build it once per layer and keep it: its contents change only when a new format
    appears."""
    rows = max(pools, default=0) + 1
    d = torch.zeros(rows, NUM_FIELDS, dtype=torch.int64)
    for code, p in pools.items():
        if code <= 0:
            raise ValueError(f"pool code {code}: codes start at 1 (0 is vLLM's bf16 pages)")
        q = p.fmt.quant
        if q not in READS_QUANTS:
            raise ValueError(
                f"{p.fmt}: the mixed decode kernel reads {', '.join(sorted(READS_QUANTS))} slots, "
                f"not {q} (set PROXIMA_ONE_PASS_DECODE=0: the split path reads them)"
            )
        k8, v8 = p.k_data.view(torch.uint8), p.v_data.view(torch.uint8)
        if k8.stride(-1) != 1 or k8.stride(1) != k8.shape[2] * k8.stride(2):
            raise ValueError(f"{p.fmt}: slot data must be [slots, C, H, P] with dense tokens, strides {k8.stride()}")
        if v8.stride()[:3] != k8.stride()[:3]:
            raise ValueError(f"{p.fmt}: keys and values must share strides, got {k8.stride()} and {v8.stride()}")
        if q not in LEAN_BITS and p.head_dim % 64 == 0 and any(
            x % 16 for x in (k8.data_ptr(), v8.data_ptr(), *k8.stride()[:3])
        ):  # the compressed kernel reads such rows 16 bytes at a time, aligned (`mixed_comp._byte_rows`)
            raise ValueError(f"{p.fmt}: slot data must be 16-byte aligned at head dim {p.head_dim}, got addresses "
                             f"{k8.data_ptr() % 16}, {v8.data_ptr() % 16} mod 16 and strides {k8.stride()[:3]}")
        d[code, F_QUANT] = QUANT_CODE[q]
        d[code, F_TOKENS] = kept_count(p.fmt, block_size)
        d[code, F_REDUCED] = int(p.fmt.reduction is not None)
        d[code, F_GROUP] = p.group_size
        d[code, F_DATA_SLOT], d[code, F_DATA_T], d[code, F_DATA_H] = k8.stride()[:3]
        d[code, F_K_DATA], d[code, F_V_DATA] = k8.data_ptr(), v8.data_ptr()
        for f_ptr, f_str, t in (
            (F_KS, F_KS_SLOT, p.k_scale),
            (F_VS, F_VS_SLOT, p.v_scale),
            (F_LC, F_LC_SLOT, p.log_count),
        ):
            if t is not None:
                d[code, f_ptr] = t.data_ptr()
                d[code, f_str : f_str + 3] = torch.tensor(t.stride()[:3])
        if q in LEAN_BITS:  # key mean [N, 1, H, D], dense in D; values have no zero point
            kz = p.k_zero
            if kz is None or kz.dim() != 4 or kz.shape[1] != 1 or kz.stride(-1) != 1:
                raise ValueError(
                    f"{p.fmt}: the key mean must be [slots, 1, H, D] dense in D, got "
                    f"{None if kz is None else (tuple(kz.shape), kz.stride())}"
                )
            d[code, F_KZ] = kz.data_ptr()
            d[code, F_KZ_SLOT], d[code, F_KZ_H] = kz.stride(0), kz.stride(2)
            d[code, F_ROT] = lean_rotation_column(p.head_dim, kz.device).data_ptr()
            continue
        for f_ptr, t, like in ((F_KZ, p.k_zero, p.k_scale), (F_VZ, p.v_zero, p.v_scale)):
            if t is not None:
                if like is None or t.stride() != like.stride():
                    raise ValueError(f"{p.fmt}: zero points must share their scales' strides")
                d[code, f_ptr] = t.data_ptr()
    return d.to(device)


@triton.jit
def _desc_row(desc_ptr, code):
    """Address of format `code`'s descriptor row (`code` a scalar or a vector of codes): the one
    place the kernels spell the row length out (a jitted function reads no module global)."""
    return desc_ptr + code * 26  # 26: NUM_FIELDS


@triton.jit
def _desc(desc_ptr, code, field: tl.constexpr):
    return tl.load(_desc_row(desc_ptr, code) + field)


__all__ = ["MAX_CODES", "NUM_FIELDS", "READS_QUANTS", "lean_rotation_column", "pool_descriptors"]
