"""Dequantization kernels, the inverse of `kernels.quantize` (reads slots of a pool in place)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from proxima.compression.kernels.common import (
    INTERPRET,
    ROW_TILE,
    _code_to_float,
    _kivi,
    _p2,
    _slot_contiguous,
    _to_out,
    _unpack,
)
from proxima.compression.spec import QUANT_CODE, VALUES_PER_BYTE


@triton.jit
def _dequant_rows_tile(
    d_ptr, d_base,  # the slot's codes [T, H, P] from d_base, contiguous
    s_ptr, z_ptr, m_base,  # its scale (zero point) from m_base: [T, H] | [T, H, D/G], contiguous
    o_ptr, o_base,  # the block's output [T, H, D] from o_base, contiguous
    r,  # [ROWS] rows (token, head) of the slot
    TH,
    QUANT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
    BITS: tl.constexpr, PER: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    """The row kernel's work on ROWS rows of one slot, wherever the slot lives
    (`_dequant_rows_kernel`: a strided batch; `kernels.step`: slots of every layer by index)."""
    mr = r < TH
    r_safe = tl.where(mr, r, 0).to(tl.int64)
    P: tl.constexpr = D // PER
    BP: tl.constexpr = BLOCK_D // PER
    op = tl.arange(0, BP)
    mp = mr[:, None] & (op < P)[None, :]
    od = tl.arange(0, BLOCK_D)
    m2 = mr[:, None] & (od < D)[None, :]
    if QUANT == 1 or QUANT == 2:
        # no `other`: it cannot be cast to fp8; masked lanes are never stored
        raw = tl.load(d_ptr + d_base + r_safe[:, None] * P + od[None, :], mask=m2)
        if QUANT == 1:
            xf = raw.to(tl.float32)
        else:
            xf = (raw.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        sc = tl.load(s_ptr + m_base + r_safe)
        x = xf * sc[:, None]
    else:
        # int4 / int2 values: byte j holds channels j*PER .. j*PER+PER-1, all in group j*PER // G
        byte = tl.load(d_ptr + d_base + r_safe[:, None] * P + op[None, :], mask=mp, other=0).to(tl.int32)
        code = _code_to_float(_unpack(byte, BITS, PER))  # [ROWS, BLOCK_D]
        NG: tl.constexpr = BLOCK_D // GROUP
        DG: tl.constexpr = D // GROUP
        og = tl.arange(0, NG)
        mg = mr[:, None] & (og < DG)[None, :]
        m_off = m_base + r_safe[:, None] * DG + og[None, :]
        sc = tl.load(s_ptr + m_off, mask=mg, other=1.0).to(tl.float32)
        zp = tl.load(z_ptr + m_off, mask=mg, other=0.0).to(tl.float32)
        x3 = tl.reshape(code, (ROWS, NG, GROUP)) * sc[:, :, None] + zp[:, :, None]
        x = tl.reshape(x3, (ROWS, BLOCK_D))
    o_off = o_base + r.to(tl.int64)[:, None] * D + od[None, :]
    tl.store(o_ptr + o_off, _to_out(x, o_ptr.dtype.element_ty, HW_CVT), mask=m2)


@triton.jit
def _dequant_rows_kernel(
    d_ptr,  # codes [N, T, H, P]; slot n at n * sd_slot, (T, H, P) contiguous within a slot
    s_ptr,  # scale [N, T, H] f32 (fp8 / int8 values) | [N, T, H, D/G] f16; slot stride ss_slot
    z_ptr,  # zero point, like scale (int4 / int2 only)
    o_ptr,  # [N, T, H, D] output, contiguous
    TH,
    sd_slot,
    ss_slot,
    QUANT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    _dequant_rows_tile(d_ptr, n * sd_slot, s_ptr, z_ptr, n * ss_slot, o_ptr, n * TH * D, r, TH,
                       QUANT, D, BLOCK_D, ROWS, GROUP, BITS, PER, HW_CVT)


@triton.jit
def _dequant_keys_tile(
    d_ptr, d_base,  # the slot's codes [T, H, P] from d_base, contiguous
    s_ptr, z_ptr, m_base,  # its [Gk, H, D] f16 scale and zero point from m_base, contiguous
    o_ptr, o_base,  # the block's output [T, H, D] from o_base, contiguous
    g, cb,  # token group, channel block
    T,
    W: tl.constexpr, BLOCK_W: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
    HW_CVT: tl.constexpr,
):  # fmt: skip
    ot = g * GROUP + tl.arange(0, GROUP)
    mt = ot < T
    t_safe = tl.where(mt, ot, 0).to(tl.int64)
    BP: tl.constexpr = BLOCK_W // PER
    op = cb * BP + tl.arange(0, BP)
    mp = mt[:, None] & (op < W // PER)[None, :]
    byte = tl.load(d_ptr + d_base + t_safe[:, None] * (W // PER) + op[None, :], mask=mp, other=0).to(tl.int32)
    code = _code_to_float(_unpack(byte, BITS, PER))  # [GROUP, BLOCK_W]
    oc = cb * BLOCK_W + tl.arange(0, BLOCK_W)
    mc = oc < W
    m_off = m_base + g * W + oc
    sc = tl.load(s_ptr + m_off, mask=mc, other=1.0).to(tl.float32)  # once per group, not per token
    zp = tl.load(z_ptr + m_off, mask=mc, other=0.0).to(tl.float32)
    x = code * sc[None, :] + zp[None, :]
    m2 = mt[:, None] & mc[None, :]
    o_off = o_base + ot.to(tl.int64)[:, None] * W + oc[None, :]
    tl.store(o_ptr + o_off, _to_out(x, o_ptr.dtype.element_ty, HW_CVT), mask=m2)


@triton.jit
def _dequant_keys_kernel(
    d_ptr,  # [N, T, H, P] codes; slot n at n * sd_slot, (T, H, P) contiguous within a slot
    s_ptr,  # [N, Gk, H, D] f16 scale; slot stride ss_slot, (Gk, H, D) contiguous
    z_ptr,  # zero point, like scale
    o_ptr,  # [N, T, H, D] output, contiguous
    T,
    sd_slot,
    ss_slot,
    W: tl.constexpr,  # H * D
    BLOCK_W: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    _dequant_keys_tile(d_ptr, n * sd_slot, s_ptr, z_ptr, n * ss_slot, o_ptr, n * T * W, tl.program_id(1),
                       tl.program_id(2), T, W, BLOCK_W, GROUP, BITS, PER, HW_CVT)


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    quant: str,
    group: int,
    head_dim: int,
    is_key: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """data [N, T, H, P] + metadata -> [N, T, H, D] in out_dtype."""
    n, t, h, _ = data.shape
    out = torch.empty(n, t, h, head_dim, device=data.device, dtype=out_dtype)
    if n == 0 or t == 0:
        return out
    assert scale is not None, f"{quant} needs its scale"
    per = VALUES_PER_BYTE.get(quant, 1)
    bits = 8 // per
    data, scale = _slot_contiguous(data), _slot_contiguous(scale)
    zero = _slot_contiguous(zero) if zero is not None else scale
    if zero.stride(0) != scale.stride(0):  # the kernels share one metadata slot stride
        scale, zero = scale.contiguous(), zero.contiguous()
    if _kivi(quant, is_key) and is_key:
        block_w = min(_p2(h * head_dim, 16), max(16, ROW_TILE // group))
        grid = (n, triton.cdiv(t, group), triton.cdiv(h * head_dim, block_w))
        _dequant_keys_kernel[grid](
            data, scale, zero, out, t, data.stride(0), scale.stride(0),
            W=h * head_dim, BLOCK_W=block_w, GROUP=group, BITS=bits, PER=per, HW_CVT=not INTERPRET, num_warps=4,
        )  # fmt: skip
    else:
        block_d = _p2(head_dim, 16)
        rows = max(1, min(_p2(t * h), ROW_TILE // block_d))
        _dequant_rows_kernel[(n, triton.cdiv(t * h, rows))](
            data, scale, zero, out, t * h, data.stride(0), scale.stride(0),
            QUANT=QUANT_CODE[quant], D=head_dim, BLOCK_D=block_d, ROWS=rows, GROUP=group, BITS=bits, PER=per,
            HW_CVT=not INTERPRET, num_warps=4,
        )  # fmt: skip
    return out


