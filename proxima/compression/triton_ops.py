"""Triton kernels for every compression op; semantics are those of `reference.py`, step for step.

Importing this module imports triton. On CPU the kernels run under the interpreter
(TRITON_INTERPRET=1 set before triton is imported), which the tests use; on CUDA they compile.
Offsets that can exceed 2^31 (slot * slot stride on a many-GB pool) are computed in int64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from proxima.compression.spec import FP8_E4M3_MAX, INT8_MAX, QUANT_CODE, VALUES_PER_BYTE

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Kernels that work around interpreter-only bugs check this (it is read once, like triton does)."""


def _p2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


# ============================================================================================
# quantize


@triton.jit
def _round_to_e4m3(y):
    """Round float32 y (|y| <= 448) to the nearest float8 e4m3 value, ties to even, in fp32.

    The cast that follows is then exact. Only the interpreter needs it: Triton's (3.9) mis-rounds
    fp32 -> fp8 when the mantissa carries into the exponent (124.3 -> 64). The GPU's convert rounds
    the same way in one instruction per two values, and the ~20 integer ops a value here cost
    were what bounded fp8 compression at 59% of the copy roofline (`_to_e4m3`). Normal range: keep 3 mantissa bits by an
    integer add of half an ulp (+1 if the kept lsb is odd); subnormals (|y| < 2^-6) sit on a
    fixed 2^-9 grid, rounded half to even as well (z = y * 2^9 is exact; a tie that floor(z + 0.5)
    rounded to an odd integer goes one down), keeping the sign of zero, so the codes equal torch's
    bit for bit.
    """
    bits = y.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = r.to(tl.float32, bitcast=True)
    z = y * 512.0
    t = tl.floor(z + 0.5)
    t = tl.where((t - z == 0.5) & (t - 2.0 * tl.floor(t * 0.5) != 0.0), t - 1.0, t)
    sub = tl.where(y < 0, -tl.abs(t), t) / 512.0  # a negative value that rounds to zero is -0, as in torch
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


@triton.jit
def _round_to_bf16(x):
    """Round float32 to the nearest bfloat16, ties to even, so the cast after it is exact (the
    interpreter's fp32 -> bf16 cast truncates; the GPU's rounds, and this matches both)."""
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return r.to(tl.float32, bitcast=True)


# Compress and decompress are one pass over the data each, in two tile shapes (issue 15):
#
# - *row* kernels (fp8 keys and values, int8 values, int4 / int2 values): a row is one (token,
#   head) of D channels; a program takes ROWS rows of one block, a contiguous [ROWS, D] tile
#   (32 KB of bf16 at D 128), so every load and store is a wide vector.
# - *key* kernels (KIVI keys of int8 / int4 / int2): a program takes one group of GROUP tokens
#   and BLOCK_W channels of the flattened (head, channel) axis, [GROUP, BLOCK_W] contiguous rows,
#   and reduces min / max over the tokens; the group's scale row is loaded or stored once. The
#   quantizer walks the group in chunks of token rows, twice (min / max, then codes), so that its
#   warps split channels only (`_quant_keys_kernel`).
#
# No per-element int <-> float converts or floor instructions: on the H200 those run on the
# conversion pipe at 16 lanes per clock per SM (an eighth of the FMA rate), and a memory-bound
# pass over 256 MiB has about 24 lane-instructions per element in total. Codes are made with one
# add rounded toward -inf into a float's mantissa instead (exact, see `_floor_code`), read back by OR-ing them into
# a float's mantissa (`_code_to_float`), and packed / unpacked with tl.split / tl.interleave on
# register-local pairs (no gather of the same byte by two lanes).

ROW_TILE = 8192
"""Elements per row-kernel program (rows x padded D) and per key-dequantization program (group x
channels): 32 KB of bf16 in, 64 fp32 registers a thread at 4 warps."""


@triton.jit
def _floor_code(t, LO: tl.constexpr, HI: tl.constexpr, HW_RND: tl.constexpr):
    """floor(t) clamped to [LO, HI] (integers, |.| < 2^22) as int32, without FRND / F2I.

    clamp(floor(t), LO, HI) == floor(clamp(t, LO, HI)) because floor is monotone and LO, HI are
    integers. On the GPU (HW_RND) one add rounded toward -inf does it: the exact sum
    t + 2^23 - LO lies in [2^23, 2^24), where the float grid is the integers, so rounding it down
    gives floor(t) + 2^23 - LO, and its low mantissa bits hold floor(t) - LO. The interpreter has
    no directed rounding: there m = t + 1.5 * 2^23 rounds t to the nearest integer (ties to even)
    and one is taken off where that rounded up (m - 1.5 * 2^23 > t, exact), which is floor too.
    Both give the same integer for every t (tests/compression/test_quant.py checks the GPU's).
    """
    t = tl.minimum(tl.maximum(t, LO * 1.0), HI * 1.0)
    if HW_RND:
        m = libdevice.add_rd(t, 8388608.0 - LO)
        return m.to(tl.int32, bitcast=True) - (0x4B000000 - LO)
    else:
        m = t + 12582912.0
        q = m.to(tl.int32, bitcast=True) - 0x4B400000
        return q - ((m - 12582912.0) > t).to(tl.int32)


@triton.jit
def _code_to_float(c):
    """Exact float32 of int32 codes in [0, 2^23): the code OR-ed into the mantissa of 2^23."""
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _pack(codes, R: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr):
    """[R, W] int32 codes -> [R, W / PER] int32 bytes, element j*PER+i in bits [i*BITS, (i+1)*BITS)."""
    if PER == 1:
        return codes & 0xFF
    elif PER == 2:
        c0, c1 = tl.split(tl.reshape(codes, (R, W // 2, 2)))
        return c0 | (c1 << BITS)
    else:
        # [R, W/4, a, b] with i = 2a + b: the last split separates b, the next one a
        e, o = tl.split(tl.reshape(codes, (R, W // 4, 2, 2)))
        c0, c2 = tl.split(e)
        c1, c3 = tl.split(o)
        return c0 | (c1 << BITS) | (c2 << (2 * BITS)) | (c3 << (3 * BITS))


@triton.jit
def _unpack(byte, BITS: tl.constexpr, PER: tl.constexpr):
    """Inverse of `_pack`: [R, P] int32 bytes -> [R, P * PER] int32 codes in element order."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if PER == 1:
        return byte
    elif PER == 2:
        return tl.interleave(byte & MASK, byte >> BITS)
    else:
        c0 = byte & MASK
        c1 = (byte >> BITS) & MASK
        c2 = (byte >> (2 * BITS)) & MASK
        c3 = byte >> (3 * BITS)
        return tl.interleave(tl.interleave(c0, c2), tl.interleave(c1, c3))


@triton.jit
def _to_e4m3(y, HW_CVT: tl.constexpr):
    """y (|y| <= 448) as float8 e4m3, nearest, ties to even. The GPU's convert does exactly that
    (two values per instruction); the interpreter's cast does not, so it gets the rounding by hand."""
    if HW_CVT:
        return y.to(tl.float8e4nv)
    else:
        return _round_to_e4m3(y).to(tl.float8e4nv)


@triton.jit
def _to_out(x, dtype: tl.constexpr, HW_CVT: tl.constexpr):
    """float32 -> the output dtype, nearest even (by hand for bf16 under the interpreter)."""
    if dtype == tl.bfloat16 and not HW_CVT:
        x = _round_to_bf16(x)
    return x.to(dtype)


@triton.jit
def _quant_rows_kernel(
    x_ptr,  # [N, T, H, D] keys or values, contiguous
    d_ptr,  # [N, T, H, P] codes, contiguous
    s_ptr,  # scale: [N, T, H] f32 (fp8 / int8) | [N, T, H, D/G] f16 (int4 / int2 values)
    z_ptr,  # zero point [N, T, H, D/G] f16 (int4 / int2 only)
    TH,  # rows per block (T * H)
    QUANT: tl.constexpr,  # spec.QUANT_CODE: 1 fp8, 2 int8, 3 int4, 4 int2
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= D
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    QMAX: tl.constexpr,  # 448 (fp8) or 127 (int8)
    HW_CVT: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # row (token, head) within block n
    od = tl.arange(0, BLOCK_D)
    mr = r < TH
    m2 = mr[:, None] & (od < D)[None, :]
    row = n * TH + r  # [ROWS] int64
    x = tl.load(x_ptr + row[:, None] * D + od[None, :], mask=m2, other=0.0).to(tl.float32)
    P: tl.constexpr = D // PER
    if QUANT == 1 or QUANT == 2:
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)
        # one division per row, a multiply per element; reference.py does the same two steps
        y = x * tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32), scale)[:, None]
        if QUANT == 1:
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
            tl.store(d_ptr + row[:, None] * D + od[None, :], _to_e4m3(y, HW_CVT), mask=m2)
        else:
            code = _floor_code(y + 0.5, -127, 127, HW_CVT)
            tl.store(d_ptr + row[:, None] * D + od[None, :], code.to(tl.int8), mask=m2)
        tl.store(s_ptr + row, scale, mask=mr)
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
        tl.store(s_ptr + row[:, None] * DG + og[None, :], scale, mask=mg)
        tl.store(z_ptr + row[:, None] * DG + og[None, :], zero, mask=mg)
        BP: tl.constexpr = BLOCK_D // PER
        packed = _pack(code, ROWS, BLOCK_D, BITS, PER)
        op = tl.arange(0, BP)
        mp = mr[:, None] & (op < P)[None, :]
        tl.store(d_ptr + row[:, None] * P + op[None, :], packed.to(tl.uint8), mask=mp)


@triton.jit
def _quant_keys_kernel(
    x_ptr,  # [N, T, H, D] keys, contiguous: row (n, t) holds W = H * D channels
    d_ptr,  # [N, T, H, P] uint8 codes, contiguous
    s_ptr,  # [N, Gk, H, D] f16 scale
    z_ptr,  # [N, Gk, H, D] f16 zero point
    T,
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
    n = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    oc = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    orow = tl.arange(0, RT)
    mc = oc < W
    LEVELS: tl.constexpr = (1 << BITS) - 1
    lo = tl.full((BLOCK_W,), float("inf"), tl.float32)
    hi = tl.full((BLOCK_W,), float("-inf"), tl.float32)
    for r0 in range(0, GROUP, RT):
        ot = g * GROUP + r0 + orow
        tok = n * T + ot  # [RT] int64
        if EVEN:
            x = tl.load(x_ptr + tok[:, None] * W + oc[None, :]).to(tl.float32)
            lo = tl.minimum(lo, tl.min(x, axis=0))
            hi = tl.maximum(hi, tl.max(x, axis=0))
        else:  # a short last group: its valid tokens only
            m2 = (ot < T)[:, None] & mc[None, :]
            x = tl.load(x_ptr + tok[:, None] * W + oc[None, :], mask=m2, other=0.0).to(tl.float32)
            lo = tl.minimum(lo, tl.min(tl.where(m2, x, float("inf")), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(m2, x, float("-inf")), axis=0))
    if not EVEN:
        lo = tl.where(mc, lo, 0.0)
        hi = tl.where(mc, hi, 0.0)
    rng = hi - lo
    scale = tl.where(rng > 0, tl.math.div_rn(rng, LEVELS * 1.0), 1.0).to(tl.float16)
    zero = lo.to(tl.float16)
    inv = tl.math.div_rn(tl.full((BLOCK_W,), 1.0, tl.float32), scale.to(tl.float32))
    GK = (T + GROUP - 1) // GROUP
    m_off = (n * GK + g) * W + oc
    if EVEN:
        tl.store(s_ptr + m_off, scale)
        tl.store(z_ptr + m_off, zero)
    else:
        tl.store(s_ptr + m_off, scale, mask=mc)
        tl.store(z_ptr + m_off, zero, mask=mc)
    BP: tl.constexpr = BLOCK_W // PER
    op = tl.program_id(2) * BP + tl.arange(0, BP)
    zf = zero.to(tl.float32)
    for r0 in range(0, GROUP, RT):
        ot = g * GROUP + r0 + orow
        tok = n * T + ot
        if EVEN:
            x = tl.load(x_ptr + tok[:, None] * W + oc[None, :]).to(tl.float32)
        else:
            x = tl.load(x_ptr + tok[:, None] * W + oc[None, :], mask=(ot < T)[:, None] & mc[None, :], other=0.0)
            x = x.to(tl.float32)
        code = _floor_code((x - zf[None, :]) * inv[None, :] + 0.5, 0, LEVELS, HW_CVT)
        packed = _pack(code, RT, BLOCK_W, BITS, PER).to(tl.uint8)
        d_off = tok[:, None] * (W // PER) + op[None, :]
        if EVEN:
            tl.store(d_ptr + d_off, packed)
        else:
            tl.store(d_ptr + d_off, packed, mask=(ot < T)[:, None] & (op < W // PER)[None, :])


KEY_TILE_W = 256
KEY_ROWS = 16
"""A key-quantization program: KEY_TILE_W channels, in chunks of KEY_ROWS token rows (one warp per
512 channels, so one warp here; 8 KV heads x 128 channels make 4 programs per group). Timed on the
H200 (256 MiB of bf16 KV, compress int8 / int4, 2026-12-02): 256 x 16 128 / 131 us, 256 x 8
134 / 136, 512 x 8 141 / 139, 512 x 4 152 / 160 (the one-pass kernel before it: 237 / 223)."""


def _kivi(quant: str, is_key: bool) -> bool:
    return quant in ("int4", "int2") or (quant == "int8" and is_key)


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
            x, data, scale, z, t, W=h * d, BLOCK_W=block_w, GROUP=group, RT=min(KEY_ROWS, group), BITS=bits,
            PER=per, EVEN=t % group == 0 and (h * d) % block_w == 0, HW_CVT=not INTERPRET,
            num_warps=max(1, min(4, block_w // 512)),
        )  # fmt: skip
    else:
        block_d = _p2(d, 16)
        rows = max(1, min(_p2(t * h), ROW_TILE // block_d))
        _quant_rows_kernel[(n, triton.cdiv(t * h, rows))](
            x, data, scale, z, t * h,
            QUANT=QUANT_CODE[quant], D=d, BLOCK_D=block_d, ROWS=rows, GROUP=group, BITS=bits, PER=per,
            QMAX=FP8_E4M3_MAX if quant == "fp8" else INT8_MAX, HW_CVT=not INTERPRET, num_warps=4,
        )  # fmt: skip
    return data, scale, zero


# ============================================================================================
# dequantize


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
        raw = tl.load(d_ptr + n * sd_slot + r_safe[:, None] * P + od[None, :], mask=m2)
        if QUANT == 1:
            xf = raw.to(tl.float32)
        else:
            xf = (raw.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        sc = tl.load(s_ptr + n * ss_slot + r_safe)
        x = xf * sc[:, None]
    else:
        # int4 / int2 values: byte j holds channels j*PER .. j*PER+PER-1, all in group j*PER // G
        byte = tl.load(d_ptr + n * sd_slot + r_safe[:, None] * P + op[None, :], mask=mp, other=0).to(tl.int32)
        code = _code_to_float(_unpack(byte, BITS, PER))  # [ROWS, BLOCK_D]
        NG: tl.constexpr = BLOCK_D // GROUP
        DG: tl.constexpr = D // GROUP
        og = tl.arange(0, NG)
        mg = mr[:, None] & (og < DG)[None, :]
        m_off = n * ss_slot + r_safe[:, None] * DG + og[None, :]
        sc = tl.load(s_ptr + m_off, mask=mg, other=1.0).to(tl.float32)
        zp = tl.load(z_ptr + m_off, mask=mg, other=0.0).to(tl.float32)
        x3 = tl.reshape(code, (ROWS, NG, GROUP)) * sc[:, :, None] + zp[:, :, None]
        x = tl.reshape(x3, (ROWS, BLOCK_D))
    row = n * TH + r
    tl.store(o_ptr + row[:, None] * D + od[None, :], _to_out(x, o_ptr.dtype.element_ty, HW_CVT), mask=m2)


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
    g = tl.program_id(1)
    cb = tl.program_id(2)
    ot = g * GROUP + tl.arange(0, GROUP)
    mt = ot < T
    t_safe = tl.where(mt, ot, 0).to(tl.int64)
    BP: tl.constexpr = BLOCK_W // PER
    op = cb * BP + tl.arange(0, BP)
    mp = mt[:, None] & (op < W // PER)[None, :]
    byte = tl.load(d_ptr + n * sd_slot + t_safe[:, None] * (W // PER) + op[None, :], mask=mp, other=0).to(tl.int32)
    code = _code_to_float(_unpack(byte, BITS, PER))  # [GROUP, BLOCK_W]
    oc = cb * BLOCK_W + tl.arange(0, BLOCK_W)
    mc = oc < W
    m_off = n * ss_slot + g * W + oc
    sc = tl.load(s_ptr + m_off, mask=mc, other=1.0).to(tl.float32)  # once per group, not per token
    zp = tl.load(z_ptr + m_off, mask=mc, other=0.0).to(tl.float32)
    x = code * sc[None, :] + zp[None, :]
    tok = n * T + ot
    m2 = mt[:, None] & mc[None, :]
    tl.store(o_ptr + tok[:, None] * W + oc[None, :], _to_out(x, o_ptr.dtype.element_ty, HW_CVT), mask=m2)


def _slot_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when each slot x[i] is contiguous (a pool gather is), else a contiguous copy."""
    return x if x[0].is_contiguous() else x.contiguous()


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


# ============================================================================================
# token ranks, sparsify, cluster


@triton.jit
def _ranks(imp_ptr, prot_ptr, n, h, T, H, HAS_PROT: tl.constexpr, BLOCK_T: tl.constexpr, ROW: tl.constexpr):
    """Rank of each token of (block n, head h); ROW picks the layout of the result ([T] as rows
    (axis 0) or as columns). Same total order as reference.token_ranks."""
    oi = tl.arange(0, BLOCK_T)
    mi = oi < T
    s = tl.load(imp_ptr + (n * T + oi) * H + h, mask=mi, other=float("-inf")).to(tl.float32)
    if HAS_PROT:
        p = tl.load(prot_ptr + n * T + oi, mask=mi, other=0)
        s = tl.where(p != 0, float("inf"), s)
    si = s[:, None]
    sj = s[None, :]
    ii = oi[:, None]
    jj = oi[None, :]
    before = ((sj > si) | ((sj == si) & (jj < ii))) & (jj < T)
    if ROW:
        return tl.sum(before.to(tl.int32), axis=1)
    else:
        # the same relation transposed: rank of token j = sum over i of (i before j)
        before_t = ((si > sj) | ((si == sj) & (ii < jj))) & (ii < T)
        return tl.sum(before_t.to(tl.int32), axis=0)


@triton.jit
def _sparsify_kernel(
    k_ptr,
    v_ptr,  # [N, T, H, D] source, contiguous
    imp_ptr,  # [N, T, H] importance, contiguous
    prot_ptr,  # [N, T] uint8 protected flags, contiguous (unused without HAS_PROT)
    ko_ptr,
    vo_ptr,  # [N, C, H, D] kept tokens, contiguous
    idx_ptr,  # [N, C, H] int32 source token of each kept token
    T,
    H,
    C,
    HAS_PROT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rank = _ranks(imp_ptr, prot_ptr, n, h, T, H, HAS_PROT, BLOCK_T, True)
    oi = tl.arange(0, BLOCK_T)
    kept = (rank < C) & (oi < T)
    pos = tl.cumsum(kept.to(tl.int32), axis=0) - 1
    tl.store(idx_ptr + (n * C + pos) * H + h, oi, mask=kept)
    for d0 in range(0, D, BLOCK_D):
        od = d0 + tl.arange(0, BLOCK_D)
        m = kept[:, None] & (od < D)[None, :]
        src = ((n * T + oi[:, None]) * H + h) * D + od[None, :]
        dst = ((n * C + pos[:, None]) * H + h) * D + od[None, :]
        tl.store(ko_ptr + dst, tl.load(k_ptr + src, mask=m), mask=m)
        tl.store(vo_ptr + dst, tl.load(v_ptr + src, mask=m), mask=m)


def sparsify(
    k: torch.Tensor, v: torch.Tensor, importance: torch.Tensor, protected: torch.Tensor | None, keep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, t, h, d = k.shape
    k, v = k.contiguous(), v.contiguous()
    imp = importance.float().contiguous()
    ko = torch.empty(n, keep, h, d, device=k.device, dtype=k.dtype)
    vo = torch.empty_like(ko)
    idx = torch.empty(n, keep, h, device=k.device, dtype=torch.int32)
    prot = protected.to(torch.uint8).contiguous() if protected is not None else imp
    if n:
        _sparsify_kernel[(n, h)](
            k, v, imp, prot, ko, vo, idx, t, h, keep,
            HAS_PROT=protected is not None, D=d, BLOCK_T=_p2(t, 16), BLOCK_D=min(64, _p2(d, 16)),
        )  # fmt: skip
    return ko, vo, idx


@triton.jit
def _tf32_split(x):
    """x = hi + lo exactly, hi with tf32's 10 mantissa bits (lo carries the rest, |lo| < 2^-10 |x|)."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _dot_f32(a, b, EXACT_A: tl.constexpr, EXACT_B: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b to about float32 accuracy on tensor cores (relative error ~2^-21 against the exact
    product, beside fp32's own 2^-24 per rounding; the reference's summation order differs anyway).

    An operand whose values are tf32 numbers (EXACT: bf16 / fp16 keys and values) needs no split;
    the other is split into tf32 hi + lo, two products instead of tf32x3's three, and, more to
    the point, one register copy of the large key tile in each operand layout instead of two
    (tf32x3 spilled: 255 registers + 1.8 KB of stack a thread, compile-only).
    """
    if EXACT_A and not EXACT_B:
        b_hi, b_lo = _tf32_split(b)
        acc = tl.dot(a, b_lo, input_precision=PRECISION)
        return tl.dot(a, b_hi, acc, input_precision=PRECISION)
    elif EXACT_B and not EXACT_A:
        a_hi, a_lo = _tf32_split(a)
        acc = tl.dot(a_lo, b, input_precision=PRECISION)
        return tl.dot(a_hi, b, acc, input_precision=PRECISION)
    elif EXACT_A and EXACT_B:
        return tl.dot(a, b, input_precision=PRECISION)
    else:
        return tl.dot(a, b, input_precision="ieee" if PRECISION == "ieee" else "tf32x3")


@triton.jit
def _split_bf16(x):
    """float32 x = hi + mid + lo, three bf16 (8 significant bits each: x's 24, exactly)."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    return hi, mid, (r - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _mma16(a, b, acc, INTERPRET_: tl.constexpr):
    """acc + a @ b (acc None: a @ b) of bf16 tiles with float32 sums. The interpreter's bf16 dot is wrong (it read
    the operands as other numbers, 2026-12-02), so there the exact bf16 values go in as float32."""
    if INTERPRET_:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _dot_bf16x3(a, b, A16: tl.constexpr, INTERPRET_: tl.constexpr):
    """a @ b, one operand bf16 (A16: a) and the other float32 split three ways (`_split_bf16`):
    three bf16 MMAs with exact products and float32 sums, smallest parts first. Against
    `_dot_f32`'s tf32 hi + lo it holds the bf16 tile in each operand layout at half the registers
    (the k-means kernel: 192 registers and no spill at 16 centroids, against 255 + 88 B)."""
    if A16:
        hi, mid, lo = _split_bf16(b)
        return _mma16(a, hi, _mma16(a, mid, _mma16(a, lo, None, INTERPRET_), INTERPRET_), INTERPRET_)
    else:
        hi, mid, lo = _split_bf16(a)
        return _mma16(hi, b, _mma16(mid, b, _mma16(lo, b, None, INTERPRET_), INTERPRET_), INTERPRET_)


@triton.jit
def _cluster_kernel(
    k_ptr,
    v_ptr,  # [N, T, H, D] source, contiguous
    w_ptr,  # [N, T, H] float32 weights > 0
    imp_ptr,  # [N, T, H] importance for the seed ranks (same as w up to the clamp)
    prot_ptr,  # [N, T] uint8 protected flags
    ko_ptr,
    vo_ptr,  # [N, C, H, D] centroids and value means (float32 or the source dtype), contiguous
    lc_ptr,  # [N, C, H] float32 log(count)
    T,
    H,
    C,
    ITERS: tl.constexpr,
    HAS_PROT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    EXACT16: tl.constexpr,  # k and v are bf16 / fp16, so every element is a tf32 number
    BF16: tl.constexpr,  # k and v are bf16: the products run on bf16 tiles (`_dot_bf16x3`)
    PRECISION: tl.constexpr,  # "tf32" on the GPU; "ieee" under the interpreter
    HW_CVT: tl.constexpr,
):
    """One (block, head) per program, its whole [T, D] key tile in registers; all blocks and heads
    of a call are one launch (issue 15: this replaced a kernel whose fp32 FMA dots spilled ~3,000
    registers a thread at C = 32, 60 ms for 256 MiB)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ot = tl.arange(0, BLOCK_T)
    od = tl.arange(0, BLOCK_D)
    oc = tl.arange(0, BLOCK_C)
    mt = ot < T
    md = od < D
    mc = oc < C
    m2 = mt[:, None] & md[None, :]
    row = (n * T + ot) * H + h  # [BLOCK_T] int64
    K16 = tl.load(k_ptr + row[:, None] * D + od[None, :], mask=m2, other=0.0)
    K = K16.to(tl.float32)
    w = tl.load(w_ptr + row, mask=mt, other=0.0)
    rank = _ranks(imp_ptr, prot_ptr, n, h, T, H, HAS_PROT, BLOCK_T, False)  # [BLOCK_T] as columns
    BIG = BLOCK_T + 1
    # Seeds as reference.seed_tokens: the best rank first, then weighted farthest point (first
    # index on ties), the best-ranked unchosen token once every unchosen one is a duplicate.
    # Squared distances to a seed are from differences, as in the reference, so a duplicate's is
    # exactly 0 (a |k|^2 - 2 k.s + |s|^2 form would leave it a rounding error above 0).
    pick = tl.argmin(tl.where(mt, rank, BIG), axis=0)
    chosen = ot < 0
    mind = tl.full((BLOCK_T,), float("inf"), tl.float32)
    seeds = tl.zeros((BLOCK_C,), tl.int64)
    for j in range(C):
        if j > 0:
            sc = tl.where((~chosen) & mt, w * mind, -1.0)
            best, far = tl.max(sc, axis=0, return_indices=True, return_indices_tie_break_left=True)
            if best > 0:  # noqa: SIM108 (a Triton branch: the argmin runs only when needed)
                pick = far
            else:
                pick = tl.argmin(tl.where((~chosen) & mt, rank, BIG), axis=0)
        chosen = chosen | (ot == pick)
        seed_row = (n * T + pick) * H + h
        seeds = tl.where(oc == j, seed_row, seeds)
        # the seed's key from L1 (this program just read it), not a masked sum over the tile
        krow = tl.load(k_ptr + seed_row * D + od, mask=md, other=0.0).to(tl.float32)
        diff = K - krow[None, :]
        mind = tl.minimum(mind, tl.sum(diff * diff, axis=1))
    cent = tl.load(k_ptr + seeds[:, None] * D + od[None, :], mask=mc[:, None] & md[None, :], other=0.0)
    cent = cent.to(tl.float32)
    knorm = tl.sum(K * K, axis=1)
    # Lloyd steps: distances |k|^2 - 2 k.c + |c|^2 (the reference's form) with the products on
    # the tensor cores at float32 accuracy (`_dot_f32`)
    onehot = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.int1)
    aw = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    sw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for _ in range(ITERS):  # a loop, not unrolled: four copies of the tile's temporaries spilled
        cn = tl.sum(cent * cent, axis=1)
        if BF16:
            kc = _dot_bf16x3(K16, tl.trans(cent), True, PRECISION == "ieee")
        else:
            kc = _dot_f32(K, tl.trans(cent), EXACT_A=EXACT16, EXACT_B=False, PRECISION=PRECISION)
        dist = knorm[:, None] - 2.0 * kc + cn[None, :]
        dist = tl.where(mc[None, :], dist, float("inf"))
        assign = tl.argmin(dist, axis=1, tie_break_left=True)
        onehot = (assign[:, None] == oc[None, :]) & mt[:, None]
        aw = tl.where(onehot, w[:, None], 0.0)
        sw = tl.sum(aw, axis=0)
        if BF16:
            new = _dot_bf16x3(tl.trans(aw), K16, False, PRECISION == "ieee")
        else:
            new = _dot_f32(tl.trans(aw), K, EXACT_A=False, EXACT_B=EXACT16, PRECISION=PRECISION)
        cent = tl.where((sw > 0)[:, None], new / tl.maximum(sw, 1e-30)[:, None], cent)
    V16 = tl.load(v_ptr + row[:, None] * D + od[None, :], mask=m2, other=0.0)
    if BF16:
        vc = _dot_bf16x3(tl.trans(aw), V16, False, PRECISION == "ieee")
    else:
        vc = _dot_f32(tl.trans(aw), V16.to(tl.float32), EXACT_A=False, EXACT_B=EXACT16, PRECISION=PRECISION)
    vc = vc / tl.maximum(sw, 1e-30)[:, None]
    count = tl.sum(onehot.to(tl.float32), axis=0)
    lc = tl.where(count > 0, tl.log(count), float("-inf"))
    dst = ((n * C + oc[:, None]) * H + h) * D + od[None, :]
    mo = mc[:, None] & md[None, :]
    tl.store(ko_ptr + dst, _to_out(cent, ko_ptr.dtype.element_ty, HW_CVT), mask=mo)
    tl.store(vo_ptr + dst, _to_out(vc, vo_ptr.dtype.element_ty, HW_CVT), mask=mo)
    tl.store(lc_ptr + (n * C + oc) * H + h, lc, mask=mc)


CLUSTER_WARPS = 4
CLUSTER_BF16 = True
CLUSTER_MAX_REGISTERS: int | None = 168
"""k-means launch: warps, bf16 products for bf16 sources (`_dot_bf16x3`) and a ptxas register cap
(None: the compiler's choice). See docs/compression.md, session 9, for the timings behind them."""


def cluster(
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    protected: torch.Tensor | None,
    n_centroids: int,
    iters: int,
    importance: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (k_c [N, C, H, D] out_dtype, v_c, log_count [N, C, H] f32); see reference.cluster.

    `out_dtype` other than float32 equals `reference.cluster(...)[0].to(out_dtype)` (the kernel
    rounds once, to nearest even), which saves compress_blocks a pass over the centroids."""
    n, t, h, d = k.shape
    k, v = k.contiguous(), v.contiguous()
    w = weights.float().contiguous()
    imp = w if importance is None else importance.float().contiguous()
    ko = torch.empty(n, n_centroids, h, d, device=k.device, dtype=out_dtype)
    vo = torch.empty_like(ko)
    lc = torch.empty(n, n_centroids, h, device=k.device, dtype=torch.float32)
    prot = protected.to(torch.uint8).contiguous() if protected is not None else w
    if n:
        _cluster_kernel[(n, h)](
            k, v, w, imp, prot, ko, vo, lc, t, h, n_centroids,
            ITERS=iters, HAS_PROT=protected is not None, D=d,
            BLOCK_T=_p2(t, 16), BLOCK_D=_p2(d, 16), BLOCK_C=_p2(n_centroids, 16),
            EXACT16=k.dtype in (torch.bfloat16, torch.float16), BF16=k.dtype == torch.bfloat16 and CLUSTER_BF16,
            PRECISION="ieee" if INTERPRET else "tf32",
            HW_CVT=not INTERPRET, num_warps=CLUSTER_WARPS,
            **({"maxnreg": CLUSTER_MAX_REGISTERS} if CLUSTER_MAX_REGISTERS and not INTERPRET else {}),
        )  # fmt: skip
    return ko, vo, lc
