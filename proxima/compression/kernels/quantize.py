"""Quantization kernels (fp8, int8, KIVI int4 / int2): one pass over the data; see reference.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from proxima.compression.kernels.common import (
    INTERPRET,
    ROW_TILE,
    _floor_code,
    _kivi,
    _p2,
    _pack,
    _to_e4m3,
)
from proxima.compression.spec import FP8_E4M3_MAX, INT8_MAX, QUANT_CODE, VALUES_PER_BYTE


@triton.jit
def _x_offsets(x_base, t, c, pos_ptr, HS, W: tl.constexpr, D: tl.constexpr, PAGES: tl.constexpr, mask):
    """Offsets of elements (token t, channel c of the flattened (head, channel) axis, broadcast
    shapes) of one block's keys or values: [T, H, D] contiguous from `x_base`, or (PAGES) a KV
    page set from `x_base` (head h's page at h * HS, element (t, d) at `pos_ptr[t * D + d]`, the
    attention kernel's page order, `worker.page_layout`)."""
    if PAGES:
        pos = tl.load(pos_ptr + t * D + c % D, mask=mask, other=0)
        return x_base + (c // D) * HS + pos
    else:
        return x_base + t * W + c


@triton.jit
def _quant_rows_tile(
    x_ptr, x_base, pos_ptr, HS,  # the block's keys or values (`_x_offsets`)
    d_ptr, d_base,  # codes: the block's [T, H, P] from d_base, contiguous
    s_ptr, z_ptr, m_base,  # scale (zero point) of the block from m_base: [T, H] | [T, H, D/G], contiguous
    r,  # [ROWS] rows (token, head) of the block
    TH, H,
    PAGES: tl.constexpr, QUANT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
    GROUP: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, QMAX: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    """The row kernel's work on ROWS rows of one block, wherever the block and its outputs live
    (`_quant_rows_kernel`: contiguous batches; `kernels.step`: pages and slot pools)."""
    od = tl.arange(0, BLOCK_D)
    mr = r < TH
    m2 = mr[:, None] & (od < D)[None, :]
    rr = r.to(tl.int64)
    x_off = _x_offsets(x_base, (rr // H)[:, None], ((rr % H) * D)[:, None] + od[None, :], pos_ptr, HS, H * D, D,
                       PAGES, m2)
    x = tl.load(x_ptr + x_off, mask=m2, other=0.0).to(tl.float32)
    P: tl.constexpr = D // PER
    if QUANT == 1 or QUANT == 2:
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)
        # one division per row, a multiply per element; reference.py does the same two steps
        y = x * tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32), scale)[:, None]
        if QUANT == 1:
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
            tl.store(d_ptr + d_base + rr[:, None] * D + od[None, :], _to_e4m3(y, HW_CVT), mask=m2)
        else:
            code = _floor_code(y + 0.5, -127, 127, HW_CVT)
            tl.store(d_ptr + d_base + rr[:, None] * D + od[None, :], code.to(tl.int8), mask=m2)
        tl.store(s_ptr + m_base + rr, scale, mask=mr)
    else:
        # KIVI values: per row, groups of GROUP channels (D % GROUP == 0, checked by blocks.py)
        LEVELS: tl.constexpr = (1 << BITS) - 1
        NG: tl.constexpr = BLOCK_D // GROUP
        x3 = tl.reshape(x, (ROWS, NG, GROUP))
        lo = tl.min(x3, axis=2)
        hi = tl.max(x3, axis=2)
        rng = hi - lo
        scale = tl.where(rng > 0, tl.math.div_rn(rng, LEVELS * 1.0), 1.0).to(tl.float16)
        zero = lo.to(tl.float16)
        inv = tl.math.div_rn(tl.full((ROWS, NG), 1.0, tl.float32), scale.to(tl.float32))
        y3 = (x3 - zero.to(tl.float32)[:, :, None]) * inv[:, :, None] + 0.5
        code = _floor_code(tl.reshape(y3, (ROWS, BLOCK_D)), 0, LEVELS, HW_CVT)
        og = tl.arange(0, NG)
        DG: tl.constexpr = D // GROUP
        mg = mr[:, None] & (og < DG)[None, :]
        tl.store(s_ptr + m_base + rr[:, None] * DG + og[None, :], scale, mask=mg)
        tl.store(z_ptr + m_base + rr[:, None] * DG + og[None, :], zero, mask=mg)
        BP: tl.constexpr = BLOCK_D // PER
        packed = _pack(code, ROWS, BLOCK_D, BITS, PER)
        op = tl.arange(0, BP)
        mp = mr[:, None] & (op < P)[None, :]
        tl.store(d_ptr + d_base + rr[:, None] * P + op[None, :], packed.to(tl.uint8), mask=mp)


@triton.jit
def _quant_rows_kernel(
    x_ptr,  # [N, T, H, D] keys or values, contiguous
    d_ptr,  # [N, T, H, P] codes, contiguous
    s_ptr,  # scale: [N, T, H] f32 (fp8 / int8) | [N, T, H, D/G] f16 (int4 / int2 values)
    z_ptr,  # zero point [N, T, H, D/G] f16 (int4 / int2 only)
    TH,  # rows per block (T * H)
    H,
    QUANT: tl.constexpr,  # spec.QUANT_CODE: 1 fp8, 2 int8, 3 int4, 4 int2
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= D
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    QMAX: tl.constexpr,  # 448 (fp8) or 127 (int8)
    HW_CVT: tl.constexpr,
    MG: tl.constexpr,  # metadata per row: D / G (int4 / int2 values), else 1
):
    n = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # row (token, head) within block n
    _quant_rows_tile(x_ptr, n * TH * D, x_ptr, 0, d_ptr, n * TH * (D // PER), s_ptr, z_ptr, n * TH * MG, r, TH, H,
                     False, QUANT, D, BLOCK_D, ROWS, GROUP, BITS, PER, QMAX, HW_CVT)


@triton.jit
def _quant_keys_tile(
    x_ptr, x_base, pos_ptr, HS,  # the block's keys (`_x_offsets`)
    d_ptr, d_base,  # the block's [T, H, P] uint8 codes from d_base, contiguous
    s_ptr, z_ptr, m_base,  # the block's [Gk, H, D] f16 scale and zero point from m_base, contiguous
    g, cb,  # token group, channel block
    T,
    PAGES: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,  # H * D
    BLOCK_W: tl.constexpr,  # channels per program (power of two; D % PER == 0 keeps bytes whole)
    GROUP: tl.constexpr,
    RT: tl.constexpr,  # token rows per chunk (divides GROUP)
    BITS: tl.constexpr,
    PER: tl.constexpr,
    EVEN: tl.constexpr,  # T % GROUP == 0 and W % BLOCK_W == 0: every tile is whole, no masks
    HW_CVT: tl.constexpr,
):
    """Two passes over the group's [GROUP, BLOCK_W] tile in chunks of RT token rows: min / max per
    channel, then the codes (the second pass reads the tile again, from L1 / L2). Triton gives a
    thread 16 channels of a chunk (one 16-byte store of int8 codes), and quantize() launches one
    warp per 512 channels, so warps split the channels, never the tokens: the reductions stay in a
    thread or a warp (a shuffle), with no shared memory or barriers for int8. (int4 / int2 pack PER
    neighbouring channels of a thread's row into a byte; Triton moves them through shared memory
    with a barrier, once per chunk.) The chunk loops are not unrolled: unrolled, ptxas hoisted
    every chunk's loads and spilled. (The one-pass kernel this
    replaced reduced across warps and ran at a third of the copy bandwidth on the H200.)"""
    oc = cb * BLOCK_W + tl.arange(0, BLOCK_W)
    orow = tl.arange(0, RT)
    mc = oc < W
    LEVELS: tl.constexpr = (1 << BITS) - 1
    lo = tl.full((BLOCK_W,), float("inf"), tl.float32)
    hi = tl.full((BLOCK_W,), float("-inf"), tl.float32)
    for r0 in range(0, GROUP, RT):
        ot = (g * GROUP + r0 + orow).to(tl.int64)
        m2 = (ot < T)[:, None] & mc[None, :]
        x_off = _x_offsets(x_base, ot[:, None], oc[None, :], pos_ptr, HS, W, D, PAGES, m2)
        if EVEN:
            x = tl.load(x_ptr + x_off).to(tl.float32)
            lo = tl.minimum(lo, tl.min(x, axis=0))
            hi = tl.maximum(hi, tl.max(x, axis=0))
        else:  # a short last group: its valid tokens only
            x = tl.load(x_ptr + x_off, mask=m2, other=0.0).to(tl.float32)
            lo = tl.minimum(lo, tl.min(tl.where(m2, x, float("inf")), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(m2, x, float("-inf")), axis=0))
    if not EVEN:
        lo = tl.where(mc, lo, 0.0)
        hi = tl.where(mc, hi, 0.0)
    rng = hi - lo
    scale = tl.where(rng > 0, tl.math.div_rn(rng, LEVELS * 1.0), 1.0).to(tl.float16)
    zero = lo.to(tl.float16)
    inv = tl.math.div_rn(tl.full((BLOCK_W,), 1.0, tl.float32), scale.to(tl.float32))
    m_off = m_base + g * W + oc
    if EVEN:
        tl.store(s_ptr + m_off, scale)
        tl.store(z_ptr + m_off, zero)
    else:
        tl.store(s_ptr + m_off, scale, mask=mc)
        tl.store(z_ptr + m_off, zero, mask=mc)
    BP: tl.constexpr = BLOCK_W // PER
    op = cb * BP + tl.arange(0, BP)
    zf = zero.to(tl.float32)
    for r0 in range(0, GROUP, RT):
        ot = (g * GROUP + r0 + orow).to(tl.int64)
        m2 = (ot < T)[:, None] & mc[None, :]
        x_off = _x_offsets(x_base, ot[:, None], oc[None, :], pos_ptr, HS, W, D, PAGES, m2)
        if EVEN:
            x = tl.load(x_ptr + x_off).to(tl.float32)
        else:
            x = tl.load(x_ptr + x_off, mask=m2, other=0.0)
            x = x.to(tl.float32)
        code = _floor_code((x - zf[None, :]) * inv[None, :] + 0.5, 0, LEVELS, HW_CVT)
        packed = _pack(code, RT, BLOCK_W, BITS, PER).to(tl.uint8)
        d_off = d_base + ot[:, None] * (W // PER) + op[None, :]
        if EVEN:
            tl.store(d_ptr + d_off, packed)
        else:
            tl.store(d_ptr + d_off, packed, mask=(ot < T)[:, None] & (op < W // PER)[None, :])


@triton.jit
def _quant_keys_kernel(
    x_ptr,  # [N, T, H, D] keys, contiguous: row (n, t) holds W = H * D channels
    d_ptr,  # [N, T, H, P] uint8 codes, contiguous
    s_ptr,  # [N, Gk, H, D] f16 scale
    z_ptr,  # [N, Gk, H, D] f16 zero point
    T,
    D: tl.constexpr,
    W: tl.constexpr,  # H * D
    BLOCK_W: tl.constexpr,
    GROUP: tl.constexpr,
    RT: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    EVEN: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """One program per (block, token group, channel block): `_quant_keys_tile`."""
    n = tl.program_id(0).to(tl.int64)
    GK = (T + GROUP - 1) // GROUP
    _quant_keys_tile(x_ptr, n * T * W, x_ptr, 0, d_ptr, n * T * (W // PER), s_ptr, z_ptr, n * GK * W,
                     tl.program_id(1), tl.program_id(2), T, False, D, W, BLOCK_W, GROUP, RT, BITS, PER, EVEN, HW_CVT)


KEY_TILE_W = 256
KEY_ROWS = 16
"""A key-quantization program: KEY_TILE_W channels, in chunks of KEY_ROWS token rows (one warp per
512 channels, so one warp here; 8 KV heads x 128 channels make 4 programs per group). Timed on the
H200 (256 MiB of bf16 KV, compress int8 / int4, 2026-12-02): 256 x 16 128 / 131 us, 256 x 8
134 / 136, 512 x 8 141 / 139, 512 x 4 152 / 160 (the one-pass kernel before it: 237 / 223)."""


def quantize(
    x: torch.Tensor, quant: str, group: int, *, is_key: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [N, T, H, D] -> (data [N, T, H, P], scale, zero | None); layouts as in reference.py."""
    n, t, h, d = x.shape
    dev = x.device
    per = VALUES_PER_BYTE.get(quant, 1)
    bits = 8 // per
    x = x.contiguous()  # one flat [N * T * H, D] view for every kernel (a no-op for compress inputs)
    zero: torch.Tensor | None = None
    if not _kivi(quant, is_key):
        data = torch.empty(n, t, h, d, device=dev, dtype=torch.float8_e4m3fn if quant == "fp8" else torch.int8)
        scale = torch.empty(n, t, h, device=dev, dtype=torch.float32)
    else:
        data = torch.empty(n, t, h, d // per, device=dev, dtype=torch.uint8)
        if is_key:
            scale = torch.empty(n, -(-t // group), h, d, device=dev, dtype=torch.float16)
        else:
            scale = torch.empty(n, t, h, d // group, device=dev, dtype=torch.float16)
        zero = torch.empty_like(scale)
    if n == 0:
        return data, scale, zero
    z = zero if zero is not None else scale
    if _kivi(quant, is_key) and is_key:
        # a chunk of KEY_ROWS token rows x block_w channels; one warp per 512 channels, so that warps
        # split channels only (see _quant_keys_kernel): at KEY_TILE_W = 256 that is one warp
        block_w = min(_p2(h * d, 16), KEY_TILE_W)
        grid = (n, triton.cdiv(t, group), triton.cdiv(h * d, block_w))
        _quant_keys_kernel[grid](
            x, data, scale, z, t, D=d, W=h * d, BLOCK_W=block_w, GROUP=group, RT=min(KEY_ROWS, group), BITS=bits,
            PER=per, EVEN=t % group == 0 and (h * d) % block_w == 0, HW_CVT=not INTERPRET,
            num_warps=max(1, min(4, block_w // 512)),
        )  # fmt: skip
    else:
        block_d = _p2(d, 16)
        rows = max(1, min(_p2(t * h), ROW_TILE // block_d))
        _quant_rows_kernel[(n, triton.cdiv(t * h, rows))](
            x, data, scale, z, t * h, h,
            QUANT=QUANT_CODE[quant], D=d, BLOCK_D=block_d, ROWS=rows, GROUP=group, BITS=bits, PER=per,
            QMAX=FP8_E4M3_MAX if quant == "fp8" else INT8_MAX, HW_CVT=not INTERPRET,
            MG=d // group if quant in ("int4", "int2") else 1, num_warps=4,
        )  # fmt: skip
    return data, scale, zero


