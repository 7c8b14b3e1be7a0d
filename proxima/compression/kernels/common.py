"""Triton helpers every compression kernel shares: rounding, integer codes, packing, token ranks.

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

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Kernels that work around interpreter-only bugs check this (it is read once, like triton does)."""

STEP_VARYING = ["A"]
"""Arguments that change from step to step and must not pick a compiled variant: Triton
specializes an integer equal to 1 or divisible by 16, so a step of 1, 5 or 16 actions would each
compile the kernel again, inside the step (`worker/step_warm_up.py` compiles one of each). Used
by the step kernels (`step.py`) and the k-means (`cluster.py`)."""
STEP_TABLE = ["tbl_ptr", "rows_ptr", "A"]
"""Arguments whose 16-divisibility (an integer) or 16-byte alignment (a pointer) changes from step
to step: the action count, and the step table, whose group rows start 24 bytes per action in
(`rows_ptr` is the table too when every layer is in the group). The H100 run of 2026-12-07 with
only `tbl_ptr` here compiled 3-4 more variants inside the serving window, one per group at an odd
offset (aggressive 718 tokens/s on a fresh Triton cache, 1,000 on a warm one)."""


def _p2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


# ============================================================================================
# rounding, integer codes and bit packing


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


def _kivi(quant: str, is_key: bool) -> bool:
    return quant in ("int4", "int2") or (quant == "int8" and is_key)


def _slot_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when each slot x[i] is contiguous (a pool gather is), else a contiguous copy.

    Read from the strides, not from `x[0].is_contiguous()`: indexing a slot is a dispatched op,
    and a step calls this for every field of every group (`bench/step_ops.py` counts them)."""
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return x.contiguous()
        expected *= size
    return x


@triton.jit
def _ranks(imp_ptr, prot_ptr, n, h, T, H, HAS_PROT: tl.constexpr, BLOCK_T: tl.constexpr, ROW: tl.constexpr):
    """Rank of each token of (block n, head h); ROW picks the layout of the result ([T] as rows
    (axis 0) or as columns). Same total order as reference.token_ranks."""
    oi = tl.arange(0, BLOCK_T)
    s = tl.load(imp_ptr + (n * T + oi) * H + h, mask=oi < T, other=float("-inf")).to(tl.float32)
    return _ranks_of(s, prot_ptr, n, T, HAS_PROT, BLOCK_T, ROW)


@triton.jit
def _ranks_of(s, prot_ptr, n, T, HAS_PROT: tl.constexpr, BLOCK_T: tl.constexpr, ROW: tl.constexpr):
    """`_ranks` of scores s [BLOCK_T] float32 (-inf past T), however the caller made them."""
    oi = tl.arange(0, BLOCK_T)
    mi = oi < T
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
def _step_slot(tbl_ptr, rows_ptr, n, A, COL: tl.constexpr, HAS_ROWS: tl.constexpr):
    """(stack row, column COL of the step table) of program block n of a step kernel: blocks are
    layer-major over the group's layers (n = layer * A + action); `rows_ptr` lists the group's
    stack rows unless it is every layer in order (HAS_ROWS false). The table is the worker's
    long [A, 3] (source page, source slot row, destination slot row; `WorkerStore._step_tables`)."""
    li = n // A
    a = n - li * A
    if HAS_ROWS:  # noqa: SIM108 (a Triton branch on a constexpr)
        layer = tl.load(rows_ptr + li).to(tl.int64)
    else:
        layer = li
    return layer, tl.load(tbl_ptr + a * 3 + COL).to(tl.int64)
