"""Lean quantization kernels (int4h / int2h, `spec.LEAN_BITS`): one float16 scale per (token, head),
rows rotated by `reference.rotation` in the tile (a [ROWS, D] x [D, D] product), keys without their
block's per-channel mean (stored as `k_zero`). Semantics are `reference.quantize_lean` /
`dequantize_lean` step for step.

The rotation and the mean are float32 sums (`input_precision="ieee"`: tf32 would round the rows to
10 mantissa bits before the codes are made) in another order than torch's, so a rotated value may
differ from the reference's by an ulp, and where that moves a row across a rounding tie (of a code,
of the float16 mean, or between two clipping candidates of equal error) the codes differ there.
Tests bound how often and by how much; the dequantized rows agree to bf16 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from proxima.compression.kernels.common import (
    INTERPRET,
    ROW_TILE,
    _code_to_float,
    _floor_code,
    _p2,
    _pack,
    _slot_contiguous,
    _to_out,
    _unpack,
)
from proxima.compression.reference import LEAN_CLIP, LEAN_MIN_SCALE, rotation
from proxima.compression.spec import LEAN_BITS


@triton.jit
def _lean_quant_kernel(
    x_ptr,  # [N, T, H, D] rows, contiguous
    r_ptr,  # [D, D] float32 rotation
    d_ptr,  # [N, T, H, D / PER] uint8 codes
    s_ptr,  # [N, T, H] float16 scale
    z_ptr,  # [N, 1, H, D] float16 key mean (IS_KEY only)
    T,
    H,
    D: tl.constexpr,  # a power of two >= 16 (spec.SlotSpec and blocks.py check it)
    ROWS: tl.constexpr,  # token rows per chunk, a power of two >= 16 (tl.dot's smallest tile)
    BITS: tl.constexpr,
    PER: tl.constexpr,
    IS_KEY: tl.constexpr,
    K_DEN: tl.constexpr,  # reference.LEAN_CLIP: candidates amax * (K_DEN - i) / K_DEN, i < NCLIP
    NCLIP: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """One program per (block, head): the mean over the block's tokens (keys), then the codes, in
    chunks of ROWS tokens (the second pass reads the block again, from L1 / L2)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    od = tl.arange(0, D)
    orow = tl.arange(0, ROWS)
    base = n * T * H + h  # row of (n, token 0, h); token t is base + t * H
    mean = tl.zeros((D,), tl.float32)
    if IS_KEY:
        acc = tl.zeros((D,), tl.float32)
        for t0 in range(0, T, ROWS):
            ot = t0 + orow
            x = tl.load(x_ptr + (base + ot * H)[:, None] * D + od[None, :], mask=(ot < T)[:, None], other=0.0)
            acc += tl.sum(x.to(tl.float32), axis=0)
        mean16 = tl.math.div_rn(acc, tl.full((D,), 1.0, tl.float32) * T).to(tl.float16)
        tl.store(z_ptr + (n * H + h) * D + od, mean16)
        mean = mean16.to(tl.float32)
    rot = tl.load(r_ptr + od[:, None] * D + od[None, :])
    LEVELS: tl.constexpr = (1 << BITS) - 1
    HALF: tl.constexpr = LEVELS * 0.5
    P: tl.constexpr = D // PER
    op = tl.arange(0, P)
    for t0 in range(0, T, ROWS):
        ot = t0 + orow
        mt = ot < T
        row = base + ot * H
        x = tl.load(x_ptr + row[:, None] * D + od[None, :], mask=mt[:, None], other=0.0).to(tl.float32)
        y = tl.dot(x - mean[None, :], rot, input_precision="ieee")
        amax = tl.max(tl.abs(y), axis=1)
        best_c = tl.zeros((ROWS, D), tl.int32)
        best_s = tl.zeros((ROWS,), tl.float16)
        best_e = tl.full((ROWS,), float("inf"), tl.float32)
        for i in tl.static_range(NCLIP):
            s = tl.maximum(tl.math.div_rn(amax * (K_DEN - i), K_DEN * HALF), MIN_SCALE).to(tl.float16)
            sf = s.to(tl.float32)
            inv = tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32), sf)
            c = _floor_code(y * inv[:, None] + (HALF + 0.5), 0, LEVELS, HW_CVT)
            diff = (_code_to_float(c) - HALF) * sf[:, None] - y
            e = tl.sum(diff * diff, axis=1)
            better = e < best_e  # strict: a tie keeps the larger scale, as the reference
            best_c = tl.where(better[:, None], c, best_c)
            best_s = tl.where(better, s, best_s)
            best_e = tl.where(better, e, best_e)
        tl.store(s_ptr + row, best_s, mask=mt)
        packed = _pack(best_c, ROWS, D, BITS, PER)
        tl.store(d_ptr + row[:, None] * P + op[None, :], packed.to(tl.uint8), mask=mt[:, None])


@triton.jit
def _lean_dequant_kernel(
    d_ptr,  # codes [N, T, H, P]; slot n at n * sd_slot, (T, H, P) contiguous within a slot
    s_ptr,  # scale [N, T, H] float16; slot stride ss_slot
    z_ptr,  # key mean [N, 1, H, D] float16; slot stride sz_slot (HAS_ZERO only)
    r_ptr,  # [D, D] float32 rotation
    o_ptr,  # [N, T, H, D] output, contiguous
    TH,
    H,
    sd_slot,
    ss_slot,
    sz_slot,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    mr = r < TH
    r_safe = tl.where(mr, r, 0).to(tl.int64)
    P: tl.constexpr = D // PER
    op = tl.arange(0, P)
    byte = tl.load(d_ptr + n * sd_slot + r_safe[:, None] * P + op[None, :]).to(tl.int32)
    HALF: tl.constexpr = ((1 << BITS) - 1) * 0.5
    sc = tl.load(s_ptr + n * ss_slot + r_safe).to(tl.float32)
    x = (_code_to_float(_unpack(byte, BITS, PER)) - HALF) * sc[:, None]  # exact: few bits x fp16
    od = tl.arange(0, D)
    rot_t = tl.load(r_ptr + od[None, :] * D + od[:, None])  # R^T: element (i, j) is R[j, i]
    x = tl.dot(x, rot_t, input_precision="ieee")
    if HAS_ZERO:
        x += tl.load(z_ptr + n * sz_slot + (r_safe % H)[:, None] * D + od[None, :]).to(tl.float32)
    row = n * TH + r
    tl.store(o_ptr + row[:, None] * D + od[None, :], _to_out(x, o_ptr.dtype.element_ty, HW_CVT), mask=mr[:, None])


def quantize_lean(
    x: torch.Tensor, quant: str, *, is_key: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [N, T, H, D] -> (codes [N, T, H, P] uint8, scale [N, T, H] float16, keys: mean [N, 1, H, D]
    float16, else None)."""
    n, t, h, d = x.shape
    bits = LEAN_BITS[quant]
    per = 8 // bits
    data = torch.empty(n, t, h, d // per, device=x.device, dtype=torch.uint8)
    scale = torch.empty(n, t, h, device=x.device, dtype=torch.float16)
    zero = torch.empty(n, 1, h, d, device=x.device, dtype=torch.float16) if is_key else None
    if n * t * h == 0:
        return data, scale, zero
    k_den, nclip = LEAN_CLIP[bits]
    _lean_quant_kernel[(n, h)](
        x.contiguous(), rotation(d, x.device), data, scale, zero if zero is not None else scale, t, h,
        D=d, ROWS=max(16, min(_p2(t), ROW_TILE // (4 * d))), BITS=bits, PER=per, IS_KEY=is_key, K_DEN=k_den,
        NCLIP=nclip, MIN_SCALE=LEAN_MIN_SCALE, HW_CVT=not INTERPRET, num_warps=4,
    )  # fmt: skip
    return data, scale, zero


def dequantize_lean(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    quant: str,
    head_dim: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """codes [N, T, H, P] + scale [N, T, H] (+ key mean [N, 1, H, D]) -> [N, T, H, D] in out_dtype.
    Reads pool views in place when each slot is contiguous (as `dequantize` does)."""
    n, t, h, _ = data.shape
    out = torch.empty(n, t, h, head_dim, device=data.device, dtype=out_dtype)
    if n == 0 or t == 0:
        return out
    bits = LEAN_BITS[quant]
    data, scale = _slot_contiguous(data), _slot_contiguous(scale)
    zero = _slot_contiguous(zero) if zero is not None else None
    rows = max(16, min(_p2(t * h), ROW_TILE // head_dim))
    _lean_dequant_kernel[(n, triton.cdiv(t * h, rows))](
        data, scale, zero if zero is not None else scale, rotation(head_dim, data.device), out, t * h, h,
        data.stride(0), scale.stride(0), zero.stride(0) if zero is not None else 0,
        D=head_dim, ROWS=rows, BITS=bits, PER=8 // bits, HAS_ZERO=zero is not None, HW_CVT=not INTERPRET,
        num_warps=4,
    )  # fmt: skip
    return out
