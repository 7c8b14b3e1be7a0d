"""Lean quantization kernels (int4h / int2h, `spec.LEAN_BITS`): the row kernels of
`quantize.py` / `dequantize.py` with one float16 scale per (token, head) and, for keys, the
Hadamard rotation of `reference.rotation` applied in the tile (a [ROWS, D] x [D, D] product).

Semantics are `reference.quantize_lean` / `dequantize_lean` step for step. The rotation is a
float32 product (`input_precision="ieee"`: tf32 would round the keys to 10 mantissa bits before
the codes are made); its summation order is not torch's, so a rotated value may differ from the
reference's by an ulp and a code that sits on a rounding tie may differ by one (tested: rare,
never more than one). Unrotated rows (values) are bit-exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from proxima.compression.kernels.common import INTERPRET, ROW_TILE, _code_to_float, _floor_code, _p2, _pack, _to_out, _unpack
from proxima.compression.reference import LEAN_MIN_SCALE, rotation
from proxima.compression.spec import LEAN_BITS


@triton.jit
def _lean_quant_kernel(
    x_ptr,  # [N * T * H, D] rows, contiguous
    r_ptr,  # [D, D] float32 rotation (read only when ROTATE)
    d_ptr,  # [N * T * H, D / PER] uint8 codes
    s_ptr,  # [N * T * H] float16 scale
    ROWS_TOTAL,
    D: tl.constexpr,  # a power of two >= 16 (spec.SlotSpec checks it)
    ROWS: tl.constexpr,  # a power of two >= 16 (tl.dot's smallest tile)
    BITS: tl.constexpr,
    PER: tl.constexpr,
    ROTATE: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    od = tl.arange(0, D)
    mr = r < ROWS_TOTAL
    x = tl.load(x_ptr + r[:, None] * D + od[None, :], mask=mr[:, None], other=0.0).to(tl.float32)
    if ROTATE:
        rot = tl.load(r_ptr + od[:, None] * D + od[None, :])
        x = tl.dot(x, rot, input_precision="ieee")
    LEVELS: tl.constexpr = (1 << BITS) - 1
    HALF: tl.constexpr = LEVELS * 0.5
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, HALF), MIN_SCALE).to(tl.float16)
    inv = tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32), scale.to(tl.float32))
    code = _floor_code(x * inv[:, None] + (HALF + 0.5), 0, LEVELS, HW_CVT)
    tl.store(s_ptr + r, scale, mask=mr)
    P: tl.constexpr = D // PER
    packed = _pack(code, ROWS, D, BITS, PER)
    op = tl.arange(0, P)
    tl.store(d_ptr + r[:, None] * P + op[None, :], packed.to(tl.uint8), mask=mr[:, None])


@triton.jit
def _lean_dequant_kernel(
    d_ptr,  # codes [N, T, H, P]; slot n at n * sd_slot, (T, H, P) contiguous within a slot
    s_ptr,  # scale [N, T, H] float16; slot stride ss_slot
    r_ptr,  # [D, D] float32 rotation (read only when ROTATE)
    o_ptr,  # [N, T, H, D] output, contiguous
    TH,
    sd_slot,
    ss_slot,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    ROTATE: tl.constexpr,
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
    if ROTATE:
        # x R^T: element (i, j) of R^T is R[j, i]
        rot_t = tl.load(r_ptr + od[None, :] * D + od[:, None])
        x = tl.dot(x, rot_t, input_precision="ieee")
    row = n * TH + r
    tl.store(o_ptr + row[:, None] * D + od[None, :], _to_out(x, o_ptr.dtype.element_ty, HW_CVT), mask=mr[:, None])


def _rows_per_program(rows: int, d: int) -> int:
    return max(16, min(_p2(rows), ROW_TILE // d))


def quantize_lean(x: torch.Tensor, quant: str, *, is_key: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, T, H, D] -> (codes [N, T, H, P] uint8, scale [N, T, H] float16); keys are rotated."""
    n, t, h, d = x.shape
    bits = LEAN_BITS[quant]
    per = 8 // bits
    data = torch.empty(n, t, h, d // per, device=x.device, dtype=torch.uint8)
    scale = torch.empty(n, t, h, device=x.device, dtype=torch.float16)
    total = n * t * h
    if total == 0:
        return data, scale
    rot = rotation(d, x.device)
    rows = _rows_per_program(total, d)
    _lean_quant_kernel[(triton.cdiv(total, rows),)](
        x.contiguous(), rot, data, scale, total, D=d, ROWS=rows, BITS=bits, PER=per, ROTATE=is_key,
        MIN_SCALE=LEAN_MIN_SCALE, HW_CVT=not INTERPRET, num_warps=4,
    )  # fmt: skip
    return data, scale


def dequantize_lean(
    data: torch.Tensor, scale: torch.Tensor, quant: str, head_dim: int, is_key: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    """codes [N, T, H, P] + scale [N, T, H] -> [N, T, H, D] in out_dtype (keys rotated back).
    Reads pool views in place when each slot is contiguous (as `dequantize` does)."""
    n, t, h, _ = data.shape
    out = torch.empty(n, t, h, head_dim, device=data.device, dtype=out_dtype)
    if n == 0 or t == 0:
        return out
    bits = LEAN_BITS[quant]
    if not data[0].is_contiguous():
        data = data.contiguous()
    if not scale[0].is_contiguous():
        scale = scale.contiguous()
    rows = _rows_per_program(t * h, head_dim)
    _lean_dequant_kernel[(n, triton.cdiv(t * h, rows))](
        data, scale, rotation(head_dim, data.device), out, t * h, data.stride(0), scale.stride(0),
        D=head_dim, ROWS=rows, BITS=bits, PER=8 // bits, ROTATE=is_key, HW_CVT=not INTERPRET, num_warps=4,
    )  # fmt: skip
    return out
