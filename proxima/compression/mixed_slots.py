"""Compressed slots inside the one-pass decode (`mixed_decode`): their scores and values in float16.

The one-pass kernel meets a block's format at run time (a code in the device block table), so it
cannot be specialized per format as the split path's kernel is (`triton_attention`); it reads a
tile of several blocks once per quantization the tile holds (`_slot_tile`, the quantization a
constexpr, each row's pool found through its block's descriptor row). What it
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

from proxima.compression.mixed_decode_pools import _desc_row
from proxima.compression.triton_codes import _bytes_f16


@triton.jit
def _slot_query(qf, sm_scale_log2):
    """The compressed slots' query: `qf` (float32 [G_PAD, BLOCK_D]) scaled by a power of two into
    [-1, 1] and rounded to float16 (exact down to 2^-14 of its largest element), and the factor
    that undoes it in the scores (log2 units). Both decode kernels read slots with it."""
    qmax = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
    qn = tl.where(qmax > 0, tl.math.exp2(tl.math.ceil(tl.math.log2(tl.maximum(qmax, 1e-30)))), 1.0)
    return (qf * (1.0 / qn)).to(tl.float16), sm_scale_log2 * qn


@triton.jit
def _table_row(slot_ptr, qsl_ptr, owner_ptr, seq_ptr, r, BS: tl.constexpr):
    """Batch row `r`'s device block table row (its key block, the first query token's, -> row;
    padding rows, slot -1, read row 0: all hot) and its context length."""
    first = tl.load(slot_ptr + tl.load(qsl_ptr + r))
    trow = tl.where(first >= 0, tl.load(owner_ptr + tl.maximum(first, 0) // BS), 0).to(tl.int64)
    return trow, tl.load(seq_ptr + r)


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
def _slot_tile(ent_ptr, desc_ptr, h, trow, NB, j0, j_end, seq_len, q16, score_scale, od, md,
               QK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr, TB: tl.constexpr,
               VG: tl.constexpr, DOT: tl.constexpr, DOT_16BIT: tl.constexpr):  # fmt: skip
    """The blocks of quantization `QK` (a constexpr: `spec.QUANT_CODE`, fp8 to int2) among the TB
    logical blocks from `j0`, read as one tile of TB * BS rows.

    Why a tile: one block a step left the loop latency-bound (ncu, H100, 8 x 32k int4: 12.5%
    occupancy at 255 registers, which the 128-token hot tile sets for the whole kernel, 87% of
    cycles with no eligible warp, DRAM 2.7% busy): a step's loads depended on the previous
    step's table and descriptor loads. Here every row finds its block's code, slot and descriptor
    fields by vector gathers (a code's row of the descriptor table stays in L1), so all of the
    tile's loads issue together, and one pair of tensor-core products covers TB blocks. Rows of
    blocks in another format (or vLLM's pages, or past the context) are masked: -inf scores and
    zero values. The format's quantization must be a constexpr, so the caller runs one such tile
    per quantization present in it; the per-slot fields (pool addresses, strides, groups, token
    counts, centroid counts) stay runtime values, so any pool of that quantization is read.
    Returns the scores [G_PAD, TB * BS], values [TB * BS, BLOCK_D] float16, each probability
    column's factor, and which of the TB blocks the tile read (for the observed layer)."""
    ot = tl.arange(0, TB * BS)
    jb = j0 + ot // BS  # each row's logical block
    t = ot % BS  # and its row inside the slot
    inb = jb < j_end
    code = tl.load(ent_ptr + (trow * NB + jb) * 2, mask=inb, other=0)
    live = inb & (code != 0)
    d_row = _desc_row(desc_ptr, code)
    quant = tl.load(d_row, mask=live, other=0)
    live = live & (quant == QK)
    sid = tl.load(ent_ptr + (trow * NB + jb) * 2 + 1, mask=live, other=0).to(tl.int64)
    seen = tl.minimum(seq_len - jb * BS, BS)
    tokens = tl.load(d_row + 1, mask=live, other=0)
    reduced = tl.load(d_row + 2, mask=live, other=0) != 0
    ntok = tl.where(reduced, tl.where(seen == BS, tokens, 0), tl.minimum(seen, tokens))
    valid = live & (t < ntok)
    vm = valid[:, None] & md[None, :]
    row_off = (sid * tl.load(d_row + 4, mask=live, other=0) + h * tl.load(d_row + 6, mask=live, other=0)
               + t * tl.load(d_row + 5, mask=live, other=0))
    kb = tl.load(d_row + 22, mask=live, other=0).to(tl.pointer_type(tl.uint8), bitcast=True) + row_off
    vb = tl.load(d_row + 7, mask=live, other=0).to(tl.pointer_type(tl.uint8), bitcast=True) + row_off
    ks_base = sid * tl.load(d_row + 13, mask=live, other=0) + h * tl.load(d_row + 15, mask=live, other=0)
    vs_row = (sid * tl.load(d_row + 16, mask=live, other=0) + h * tl.load(d_row + 18, mask=live, other=0)
              + t * tl.load(d_row + 17, mask=live, other=0))
    ks_t = tl.load(d_row + 14, mask=live, other=0)
    if QK == 1:  # fp8 e4m3, exact in f16; per-token scales on the score and probability columns
        ks_p = tl.load(d_row + 8, mask=live, other=0).to(tl.pointer_type(tl.float32), bitcast=True)
        vs_p = tl.load(d_row + 10, mask=live, other=0).to(tl.pointer_type(tl.float32), bitcast=True)
        ksc = tl.load(ks_p + ks_base + t * ks_t, mask=valid, other=0.0)
        k16 = tl.load(kb[:, None] + od[None, :], mask=vm, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        s = _dot_qk(q16, k16, DOT, DOT_16BIT) * (ksc * score_scale)[None, :]
        v16 = tl.load(vb[:, None] + od[None, :], mask=vm, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        vcol = tl.load(vs_p + vs_row, mask=valid, other=0.0)
    else:
        # KIVI keys: a scale and zero row per (slot, key group) and channel, gathered per row
        # (row t // group of the slot; one row when the group covers the block)
        ks_p = tl.load(d_row + 8, mask=live, other=0).to(tl.pointer_type(tl.float16), bitcast=True)
        kz_p = tl.load(d_row + 9, mask=live, other=0).to(tl.pointer_type(tl.float16), bitcast=True)
        group = tl.maximum(tl.load(d_row + 3, mask=live, other=1), 1)
        g_off = (ks_base + tl.minimum(t // group, tl.cdiv(BS, group) - 1) * ks_t)[:, None] + od[None, :]
        ksc = tl.load(ks_p[:, None] + g_off, mask=vm, other=0.0)
        kzp = tl.load(kz_p[:, None] + g_off, mask=vm, other=0.0)
        if QK == 2:  # int8: unsigned KIVI key codes, signed value codes with a scale per token
            k16 = _bytes_f16(tl.load(kb[:, None] + od[None, :], mask=vm, other=0), 0) * ksc + kzp
            s = _dot_qk(q16, k16, DOT, DOT_16BIT) * score_scale
            v16 = _bytes_f16(tl.load(vb[:, None] + od[None, :], mask=vm, other=0).to(tl.int8, bitcast=True), 128)
            vs_p = tl.load(d_row + 10, mask=live, other=0).to(tl.pointer_type(tl.float32), bitcast=True)
            vcol = tl.load(vs_p + vs_row, mask=valid, other=0.0)
        else:  # int4 / int2: code * 2^-9 tiles, zero points scaled alike, 512 back on scores and P
            PER: tl.constexpr = 2 if QK == 3 else 4
            vs_p = tl.load(d_row + 10, mask=live, other=0).to(tl.pointer_type(tl.float16), bitcast=True)
            vz_p = tl.load(d_row + 11, mask=live, other=0).to(tl.pointer_type(tl.float16), bitcast=True)
            kc = _small_codes(kb, od, vm, PER)
            s = _dot_qk(q16, kc * ksc + (kzp * 0.001953125).to(tl.float16), DOT, DOT_16BIT) * (score_scale * 512.0)
            v16 = _small_values(vb, vs_p, vz_p, vs_row, group, valid, PER, VG, D, TB * BS, BLOCK_D)
            vcol = tl.where(valid, 512.0, 0.0)
    lc_addr = tl.load(d_row + 12, mask=live, other=0)
    has_lc = lc_addr != 0
    lc_p = tl.where(has_lc, lc_addr, 0).to(tl.pointer_type(tl.float32), bitcast=True)
    bias = tl.load(lc_p + sid * tl.load(d_row + 19, mask=live, other=0) + t * tl.load(d_row + 20, mask=live, other=0)
                   + h * tl.load(d_row + 21, mask=live, other=0), mask=valid & has_lc, other=0.0)
    s = s + (bias * 1.4426950408889634)[None, :]  # centroids: log(count) on each logit
    s = tl.where(valid[None, :], s, float("-inf"))
    read = tl.max(tl.reshape(live.to(tl.int32), (TB, BS)), axis=1) > 0
    return s, v16, vcol, read


@triton.jit
def _small_values(vb, vs_p, vz_p, vs_row, group, valid, PER: tl.constexpr, VG: tl.constexpr, D: tl.constexpr,
                       N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """int4 (PER 2) / int2 (PER 4) value rows [N, BLOCK_D] float16 as v * 2^-9, for N rows whose
    slots' scale tables differ per row (`vs_p`, `vz_p`, `group`: [N], as a tile of several slots
    has them): codes by the e4m3 trick, one scale and zero per (token, VG channels), loaded once and
    broadcast over them. A slot's `group` is a multiple of VG (VG divides the storage's smallest
    group), so the VG channels of column og share the scale of group og * VG // group."""
    od = tl.arange(0, BLOCK_D)
    codes = _small_codes(vb, od, valid[:, None] & (od < D)[None, :], PER)
    NG: tl.constexpr = BLOCK_D // VG
    og = tl.arange(0, NG)
    gm = valid[:, None] & (og * VG < D)[None, :]
    g_off = vs_row[:, None] + (og * VG)[None, :] // group[:, None]
    vsc = tl.load(vs_p[:, None] + g_off, mask=gm, other=0.0)
    vzp = (tl.load(vz_p[:, None] + g_off, mask=gm, other=0.0) * 0.001953125).to(tl.float16)  # 2^-9, exact
    return tl.reshape(tl.reshape(codes, (N, NG, VG)) * vsc[:, :, None] + vzp[:, :, None], (N, BLOCK_D))


__all__: list[str] = []
