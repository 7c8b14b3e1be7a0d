"""One compressed slot inside the one-pass decode (`mixed_decode`): its scores and values in float16.

The one-pass kernel meets a block's format at run time (a code in the device block table), so it
cannot be specialized per format as the split path's kernel is (`triton_attention`). What it
takes from that kernel instead is how a block is read: codes become float16 without an integer to
float conversion (int4 / int2 by the e4m3 -> f16 convert, int8 by the f16 magic number, fp8 as
it is: `triton_codes`), the key and value tiles stay in float16 (half the registers of the float32
tiles the first version built, which spilled at 255 registers, ptxas sm_90), both products run
on the tensor cores in float16 against a query scaled by a power of two into [-1, 1], and
per-token scales are not applied per element: a key scale multiplies its score column, a value
scale its probability column. int4 / int2 value scales are loaded once per (token, `VG`
channels) and broadcast, not gathered per element (`VG`: a power of two dividing the storage's
smallest group, fixed while serving, so a constexpr).

Tiles of the small codes hold code * 2^-9 (the e4m3 trick, `_small_codes_f16`); their zero points
are scaled by 2^-9 too, so keys and values come out as k * 2^-9 and v * 2^-9, and the factor 512
goes onto the scores' scale and the probabilities' column.
"""

from __future__ import annotations

import triton
import triton.language as tl

from proxima.compression.mixed_decode_pools import _desc
from proxima.compression.triton_codes import _bytes_f16


@triton.jit
def _dot_qk(q16, k16, DOT: tl.constexpr, DOT_16BIT: tl.constexpr):
    """Scores [G_PAD, BS] float32 of query rows [G_PAD, BLOCK_D] against key rows [BS, BLOCK_D]."""
    if DOT:
        if DOT_16BIT:
            s = tl.dot(q16, tl.trans(k16.to(tl.float16)))
        else:  # the interpreter's 16-bit tl.dot is wrong (Triton 3.x): float32 operands there
            s = tl.dot(q16.to(tl.float32), tl.trans(k16.to(tl.float32)))
    else:
        s = tl.sum(q16.to(tl.float32)[:, None, :] * k16.to(tl.float32)[None, :, :], axis=2)
    return s


@triton.jit
def _dot_pv(p16, v16, DOT: tl.constexpr, DOT_16BIT: tl.constexpr):
    """Output rows [G_PAD, BLOCK_D] float32 of probabilities [G_PAD, BS] times values [BS, BLOCK_D]."""
    if DOT:  # (constexpr branches: one is compiled)
        pv = tl.dot(p16, v16.to(tl.float16)) if DOT_16BIT else tl.dot(p16.to(tl.float32), v16.to(tl.float32))
    else:
        pv = tl.sum(p16.to(tl.float32)[:, :, None] * v16.to(tl.float32)[None, :, :], axis=1)
    return pv


@triton.jit
def _kivi_key_scales(ks_p, kz_p, ks_base, ks_t, group, ot, od, md, valid,
                     BS: tl.constexpr, KEY_ROWS: tl.constexpr):  # fmt: skip
    """A KIVI slot's key scale and zero point (float16) for every key row: one row per slot where
    its group covers the block (broadcast, [1, BLOCK_D]), else row t // group per token ([BS,
    BLOCK_D], compiled only with KEY_ROWS: the gather costs registers)."""
    if KEY_ROWS:
        g_off = (ks_base + (tl.minimum(ot // group, tl.cdiv(BS, group) - 1)) * ks_t)[:, None] + od[None, :]
        ksc = tl.load(ks_p + g_off, mask=valid[:, None] & md[None, :], other=0.0)
        kzp = tl.load(kz_p + g_off, mask=valid[:, None] & md[None, :], other=0.0)
    else:
        ksc = tl.load(ks_p + ks_base + od, mask=md, other=0.0)[None, :]
        kzp = tl.load(kz_p + ks_base + od, mask=md, other=0.0)[None, :]
    return ksc, kzp


@triton.jit
def _small_codes(rows, od, mask, PER: tl.constexpr):
    """int4 (PER 2) / int2 (PER 4) codes of byte rows `rows` [BS] (pointers) -> [BS, BLOCK_D]
    float16 code * 2^-9, channel order (byte j holds channels PER j .. PER j + PER - 1, lowest
    bits first). Each channel loads its byte (neighbours hit the same cache line) and takes its
    bits: a code alone in a byte is the e4m3 encoding of code * 2^-9 (`triton_codes`), so one
    e4m3 -> f16 convert, no integer to float conversion."""
    BITS: tl.constexpr = 8 // PER
    raw = tl.load(rows[:, None] + (od // PER)[None, :], mask=mask, other=0)
    codes = (raw >> ((od % PER) * BITS).to(tl.uint8)[None, :]) & ((1 << BITS) - 1)
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _small_values(vb, vs_p, vz_p, vs_row, group, valid, PER: tl.constexpr, VG: tl.constexpr, D: tl.constexpr,
                  BS: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """int4 (PER 2) / int2 (PER 4) value rows [BS, BLOCK_D] float16 as v * 2^-9: codes by the e4m3
    trick, one scale and zero per (token, VG channels), loaded once and broadcast over them. The
    slot's `group` is a multiple of VG (VG divides the storage's smallest group), so the VG
    channels of column og share the scale of group og * VG // group."""
    od = tl.arange(0, BLOCK_D)
    codes = _small_codes(vb, od, valid[:, None] & (od < D)[None, :], PER)
    NG: tl.constexpr = BLOCK_D // VG
    og = tl.arange(0, NG)
    gm = valid[:, None] & (og * VG < D)[None, :]
    g_off = vs_row[:, None] + (og * VG // group)[None, :]
    vsc = tl.load(vs_p + g_off, mask=gm, other=0.0)
    vzp = (tl.load(vz_p + g_off, mask=gm, other=0.0) * 0.001953125).to(tl.float16)  # 2^-9, exact
    return tl.reshape(tl.reshape(codes, (BS, NG, VG)) * vsc[:, :, None] + vzp[:, :, None], (BS, BLOCK_D))


@triton.jit
def _slot_block(ent_ptr, desc_ptr, h, trow, NB, code, j, seq_len, q16, score_scale, ot, od, md,
                D: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr, KEY_ROWS: tl.constexpr,
                VG: tl.constexpr, DOT: tl.constexpr, DOT_16BIT: tl.constexpr):  # fmt: skip
    """Logical block `j` of the row, compressed in format `code` > 0. Returns its scores [G_PAD, BS]
    (log2 units, the centroids' log count added, -inf where no token is), its value rows [BS,
    BLOCK_D] float16 (rows without a token hold 0), and the factor of each probability column
    before the value product (the per-token value scale; 512 for small codes). `q16` is the query
    scaled into [-1, 1] and `score_scale` what undoes that scaling times the softmax scale (log2
    units)."""
    seen = tl.minimum(seq_len - j * BS, BS)
    sid = tl.load(ent_ptr + (trow * NB + j) * 2 + 1).to(tl.int64)
    quant = _desc(desc_ptr, code, 0)
    tokens = _desc(desc_ptr, code, 1)
    # a quantized slot keeps token order (clipped like a page); a reduced one is all or nothing
    ntok = tl.where(_desc(desc_ptr, code, 2) != 0, tl.where(seen == BS, tokens, 0), tl.minimum(seen, tokens))
    valid = ot < ntok
    vm = valid[:, None] & md[None, :]
    row_off = sid * _desc(desc_ptr, code, 4) + h * _desc(desc_ptr, code, 6) + ot * _desc(desc_ptr, code, 5)
    kb = _desc(desc_ptr, code, 22).to(tl.pointer_type(tl.uint8), bitcast=True) + row_off
    vb = _desc(desc_ptr, code, 7).to(tl.pointer_type(tl.uint8), bitcast=True) + row_off
    ks_base = sid * _desc(desc_ptr, code, 13) + h * _desc(desc_ptr, code, 15)
    vs_row = sid * _desc(desc_ptr, code, 16) + h * _desc(desc_ptr, code, 18) + ot * _desc(desc_ptr, code, 17)
    # Every branch leaves s, v16 and vcol of one type each (a compiled `if` carries out only names
    # typed alike on both sides).
    if quant == 1:  # fp8 e4m3 is exact in f16; per-token scales on the score and probability columns
        f8_ks = _desc(desc_ptr, code, 8).to(tl.pointer_type(tl.float32), bitcast=True)
        f8_vs = _desc(desc_ptr, code, 10).to(tl.pointer_type(tl.float32), bitcast=True)
        f8_ksc = tl.load(f8_ks + ks_base + ot * _desc(desc_ptr, code, 14), mask=valid, other=0.0)
        f8_k = tl.load(kb[:, None] + od[None, :], mask=vm, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        s = _dot_qk(q16, f8_k, DOT, DOT_16BIT) * (f8_ksc * score_scale)[None, :]
        v16 = tl.load(vb[:, None] + od[None, :], mask=vm, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        vcol = tl.load(f8_vs + vs_row, mask=valid, other=0.0)
    else:
        ks_p = _desc(desc_ptr, code, 8).to(tl.pointer_type(tl.float16), bitcast=True)
        kz_p = _desc(desc_ptr, code, 9).to(tl.pointer_type(tl.float16), bitcast=True)
        group = _desc(desc_ptr, code, 3)
        ksc, kzp = _kivi_key_scales(ks_p, kz_p, ks_base, _desc(desc_ptr, code, 14), group, ot, od, md, valid, BS,
                                    KEY_ROWS)
        if quant == 2:  # int8: unsigned KIVI key codes, signed value codes with a scale per token
            k16 = _bytes_f16(tl.load(kb[:, None] + od[None, :], mask=vm, other=0), 0) * ksc + kzp
            s = _dot_qk(q16, k16, DOT, DOT_16BIT) * score_scale
            vraw = tl.load(vb[:, None] + od[None, :], mask=vm, other=0).to(tl.int8, bitcast=True)
            v16 = _bytes_f16(vraw, 128)
            i8_vs = _desc(desc_ptr, code, 10).to(tl.pointer_type(tl.float32), bitcast=True)
            vcol = tl.load(i8_vs + vs_row, mask=valid, other=0.0)
        else:  # int4 / int2: code * 2^-9 tiles, zero points scaled alike, 512 back on scores and P
            iq_vs = _desc(desc_ptr, code, 10).to(tl.pointer_type(tl.float16), bitcast=True)
            iq_vz = _desc(desc_ptr, code, 11).to(tl.pointer_type(tl.float16), bitcast=True)
            kzp9 = (kzp * 0.001953125).to(tl.float16)  # 2^-9, exact
            if quant == 3:
                kc = _small_codes(kb, od, vm, 2)
                v16 = _small_values(vb, iq_vs, iq_vz, vs_row, group, valid, 2, VG, D, BS, BLOCK_D)
            else:
                kc = _small_codes(kb, od, vm, 4)
                v16 = _small_values(vb, iq_vs, iq_vz, vs_row, group, valid, 4, VG, D, BS, BLOCK_D)
            s = _dot_qk(q16, kc * ksc + kzp9, DOT, DOT_16BIT) * (score_scale * 512.0)
            vcol = tl.full((BS,), 512.0, tl.float32)
    lc_addr = _desc(desc_ptr, code, 12)
    if lc_addr != 0:  # centroids: log(count) on each logit
        lc_p = lc_addr.to(tl.pointer_type(tl.float32), bitcast=True)
        bias = tl.load(lc_p + sid * _desc(desc_ptr, code, 19) + ot * _desc(desc_ptr, code, 20)
                       + h * _desc(desc_ptr, code, 21), mask=valid, other=0.0)
        s = s + (bias * 1.4426950408889634)[None, :]
    s = tl.where(valid[None, :], s, float("-inf"))
    return s, v16, vcol


__all__: list[str] = []
