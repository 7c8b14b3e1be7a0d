"""The one-pass decode's compressed blocks in a kernel of their own (`compressed_reader="kernel"`).

Why a second kernel (issue 38 item 5; docs/compression.md "The one-pass decode: what bounds
it"): inside `_mixed_decode_kernel` the 128-token bf16 page tile sets the register budget (255
registers, 12.5% occupancy) for the compressed tiles too, and a 128-row tile of several slots
finds every row's pool, scales and zero points by per-element gathers (`mixed_slots._slot_tile`:
at int4, D 128, about 550 load instructions per thread per 128-token tile against the bf16 tile's
~32). Here one program per (row, KV head, split) walks the same contiguous run of blocks as the
split of `_mixed_decode_kernel` it feeds, one block at a time, and reads each compressed block
with scalar descriptor fields (one load each per block, not per row) and:

* the block's code bytes as one [BS, D / PER] tile of contiguous rows, 16-byte vector loads when
  the pool's address and strides are multiples of 16 (checked per block at run time: the same
  tile is loaded without the hint otherwise);
* KIVI key scales and zero points (per channel, one row per key group) as one [D] vector when the
  storage's key group covers a block (`KEY_ROW`), broadcast over the block's rows: one fp16 FMA
  per element, no gather;
* int4 / int2 codes unpacked with one shift / mask per plane and the e4m3 -> f16 convert
  (`triton_codes._small_codes_f16`), value scales per (token, VG channels) broadcast;
* both products on the tensor cores in fp16 (query scaled into [-1, 1] as the main kernel does).

The block loop is one block a step: Triton's pipeliner (num_stages) issues the next blocks'
loads (cp.async) while one is computed. (Two blocks a step by hand: 252 registers, ptxas sm_90a,
against 122.) Blocks of the lean formats (int4h / int2h) stay in the
main kernel (`LEAN`). The result is the run's partial softmax state (max, sum, unnormalised
output), which `_mixed_decode_kernel` (`COMP_IN`) takes as its initial state: the bf16 pages and
the compressed blocks end in one online softmax, merged across splits by the existing combine.
In the observed layer this kernel writes the compressed blocks' log-sum-exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

from proxima.compression.mixed_decode_pools import _desc_row
from proxima.compression.mixed_slots import _dot_pv, _dot_qk, _slot_query, _table_row
from proxima.compression.triton_codes import _bytes_f16, _small_codes_f16


@triton.jit
def _byte_rows(addr, t, tstride, valid, anchor, W: tl.constexpr, NW: tl.constexpr, ALIGN: tl.constexpr):
    """uint8 [BS, NW] rows `addr + t * tstride` (W bytes each, NW >= W a power of two), rows where
    `valid`. ALIGN (D a multiple of 64: every pool's rows are whole 16-byte units, and
    `pool_descriptors` refuses a pool whose addresses or strides are not multiples of 16): the
    load says so, and vectorizes (16 bytes a thread) and is pipelined by Triton into cp.async:
    addressed from `anchor`, a kernel argument (Triton specializes those as 16-byte aligned), by
    an offset `x // 16 * 16` (an address loaded as an integer carries no alignment through
    Triton's analysis). (A run-time test of the alignment instead put the load under an `if`,
    which the pipeliner leaves alone: 167 registers against 122, ptxas sm_90a.)"""
    ow = tl.arange(0, NW)
    m = valid[:, None] if NW == W else valid[:, None] & (ow < W)[None, :]  # (a constexpr test)
    if ALIGN:
        off16 = ((addr - anchor.to(tl.int64, bitcast=True)) // 16) * 16
        t16 = (tstride // 16) * 16
        x = tl.load(anchor + off16 + (t * t16)[:, None] + ow[None, :], mask=m, other=0)
    else:
        x = tl.load(addr.to(tl.pointer_type(tl.uint8), bitcast=True) + (t * tstride)[:, None] + ow[None, :], mask=m,
                    other=0)
    return x


@triton.jit
def _load_block(ent_ptr, desc_ptr, anchor_ptr, h, trow, NB, j, j_end, seq_len, od, md,
                QK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr, VG: tl.constexpr,
                KEY_ROW: tl.constexpr, ALIGN: tl.constexpr):  # fmt: skip
    """Logical block `j`'s raw tiles when its format has quantization QK (else all masked): what
    `_block_scores` turns into scores and values. Nothing here waits on a load's result but the
    descriptor fields, so two calls put two blocks' loads in flight."""
    PER: tl.constexpr = 2 if QK == 3 else (4 if QK == 4 else 1)
    t = tl.arange(0, BS)
    inb = j < j_end
    e = ent_ptr + (trow * NB + j) * 2
    code = tl.load(e, mask=inb, other=0)
    d_row = _desc_row(desc_ptr, code)  # code 0 (pages) reads row 0: all zeros, quant 0
    live = inb & (code != 0) & (tl.load(d_row) == QK)
    sid = tl.where(live, tl.load(e + 1, mask=inb, other=0), 0).to(tl.int64)
    seen = tl.minimum(seq_len - j * BS, BS)
    tokens = tl.load(d_row + 1)
    ntok = tl.where(tl.load(d_row + 2) != 0, tl.where(seen == BS, tokens, 0), tl.minimum(seen, tokens))
    # (vector masks from the scalar `live` by a bound, not `&`: the interpreter's scalar-bool `&`
    # gives an int32 mask that its loads refuse)
    valid = t < tl.where(live, ntok, 0)
    row0 = sid * tl.load(d_row + 4) + h * tl.load(d_row + 6)
    tstride = tl.load(d_row + 5)
    kraw = _byte_rows(tl.load(d_row + 22) + row0, t, tstride, valid, anchor_ptr, D // PER, BLOCK_D // PER, ALIGN)
    vraw = _byte_rows(tl.load(d_row + 7) + row0, t, tstride, valid, anchor_ptr, D // PER, BLOCK_D // PER, ALIGN)
    ks_base = sid * tl.load(d_row + 13) + h * tl.load(d_row + 15)
    ks_t = tl.load(d_row + 14)
    vs_row = sid * tl.load(d_row + 16) + h * tl.load(d_row + 18) + t * tl.load(d_row + 17)
    lc_addr = tl.load(d_row + 12)
    lc_p = tl.where(lc_addr != 0, lc_addr, 0).to(tl.pointer_type(tl.float32), bitcast=True)
    bias = tl.load(lc_p + sid * tl.load(d_row + 19) + t * tl.load(d_row + 20) + h * tl.load(d_row + 21),
                   mask=t < tl.where(live & (lc_addr != 0), ntok, 0), other=0.0)
    if QK == 1:  # fp8: a float32 scale per token for keys (score column) and values (probability column)
        ksc = tl.load(tl.load(d_row + 8).to(tl.pointer_type(tl.float32), bitcast=True) + ks_base + t * ks_t,
                      mask=valid, other=0.0)
        kzp = ksc
        vsc = tl.load(tl.load(d_row + 10).to(tl.pointer_type(tl.float32), bitcast=True) + vs_row, mask=valid,
                      other=0.0)
        vzp = vsc
    else:  # KIVI keys: a float16 scale and zero per channel and key group
        ks_p = tl.load(d_row + 8).to(tl.pointer_type(tl.float16), bitcast=True)
        kz_p = tl.load(d_row + 9).to(tl.pointer_type(tl.float16), bitcast=True)
        group = tl.maximum(tl.load(d_row + 3), 1)
        if KEY_ROW:  # one key group covers the slot: one [D] row, broadcast over the block's rows
            ksc = tl.load(ks_p + ks_base + od, mask=od < tl.where(live, D, 0), other=0.0)[None, :]
            kzp = tl.load(kz_p + ks_base + od, mask=od < tl.where(live, D, 0), other=0.0)[None, :]
        else:  # smaller key groups: each row's group row, gathered
            g_off = (ks_base + tl.minimum(t // group, tl.cdiv(BS, group) - 1) * ks_t)[:, None] + od[None, :]
            ksc = tl.load(ks_p + g_off, mask=valid[:, None] & md[None, :], other=0.0)
            kzp = tl.load(kz_p + g_off, mask=valid[:, None] & md[None, :], other=0.0)
        if QK == 2:  # int8 values: a float32 scale per token
            vsc = tl.load(tl.load(d_row + 10).to(tl.pointer_type(tl.float32), bitcast=True) + vs_row, mask=valid,
                          other=0.0)
            vzp = vsc
        else:  # int4 / int2 values: a float16 scale and zero per (token, channel group), read per VG
            # channels (VG divides every pool's group: the VG channels from og * VG share group og * VG // group)
            NG: tl.constexpr = BLOCK_D // VG
            og = tl.arange(0, NG)
            gm = valid[:, None] & (og * VG < D)[None, :]
            g_off = vs_row[:, None] + (og * VG)[None, :] // group
            vsc = tl.load(tl.load(d_row + 10).to(tl.pointer_type(tl.float16), bitcast=True) + g_off, mask=gm,
                          other=0.0)
            vzp = tl.load(tl.load(d_row + 11).to(tl.pointer_type(tl.float16), bitcast=True) + g_off, mask=gm,
                          other=0.0)
    return kraw, vraw, ksc, kzp, vsc, vzp, bias, valid, live


@triton.jit
def _block_scores(q16, score_scale, kraw, vraw, ksc, kzp, vsc, vzp, bias, valid,
                  QK: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr, VG: tl.constexpr,
                  DOT: tl.constexpr, DOT_16BIT: tl.constexpr):  # fmt: skip
    """A block's scores [G_PAD, BS] (log2 units, -inf on rows it does not hold), its values
    [BS, BLOCK_D] float16 and each probability column's factor, from `_load_block`'s tiles."""
    if QK == 1:
        k16 = kraw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        s = _dot_qk(q16, k16, DOT, DOT_16BIT) * (ksc * score_scale)[None, :]
        v16 = vraw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        vcol = vsc
    elif QK == 2:
        k16 = _bytes_f16(kraw, 0) * ksc + kzp
        s = _dot_qk(q16, k16, DOT, DOT_16BIT) * score_scale
        v16 = _bytes_f16(vraw.to(tl.int8, bitcast=True), 128)
        vcol = vsc
    else:  # int4 / int2: tiles of code * 2^-9, zero points scaled alike, 512 back on scores and P
        PER: tl.constexpr = 2 if QK == 3 else 4
        k16 = _small_codes_f16(kraw, PER) * ksc + (kzp * 0.001953125).to(tl.float16)
        s = _dot_qk(q16, k16, DOT, DOT_16BIT) * (score_scale * 512.0)
        NG: tl.constexpr = BLOCK_D // VG
        vc = tl.reshape(_small_codes_f16(vraw, PER), (BS, NG, VG))
        v16 = tl.reshape(vc * vsc[:, :, None] + (vzp * 0.001953125).to(tl.float16)[:, :, None], (BS, BLOCK_D))
        vcol = tl.where(valid, 512.0, 0.0)
    s = s + (bias * 1.4426950408889634)[None, :]  # centroids: log(count) on each logit
    return tl.where(valid[None, :], s, float("-inf")), v16, vcol


@triton.jit
def _block_step(q16, score_scale, blk, m_i, l_i, acc, ent_out_ptr, NB_OUT, Hq, r, qh, qh_end, j,
                QK: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr, VG: tl.constexpr, DOT: tl.constexpr,
                DOT_16BIT: tl.constexpr, OBSERVE: tl.constexpr):  # fmt: skip
    """One loaded block into the online softmax (and, observed, its log-sum-exp per query head)."""
    kraw, vraw, ksc, kzp, vsc, vzp, bias, valid, live = blk
    s, v16, vcol = _block_scores(q16, score_scale, kraw, vraw, ksc, kzp, vsc, vzp, bias, valid, QK, BS, BLOCK_D,
                                 VG, DOT, DOT_16BIT)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot_pv((p * vcol[None, :]).to(tl.float16), v16, DOT, DOT_16BIT)
    if OBSERVE:
        bsum = tl.sum(p, axis=1)
        ent = tl.where(bsum > 0, (tl.math.log2(tl.maximum(bsum, 1e-30)) + m_use) * 0.6931471805599453,
                       float("-inf"))
        tl.store(ent_out_ptr + (r * NB_OUT + j) * Hq + qh, ent, mask=qh < tl.where(live & (j < NB_OUT), qh_end, 0))
    return m_new, l_i, acc


@triton.jit
def _comp_decode_kernel(
    q_ptr, sq_s, sq_h,  # [S, Hq, D] queries
    seq_ptr, qsl_ptr, slot_ptr,  # vLLM's seq_lens, query_start_loc, slot_mapping
    owner_ptr, ent_ptr, NB,  # device block table: owner [N] int32, entries [rows, NB, 2] int32
    desc_ptr,  # pool descriptors (`mixed_decode_pools.py`)
    anchor_ptr,  # any 16-byte aligned uint8 tensor (the descriptors' bytes): `_byte_rows` addresses from it
    ent_out_ptr, NB_OUT,  # [S, NB_OUT, Hq] float32 per-block log-sum-exp (OBSERVE only)
    cml_ptr, cacc_ptr,  # out: [S, Hq, SPLITS, 2] / [S, Hq, SPLITS, BLOCK_D] float32 partial states
    Hq, sm_scale_log2, SPLITS,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
    OBSERVE: tl.constexpr, DOT: tl.constexpr, DOT_16BIT: tl.constexpr, TILE_BLOCKS: tl.constexpr,
    VG: tl.constexpr, KEY_ROW: tl.constexpr, SCAN: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    og = tl.arange(0, G_PAD)
    od = tl.arange(0, BLOCK_D)
    mg = og < G
    md = od < D
    qh = h * G + og
    # the query as `_mixed_decode_kernel` scales it for compressed slots (`mixed_slots._slot_query`)
    qf = tl.load(q_ptr + r * sq_s + qh[:, None] * sq_h + od[None, :], mask=mg[:, None] & md[None, :],
                 other=0.0).to(tl.float32)
    q16, score_scale = _slot_query(qf, sm_scale_log2)
    trow, seq_len = _table_row(slot_ptr, qsl_ptr, owner_ptr, seq_ptr, r, BS)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D), tl.float32)
    # the same run of blocks as split `sp` of `_mixed_decode_kernel` (it merges this state in)
    nblk = tl.cdiv(seq_len, BS)
    per = tl.cdiv(tl.cdiv(nblk, SPLITS), TILE_BLOCKS) * TILE_BLOCKS
    j_start = sp * per
    j_end = tl.minimum(j_start + per, nblk)
    # which quantizations the run holds (one vector pass over its codes, descriptors from L1), so
    # that each block loop below is compiled for one quantization and runs only if it is present
    n1 = 0
    n2 = 0
    n3 = 0
    n4 = 0
    osc = tl.arange(0, SCAN)
    for jt in range(j_start, j_end, SCAN):
        jj = jt + osc
        codes = tl.load(ent_ptr + (trow * NB + jj) * 2, mask=jj < j_end, other=0)
        quants = tl.load(_desc_row(desc_ptr, codes))
        n1 += tl.sum((quants == 1).to(tl.int32), axis=0)
        n2 += tl.sum((quants == 2).to(tl.int32), axis=0)
        n3 += tl.sum((quants == 3).to(tl.int32), axis=0)
        n4 += tl.sum((quants == 4).to(tl.int32), axis=0)
    for QK in tl.static_range(1, 5):
        n = n1 if QK == 1 else (n2 if QK == 2 else (n3 if QK == 3 else n4))
        if n > 0:
            for j in range(j_start, j_end):
                a = _load_block(ent_ptr, desc_ptr, anchor_ptr, h, trow, NB, j, j_end, seq_len, od, md, QK, D, BS,
                                BLOCK_D, VG, KEY_ROW, ALIGN)
                m_i, l_i, acc = _block_step(q16, score_scale, a, m_i, l_i, acc, ent_out_ptr, NB_OUT, Hq, r, qh,
                                            h * G + G, j, QK, BS, BLOCK_D, VG, DOT, DOT_16BIT, OBSERVE)
    part = (r * Hq + qh) * SPLITS + sp
    tl.store(cml_ptr + part * 2, m_i, mask=mg)
    tl.store(cml_ptr + part * 2 + 1, l_i, mask=mg)
    tl.store(cacc_ptr + part[:, None] * BLOCK_D + od[None, :], acc, mask=mg[:, None])


__all__: list[str] = []
