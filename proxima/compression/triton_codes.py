"""Dequantization helpers of the Triton decode kernel (`triton_attention._decode_kernel`).

Dequantization happens in registers and never goes through an int -> float conversion
instruction (a unit at an eighth of the FMA rate on the H200): int4 / int2 codes become float16
through the hardware e4m3 -> f16 convert, int8 codes by the f16 magic number, fp8 by the e4m3
convert. With `planes` (the shipped int4 / int2 configs) a tile is unpacked into PER channel
planes (plane i: channels PER j + i, `_nibble_planes_f16`, `_crumb_planes_f16`), elementwise in
the loaded bytes; `unpack_asm` does the unpacking by inline PTX four bytes at a time, which
Triton's byte-wise code needed 3-4 instructions per code for.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LN2_C = tl.constexpr(LN2)
LOG2E_C = tl.constexpr(LOG2E)


@triton.jit
def _small_codes_f16(b, PER: tl.constexpr):
    """uint8 [..., P] packed int4 / int2 codes -> float16 code * 2^-9 [..., P * PER], channel order.

    A code below 16 placed alone in a byte *is* the float8 e4m3 encoding of code * 2^-9 (e4m3's
    subnormals and first binade are linear: bits 0..15 encode 0..15 * 2^-9), so each byte of codes
    becomes float16 by the hardware e4m3 -> f16 convert, two codes per instruction; no integer to
    float conversion is needed. `tl.join` adds an in-thread axis, so a byte's codes stay in the
    thread that loaded it and the reshape to channel order (byte j holds channels j*PER ..
    j*PER+PER-1, lowest bits first) moves no data.
    """
    if PER == 2:
        lo, hi = _nibble_planes_f16(b, False)
        return tl.reshape(tl.join(lo, hi), *b.shape[:-1], b.shape[-1] * 2)
    else:
        c0, c1, c2, c3 = _crumb_planes_f16(b, False)
        # join(join(c0, c2), join(c1, c3))[..., i, o] = c[2 * i + o]: flattening gives channel order
        return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), *b.shape[:-1], b.shape[-1] * 4)


_PLANES_PTX = tl.constexpr(
    "{\n.reg .b32 l, h;\n.reg .b16 l0, l1, h0, h1;\n"
    "and.b32 l, $4, 0x0F0F0F0F;\nshr.u32 h, $4, 4;\nand.b32 h, h, 0x0F0F0F0F;\n"
    "mov.b32 {l0, l1}, l;\nmov.b32 {h0, h1}, h;\n"
    "cvt.rn.f16x2.e4m3x2 $0, l0;\ncvt.rn.f16x2.e4m3x2 $1, l1;\n"
    "cvt.rn.f16x2.e4m3x2 $2, h0;\ncvt.rn.f16x2.e4m3x2 $3, h1;\n}"
)
"""Four bytes of packed int4 codes ($4) -> their low nibbles ($0, $1) and high nibbles ($2, $3) as
f16 code * 2^-9, two per register in byte order: one mask, one shift and mask, four e4m3 -> f16x2
converts for 8 codes (see `_small_codes_f16` for why a nibble alone in a byte is its e4m3 code)."""

_CRUMB_PLANES_PTX = tl.constexpr(
    "{\n.reg .b32 c;\n.reg .b16 c0, c1;\n"
    + "".join(
        (f"shr.u32 c, $8, {2 * i};\nand.b32 c, c, 0x03030303;\n" if i else "and.b32 c, $8, 0x03030303;\n")
        + f"mov.b32 {{c0, c1}}, c;\ncvt.rn.f16x2.e4m3x2 ${2 * i}, c0;\ncvt.rn.f16x2.e4m3x2 ${2 * i + 1}, c1;\n"
        for i in range(4)  # bits 2i, 2i+1 of each byte -> plane i ($2i, $2i+1)
    )
    + "}"
)
"""Four bytes of packed int2 codes ($8) -> their four planes (bits 2i..2i+1 of every byte, $2i and
$2i+1) as f16 code * 2^-9: a shift and a mask, then two e4m3 -> f16x2 converts per plane."""


@triton.jit
def _nibble_planes_f16(b, ASM: tl.constexpr):
    """uint8 [..., P] packed int4 codes -> (plane 0, plane 1), float16 code * 2^-9 [..., P] each:
    plane i holds channels 2j + i (byte j's low nibble, then its high nibble). No join, no
    reshape: each plane is elementwise in the loaded bytes, so it stays in the registers and the
    layout the load gave it, and a decode contracts each plane with its own part of the query
    channels (`PLANES` in `_decode_kernel`)."""
    if ASM:  # four bytes per instruction group, packed f16 pairs out: no byte extracts
        lo, hi = tl.inline_asm_elementwise(
            _PLANES_PTX, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:  # the interpreter runs no PTX (and the compiled variant without it, for the sweep)
        lo = (b & 15).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = (b >> 4).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return lo, hi


@triton.jit
def _crumb_planes_f16(b, ASM: tl.constexpr):
    """uint8 [..., P] packed int2 codes -> four planes, float16 code * 2^-9 [..., P] each: plane i
    holds channels 4j + i (`_nibble_planes_f16` for int4)."""
    if ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            _CRUMB_PLANES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b], dtype=(tl.float16,) * 4, is_pure=True, pack=4
        )
    else:
        c0 = (b & 3).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c1 = ((b >> 2) & 3).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c2 = ((b >> 4) & 3).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c3 = (b >> 6).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return c0, c1, c2, c3


@triton.jit
def _planes4(x, R: tl.constexpr, J: tl.constexpr):
    """[R, 4J] -> its four channel planes [R, J] (plane i: columns 4j + i), in registers."""
    even, odd = tl.split(tl.reshape(x, (R, J, 2, 2)))  # last axis: bit 0 of the column
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _dequant_plane(c, sc, zp, N: tl.constexpr, NG: tl.constexpr, W: tl.constexpr):
    """A value plane [N, NG * W] of codes -> codes * scale + zero, per token and group of W plane
    columns (sc, zp [N, NG], already in the plane's units)."""
    c = tl.reshape(c, (N, NG, W))
    return tl.reshape(c * sc[:, :, None] + zp[:, :, None], (N, NG * W))


def _bytes_ptx(signed: bool) -> str:
    """Four bytes ($2) -> four exact f16 ($0, $1, two per register in byte order): a byte permute
    puts each byte into the low mantissa byte of 1024.0 (0x64XX is 1024 + XX), one packed
    subtraction removes the 1024 (signed bytes are first offset by 128 with an xor, and 1152 is
    subtracted). 2-2.5 instructions per 2 codes, no convert."""
    src, magic = ("w", "0x64806480") if signed else ("$2", "0x64006400")
    return (
        "{\n.reg .b32 w, t, m;\n"
        + ("xor.b32 w, $2, 0x80808080;\n" if signed else "")
        + f"mov.b32 m, {magic};\n"
        + f"prmt.b32 t, {src}, 0x64646464, 0x4140;\nsub.f16x2 $0, t, m;\n"
        + f"prmt.b32 t, {src}, 0x64646464, 0x4342;\nsub.f16x2 $1, t, m;\n}}"
    )


_BYTES_PTX = tl.constexpr(_bytes_ptx(False))
_SBYTES_PTX = tl.constexpr(_bytes_ptx(True))


@triton.jit
def _codes_f16(b, SIGNED: tl.constexpr, ASM: tl.constexpr):
    """uint8 codes (SIGNED: int8 codes stored as bytes) -> exact float16, elementwise (same shape
    and layout). ASM: by PTX four bytes at a time (`_bytes_ptx`); else `_bytes_f16`."""
    if ASM:
        if SIGNED:
            return tl.inline_asm_elementwise(_SBYTES_PTX, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
        return tl.inline_asm_elementwise(_BYTES_PTX, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    return _bytes_f16(b, 128 if SIGNED else 0)


@triton.jit
def _bytes_f16(b, OFFSET: tl.constexpr):
    """uint8 / int8 codes -> exact float16 (code + OFFSET must lie in [0, 1024)) without an integer
    to float conversion: OR code + OFFSET into the mantissa of 1024.0 (bits 0x6400), subtract
    1024 + OFFSET."""
    x = (b.to(tl.int16) + OFFSET) & 0x3FF
    return (x | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + OFFSET)
