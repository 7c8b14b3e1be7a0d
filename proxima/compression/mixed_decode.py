"""One decode kernel per layer over blocks of every format, from the device block table.

Each program serves one batch row (one query token) and one KV head, all G query heads of it.
It finds its request's table row on the device (`owner[slot_mapping[query_start_loc[r]] //
block_size]`, `worker/block_table.py`), then walks the row's logical blocks once: a block whose
table entry has code 0 is read in bf16 from vLLM's page (vLLM's block table), any other code
names a slot pool described by one row of a small descriptor table (`PoolDescriptors`), read and
dequantized in registers. Every block goes through the same online softmax, so there are no
partial results and no merge, and the output is written in place into vLLM's output tensor.
Optionally (`entry_lse`) it also writes each logical block's log-sum-exp, from which the
observed layer's per-block attention mass follows (`block_mass`) without a second pass.

Speed (issue 38, item 5), where it stands (H100, 2026-12-06, bench/one_pass_decode.py, per layer
at the 8B shape): a run of vLLM's pages is read TILE_TOKENS (128) at a time as one bf16 tile, as fast
as vLLM's own kernel (0.38 ms vs 0.46 at 8 rows x 32k, 0.37 vs 0.35 at 64 x 4k). Compressed blocks
are read in a second pass, COMP_TILE_TOKENS (128) rows a tile, one tile per quantization present
(`mixed_slots._slot_tile`): at 8 x 32k, all-int4 3.18 ms, cluster(4)+int4 1.25, int8 1.37, fp8
0.59 (block by block before: 3.68 / 1.91 / 2.08 / 1.75; bench/results/experiments/one-pass-tiles/).
What bounds it (Nsight Compute, bench/results/experiments/one-pass-profile/): latency, at 255
registers (set by the 128-token bf16 tile) and 12.5% occupancy, DRAM 2-3% busy. Both products run on
tensor cores (`tl.dot`, the KV head's G query heads as M padded to 16, operands in the query's
16-bit dtype, fp32 accumulation) once the block and head dim reach 16. Long contexts split over
programs (`splits`, `auto_splits`: from the batch shape and the GPU's SM count, so a graph captured
at a batch size replays the same split): each program walks a contiguous run of the row's blocks
and a second small launch merges the partial softmax states. The launch grid is (rows, KV heads,
splits) and nothing is read back to the host: capturable in a CUDA graph. In the observed layer a
second small launch (`update_block_importance`) folds the per-block log-sum-exp into the device
importance.

Lean slots (int4h / int2h, cluster(R)+int4h) are read in their rotated basis by
`mixed_decode_lean.py` (the query rotated once per program, a second softmax state merged at the
end of the compressed pass), compiled in by the `LEAN` constexpr; the descriptor rows are
`mixed_decode_pools.py`'s.

Named dims: S batch rows (one query token each), Hq query heads, H KV heads, G = Hq / H, D head
dim, BS vLLM's block size, NB logical blocks per request in the table.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from proxima.compression.mixed_comp import _comp_decode_kernel
from proxima.compression.mixed_decode_lean import lean_block, merge_rotated, rotate_query
from proxima.compression.mixed_decode_pools import MAX_CODES, READS_QUANTS, _desc, pool_descriptors
from proxima.compression.mixed_slots import _dot_pv, _slot_query, _slot_tile, _table_row
from proxima.compression.triton_ops import _p2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

@triton.jit
def _load_hot_tile(kv_ptr, skv_b, skv_h, skv_t, bt_ptr, sbt, ent_ptr, trow, NB, r, h, j0, seq_len, od, m2,
                   D: tl.constexpr, BS: tl.constexpr, TB: tl.constexpr):  # fmt: skip
    """TB consecutive logical blocks from `j0` read from vLLM's pages (through its block table) as
    one tile of TB * BS rows: keys and values [TB * BS, BLOCK_D] in the cache's 16-bit dtype (no
    float32 copy: a 128-token tile in float32 would double the registers of every program) and
    which rows hold tokens of vLLM's pages (not rows past the context, nor rows of a block the
    device table says is compressed: the second pass reads those)."""
    tok = j0 * BS + tl.arange(0, TB * BS)
    valid = tok < seq_len
    valid = valid & (tl.load(ent_ptr + (trow * NB + tok // BS) * 2, mask=valid, other=1) == 0)
    blk = tl.load(bt_ptr + r * sbt + tok // BS, mask=valid, other=0).to(tl.int64)
    base = kv_ptr + blk[:, None] * skv_b + h * skv_h + (tok % BS)[:, None] * skv_t + od[None, :]
    k = tl.load(base, mask=valid[:, None] & m2, other=0.0)
    v = tl.load(base + D, mask=valid[:, None] & m2, other=0.0)
    return k, v, valid


@triton.jit
def _online(s, m_i, l_i):
    """Scores [G_PAD, N] (log2 units, -inf where no token is) into the running (max, sum): the new
    state, the probabilities relative to `m_use`, and the factor `alpha` of the old output."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, p, alpha, m_use


@triton.jit
def _softmax_step(q, k, v, valid, m_i, l_i, acc, sm_scale_log2, q_ptr,
                  DOT: tl.constexpr, DOT_16BIT: tl.constexpr):  # fmt: skip
    """A tile of vLLM's pages (keys and values [N, BLOCK_D] in the cache's dtype) into the online
    softmax: the new (max, sum, output) state, and the tile's probabilities (relative to `m_use`)
    for the observed layer's per-block sums."""
    if DOT:  # tensor cores: the group's query heads are M (padded to 16), operands in the
        # query's 16-bit dtype (the model's), fp32 sums
        if DOT_16BIT:
            qk = tl.dot(q.to(q_ptr.dtype.element_ty), tl.trans(k.to(q_ptr.dtype.element_ty)))
        else:  # the interpreter: float32 operands (its 16-bit tl.dot is wrong)
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        qk = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    s = tl.where(valid[None, :], qk * sm_scale_log2, float("-inf"))
    m_i, l_i, p, alpha, m_use = _online(s, m_i, l_i)
    if DOT:
        if DOT_16BIT:  # a constexpr: one branch is compiled
            pv = tl.dot(p.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty))
        else:
            pv = tl.dot(p, v.to(tl.float32))
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    acc = acc * alpha[:, None] + pv
    return m_i, l_i, acc, p, m_use


@triton.jit
def _slot_step(s, v16, vcol, m_i, l_i, acc, DOT: tl.constexpr, DOT_16BIT: tl.constexpr):
    """A compressed tile (`mixed_slots._slot_tile`, or a lean slot: its scores, float16 values and
    the factor of each probability column) into the online softmax, as `_softmax_step`."""
    m_i, l_i, p, alpha, m_use = _online(s, m_i, l_i)
    acc = acc * alpha[:, None] + _dot_pv((p * vcol[None, :]).to(tl.float16), v16, DOT, DOT_16BIT)
    return m_i, l_i, acc, p, m_use


@triton.jit
def _store_block_lse(ent_out_ptr, NB_OUT, Hq, r, qh, mg, j0, j_end, p, m_use, keep, G_PAD: tl.constexpr,
                     TB: tl.constexpr, BS: tl.constexpr):  # fmt: skip
    """The observed layer: each of the tile's TB blocks' log-sum-exp (natural log) per query head,
    from the tile's probabilities `p` [G_PAD, TB * BS] relative to `m_use` (log2 units); only the
    blocks where `keep` [TB] holds (a block is written by the pass that reads it)."""
    jj = j0 + tl.arange(0, TB)
    bsum = tl.sum(tl.reshape(p, (G_PAD, TB, BS)), axis=2)
    ent = tl.where(bsum > 0, (tl.math.log2(tl.maximum(bsum, 1e-30)) + m_use[:, None]) * 0.6931471805599453,
                   float("-inf"))
    tl.store(ent_out_ptr + (r * NB_OUT + jj[None, :]) * Hq + qh[:, None], ent,
             mask=mg[:, None] & (keep & (jj < j_end) & (jj < NB_OUT))[None, :])


@triton.jit
def _mixed_decode_kernel(
    q_ptr, sq_s, sq_h,  # [S, Hq, D] queries
    o_ptr, so_s, so_h,  # [S, Hq, D] output (written in place)
    kv_ptr, skv_b, skv_h, skv_t,  # vLLM's cache [N, H, BS, 2D] (key channels, then value channels)
    bt_ptr, sbt,  # vLLM's block table [R, *] int32
    seq_ptr,  # [R] int32 context lengths (this step's token included)
    qsl_ptr, slot_ptr,  # query_start_loc [R + 1], slot_mapping [tokens]
    owner_ptr, ent_ptr, NB,  # device block table: owner [N] int32, entries [rows, NB, 2] int32
    desc_ptr,  # pool descriptors [codes, NUM_FIELDS = 26] int64 (`mixed_decode_pools.py`)
    ent_out_ptr, NB_OUT,  # [S, NB_OUT, Hq] float32 per-block log-sum-exp (OBSERVE only)
    lse_ptr,  # [S, Hq] float32 (OBSERVE only)
    part_ml_ptr, part_acc_ptr,  # [S, Hq, SPLITS, 2] / [S, Hq, SPLITS, BLOCK_D] float32 (PARTIAL only)
    cml_ptr, cacc_ptr,  # the same, written by `mixed_comp._comp_decode_kernel` before (COMP_IN only)
    Hq, sm_scale_log2, SPLITS,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
    OBSERVE: tl.constexpr, DOT: tl.constexpr, DOT_16BIT: tl.constexpr, PARTIAL: tl.constexpr,
    TILE_BLOCKS: tl.constexpr, VG: tl.constexpr, LEAN: tl.constexpr, COMP_TILE: tl.constexpr,
    TILES: tl.constexpr, COMP_IN: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    og = tl.arange(0, G_PAD)
    od = tl.arange(0, BLOCK_D)
    ot = tl.arange(0, BS)
    mg = og < G
    md = od < D
    qh = h * G + og
    q = tl.load(q_ptr + r * sq_s + qh[:, None] * sq_h + od[None, :], mask=mg[:, None] & md[None, :], other=0.0)
    # the compressed slots' query (`mixed_slots._slot_query`); `slot_scale` undoes its scaling in the scores
    q16, slot_scale = _slot_query(q.to(tl.float32), sm_scale_log2)
    trow, seq_len = _table_row(slot_ptr, qsl_ptr, owner_ptr, seq_ptr, r, BS)
    if COMP_IN:  # start from the compressed blocks' state of this split (`mixed_comp.py`: TILES is off)
        cpart = (r * Hq + qh) * SPLITS + sp
        m_i = tl.load(cml_ptr + cpart * 2, mask=mg, other=float("-inf"))
        l_i = tl.load(cml_ptr + cpart * 2 + 1, mask=mg, other=0.0)
        acc = tl.load(cacc_ptr + cpart[:, None] * BLOCK_D + od[None, :], mask=mg[:, None], other=0.0)
    else:
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, BLOCK_D), tl.float32)
    m2 = md[None, :]
    # this program's share of the row's blocks: a contiguous run, as even as the split allows
    # (SPLITS is fixed per launch shape, so a CUDA graph replays it whatever the context length)
    nblk = tl.cdiv(seq_len, BS)
    per = tl.cdiv(tl.cdiv(nblk, SPLITS), TILE_BLOCKS) * TILE_BLOCKS  # whole tiles
    j_start = sp * per
    j_end = tl.minimum(j_start + per, nblk)
    # Two passes over the program's blocks, both into the same online softmax (its result does not
    # depend on the order). First vLLM's pages, TILE_BLOCKS blocks a tile (vLLM's own kernel reads
    # 32-64 tokens a step; one 16-token page a step left the unsplit kernel at 3x its time on the
    # H100), a compressed block's rows masked out; then the compressed blocks, COMP_TILE a tile,
    # once per quantization the tile holds (lean blocks one by one). Separate loops keep the wide
    # bf16 tile and a slot's dequantization from
    # being live at once: in one loop with a branch per tile, ptxas (sm_90) gave the kernel 255
    # registers and 1.2-1.5 KB of spills.
    otb = tl.arange(0, TILE_BLOCKS)
    compressed = 0
    lean_blocks = 0
    for jt in range(j_start, j_end, TILE_BLOCKS):
        jj = jt + otb
        codes = tl.load(ent_ptr + (trow * NB + jj) * 2, mask=jj < j_end, other=1)
        hot = (codes == 0) & (jj < j_end)
        compressed += tl.sum(((codes != 0) & (jj < j_end)).to(tl.int32), axis=0)
        if LEAN and not TILES:  # the only compressed blocks this kernel reads then: count them here
            lean_blocks += tl.sum((_desc(desc_ptr, tl.where(jj < j_end, codes, 0), 0) >= 5).to(tl.int32), axis=0)
        if tl.max(hot.to(tl.int32), axis=0) > 0:
            hk, hv, hvalid = _load_hot_tile(kv_ptr, skv_b, skv_h, skv_t, bt_ptr, sbt, ent_ptr, trow, NB, r, h, jt,
                                            seq_len, od, m2, D, BS, TILE_BLOCKS)
            m_i, l_i, acc, hp, hm = _softmax_step(q, hk, hv, hvalid, m_i, l_i, acc, sm_scale_log2, q_ptr, DOT,
                                                  DOT_16BIT)
            if OBSERVE:
                _store_block_lse(ent_out_ptr, NB_OUT, Hq, r, qh, mg, jt, j_end, hp, hm, hot, G_PAD, TILE_BLOCKS, BS)
    if compressed > 0:
        if LEAN:  # lean slots (int4h / int2h): a softmax state of their own in the rotated basis, live in
            # this pass only and merged at its end (`mixed_decode_lean.py`); `rot` is the rotation
            # column's address once a lean block was met (row 0 of the descriptors, vLLM's pages, is
            # all zeros: 0 = none yet), `qr16` / `lean_scale` the rotated query then, as q16 / slot_scale
            m_r = tl.full((G_PAD,), float("-inf"), tl.float32)
            l_r = tl.zeros((G_PAD,), tl.float32)
            acc_r = tl.zeros((G_PAD, BLOCK_D), tl.float32)
            qr16 = tl.zeros((G_PAD, BLOCK_D), tl.float16)
            lean_scale = slot_scale
            rot = _desc(desc_ptr, 0, 25)
        # The compressed blocks COMP_TILE at a time, one tile per quantization the tile holds
        # (`mixed_slots._slot_tile`: the quantization a constexpr, the pools run-time); lean blocks
        # are counted and left to the block-by-block loop below.
        if TILES:  # (a constexpr: with the compressed kernel, `mixed_comp.py`, this tile reader is not compiled)
            occ = tl.arange(0, COMP_TILE)
            for jt in range(j_start, j_end, COMP_TILE):
                jj = jt + occ
                tcodes = tl.load(ent_ptr + (trow * NB + jj) * 2, mask=jj < j_end, other=0)
                quants = _desc(desc_ptr, tcodes, 0)  # code 0 (pages, past the end) reads row 0: quant 0
                lean_blocks += tl.sum((quants >= 5).to(tl.int32), axis=0)
                for QK in tl.static_range(1, 5):
                    if tl.max((quants == QK).to(tl.int32), axis=0) > 0:
                        cs, cv, cvcol, cread = _slot_tile(ent_ptr, desc_ptr, h, trow, NB, jt, j_end, seq_len, q16,
                                                          slot_scale, od, md, QK, D, BS, BLOCK_D, COMP_TILE, VG, DOT,
                                                          DOT_16BIT)
                        m_i, l_i, acc, cp, cm = _slot_step(cs, cv, cvcol, m_i, l_i, acc, DOT, DOT_16BIT)
                        if OBSERVE:
                            _store_block_lse(ent_out_ptr, NB_OUT, Hq, r, qh, mg, jt, j_end, cp, cm, cread, G_PAD,
                                             COMP_TILE, BS)
        if LEAN:  # noqa: SIM102 (a constexpr, then a run-time test: without LEAN the reader is not compiled)
            if lean_blocks > 0:
                for j in range(j_start, j_end):
                    code = tl.load(ent_ptr + (trow * NB + j) * 2)
                    # lean (QUANT_CODE int4h 5, int2h 6): rotated codes; row 0 (vLLM's pages) reads 0
                    if _desc(desc_ptr, code, 0) >= 5:
                        if rot == 0:  # the first lean block of this program: rotate the query, once
                            rot = _desc(desc_ptr, code, 25)
                            qr16, lean_scale = rotate_query(q, rot, sm_scale_log2, od, md, BLOCK_D, DOT)
                        ls, lv, lvcol = lean_block(ent_ptr, desc_ptr, h, trow, NB, code, j, seq_len, q, qr16,
                                                   lean_scale, sm_scale_log2, ot, od, md, BS, DOT, DOT_16BIT)
                        m_r, l_r, acc_r, lp, lm = _slot_step(ls, lv, lvcol, m_r, l_r, acc_r, DOT, DOT_16BIT)
                        if OBSERVE:
                            _store_block_lse(ent_out_ptr, NB_OUT, Hq, r, qh, mg, j, j_end, lp, lm,
                                             tl.full((1,), 1, tl.int1), G_PAD, 1, BS)
        if LEAN:  # noqa: SIM102 (a constexpr, then a run-time test: `and` would reference `rot` without LEAN)
            if rot != 0:  # un-rotate the lean blocks' output and merge their state in (before a split's partial)
                m_i, l_i, acc = merge_rotated(m_i, l_i, acc, m_r, l_r, acc_r, rot, od, md, BLOCK_D, DOT)
    if OBSERVE:  # the blocks past this row's end received nothing (the last split says so)
        for j in range(tl.where(sp == SPLITS - 1, nblk, NB_OUT), NB_OUT):
            tl.store(ent_out_ptr + (r * NB_OUT + j) * Hq + qh, tl.full((G_PAD,), float("-inf"), tl.float32), mask=mg)
    if PARTIAL:  # this split's running max, sum and unnormalised output: `_combine_splits_kernel` merges them
        part = (r * Hq + qh) * SPLITS + sp
        tl.store(part_ml_ptr + part * 2, m_i, mask=mg)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=mg)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + od[None, :], acc, mask=mg[:, None])
    else:
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(o_ptr + r * so_s + qh[:, None] * so_h + od[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=mg[:, None] & md[None, :])
        if OBSERVE:
            lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            tl.store(lse_ptr + r * Hq + qh, lse, mask=mg)


@triton.jit
def _combine_splits_kernel(
    part_ml_ptr, part_acc_ptr,  # what `_mixed_decode_kernel` wrote with PARTIAL
    o_ptr, so_s, so_h, lse_ptr, Hq, SPLITS,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
    OBSERVE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    og = tl.arange(0, G_PAD)
    osp = tl.arange(0, SPLITS_PAD)
    od = tl.arange(0, BLOCK_D)
    mg = og < G
    qh = h * G + og
    part = (r * Hq + qh)[:, None] * SPLITS + osp[None, :]  # [G_PAD, SPLITS_PAD]
    pm = mg[:, None] & (osp < SPLITS)[None, :]
    m_s = tl.load(part_ml_ptr + part * 2, mask=pm, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=pm, other=0.0)
    m = tl.max(m_s, axis=1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(l_s > 0, tl.math.exp2(m_s - m_use[:, None]), 0.0)  # an empty split weighs nothing
    l_tot = tl.sum(w * l_s, axis=1)
    acc = tl.zeros((G_PAD, BLOCK_D), tl.float32)
    for i in range(0, SPLITS):
        wi = tl.sum(tl.where(osp[None, :] == i, w, 0.0), axis=1)
        a = tl.load(part_acc_ptr + ((r * Hq + qh) * SPLITS + i)[:, None] * BLOCK_D + od[None, :], mask=mg[:, None],
                    other=0.0)
        acc += wi[:, None] * a
    has = l_tot > 0
    o = acc / tl.where(has, l_tot, 1.0)[:, None]
    tl.store(o_ptr + r * so_s + qh[:, None] * so_h + od[None, :], o.to(o_ptr.dtype.element_ty),
             mask=mg[:, None] & (od < D)[None, :])
    if OBSERVE:
        lse = tl.where(has, (m_use + tl.math.log2(tl.where(has, l_tot, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + r * Hq + qh, lse, mask=mg)


TILE_TOKENS = 128
"""Tokens of vLLM's pages one step of the kernel reads where a run of blocks is all bf16 (on the
H100 at 8 rows x 32k: 0.37 ms a layer at 128, 0.68 at 64; vLLM's own kernel 0.46)."""
COMP_TILE_TOKENS = 128
"""Rows of one compressed tile (`mixed_slots._slot_tile`), in tokens of vLLM's blocks."""
NUM_WARPS = 4
"""Warps of one program (`num_warps=` overrides, for the benchmark's sweep)."""
READER_ENV = "PROXIMA_COMPRESSED_READER"
COMPRESSED_READER = os.environ.get(READER_ENV, "").strip() or "tiles"
"""Who reads fp8 / int8 / int4 / int2 blocks: "tiles" (`mixed_slots._slot_tile`, inside the main
kernel) or "kernel" (`mixed_comp.py`, a kernel of their own; `compressed_reader=` overrides).
`PROXIMA_COMPRESSED_READER` sets it for a process (the benchmark's engines: the kernel reader is
not yet timed on a GPU, so "tiles" stays the default); another value fails the first decode
with the choices named."""
COMP_WARPS = 4
"""Warps of one program of the compressed kernel (`comp_warps=` overrides)."""
COMP_STAGES = 3
"""Software-pipelining stages of the compressed kernel's block loop (`comp_stages=` overrides)."""
COMP_SCAN = 64
"""Codes the compressed kernel reads per step of its scan for the quantizations present."""
MAX_SPLITS = 16
MIN_BLOCKS_PER_SPLIT = 8
"""A split walks at least this many blocks of the longest row the block table can hold: below
that, the partials' write and merge cost more than the parallelism buys."""
WAVES = 8
"""Programs per SM `auto_splits` aims for: on the H100 (2026-12-06, bench/one_pass_decode.py) 64 rows x
4k with one split (512 programs, ~4 per SM) took 0.47 ms a layer, with 4 (2,048) 0.40."""


@functools.cache
def _sm_count(index: int) -> int:
    """SMs of GPU `index`, asked once (auto_splits runs in every layer of every decode step)."""
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


@functools.cache
def _anchor(device: torch.device) -> torch.Tensor:
    """16 bytes the compressed kernel addresses its pools from (`mixed_comp._byte_rows`): a fresh
    allocation, so 16-byte aligned (the kernel's arithmetic relies on it), kept for the process."""
    t = torch.empty(16, dtype=torch.uint8, device=device)  # (never read: only its address)
    if t.data_ptr() % 16:
        raise RuntimeError("the compressed kernel's anchor is not 16-byte aligned")
    return t


def auto_splits(rows: int, kv_heads: int, table_blocks: int, device: torch.device) -> int:
    """How many programs share one row's context: enough (rows x KV heads x splits) for
    WAVES programs per SM, never more than the table's width allows. Decided from shapes only (the batch
    size, the block table's width, the device), never from this step's context lengths, so a CUDA
    graph captured at a batch size replays the same split. 1 on a CPU (the interpreter: no SMs)."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = -(-WAVES * sms // max(1, rows * kv_heads))
    return max(1, min(MAX_SPLITS, want, table_blocks // MIN_BLOCKS_PER_SPLIT))


def _value_group(key_group: int | None, block_d: int) -> int:
    """The `VG` constexpr: channels of an int4 / int2 value row read with one scale (`mixed_slots`):
    the largest power of two dividing the storage's smallest group, at most the padded head dim;
    1 (a scale per channel) when the group is unknown."""
    if not key_group:
        return 1
    return min(key_group & -key_group, block_d)


def mixed_decode(
    q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, slot_mapping: torch.Tensor, owner: torch.Tensor, entries: torch.Tensor,
    descriptors: torch.Tensor, *, sm_scale: float, entry_lse: torch.Tensor | None = None,
    lse: torch.Tensor | None = None, splits: int | None = None, tile_blocks: int | None = None,
    num_warps: int | None = None, key_group: int | None = None, lean: bool = True, comp_tile: int | None = None,
    compressed_reader: str | None = None, comp_warps: int | None = None, comp_stages: int | None = None,
) -> None:
    """Decode attention of S single-token rows over their mixed-format contexts, one launch.

    q [S, Hq, D]; out [S, Hq, D] (written in place, any float dtype); kv_cache vLLM's [N, H, BS,
    2D] 16-bit cache (block-contiguous); block_table [>= S, *] int32, seq_lens [>= S] int32,
    query_start_loc [>= S + 1], slot_mapping: vLLM's metadata of the step; owner / entries the
    device block table's (`worker/block_table.py`); descriptors from `pool_descriptors`. With
    entry_lse [S, NB_OUT, Hq] and lse [S, Hq] (float32) also the per-block log-sum-exp.

    `splits` (default `auto_splits`): programs per (row, KV head), each over a contiguous run of
    the row's blocks. With more than one, each writes its partial softmax state and a second
    launch (`_combine_splits_kernel`) merges them into `out` (and `lse`): two launches, and the
    per-block log-sum-exp is the same either way (absolute, not relative to a split's maximum).
    `key_group`: the smallest KIVI group of any pool in `descriptors` (the storage's, fixed while
    serving): how many value channels share one scale load (`VG`); None (unknown): one each.
    `tile_blocks` (default: TILE_TOKENS' worth, at least 1; a power of two): blocks read as one tile
    where they are all vLLM's pages. `lean=False` compiles the kernel without the lean formats'
    reader (`mixed_decode_lean.py`), for measuring what carrying it costs the other formats
    (`bench/one_pass_decode.py`); the descriptors must then hold no lean code (it would be read as
    KIVI codes). The backend always reads them (True). `comp_tile` (default: COMP_TILE_TOKENS'
    worth, at most `tile_blocks`; a power of two dividing it): compressed blocks of the fp8 / int8
    / int4 / int2 quantizations read as one tile per quantization (`mixed_slots._slot_tile`).
    Lean blocks are read block by block. `compressed_reader` (default COMPRESSED_READER): "tiles",
    the fp8 / int8 / int4 / int2 blocks read inside this kernel as above; "kernel", read first by a
    kernel of their own (`mixed_comp.py`, `comp_warps` warps and `comp_stages` pipelining stages,
    defaults COMP_WARPS and COMP_STAGES) whose partial
    state this kernel starts from: one more launch where the descriptors name any pool."""
    reader = COMPRESSED_READER if compressed_reader is None else compressed_reader
    if reader not in ("tiles", "kernel"):
        raise ValueError(f"mixed_decode's compressed_reader ({READER_ENV}) is 'tiles' or 'kernel', got {reader!r}")
    s, hq, d = q.shape
    _n, h, bs, d2 = kv_cache.shape
    if d2 != 2 * d or hq % h or out.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)}, out {tuple(out.shape)} and kv_cache {tuple(kv_cache.shape)} "
                         "do not match ([S, Hq, D], [N, H, BS, 2D])")
    if bs & (bs - 1) or kv_cache.stride(-1) != 1 or q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("mixed_decode needs a power-of-two block size and rows contiguous in D")
    if (entry_lse is None) != (lse is None):
        raise ValueError("entry_lse and lse go together (the observed layer's block mass needs both)")
    if s == 0:
        return
    g = hq // h
    observe = entry_lse is not None
    dummy = out
    n_split = auto_splits(s, h, block_table.shape[1], q.device) if splits is None else splits
    if n_split < 1:
        raise ValueError(f"mixed_decode splits a row's context over >= 1 programs, got {n_split}")
    partial = n_split > 1
    tb = max(1, TILE_TOKENS // bs) if tile_blocks is None else tile_blocks
    if tb < 1 or tb & (tb - 1):
        raise ValueError(f"mixed_decode reads tiles of a power-of-two number of blocks, got {tb}")
    ct = min(tb, max(1, COMP_TILE_TOKENS // bs)) if comp_tile is None else comp_tile
    if ct < 1 or ct & (ct - 1) or tb % ct:
        raise ValueError(f"mixed_decode reads compressed tiles of a power-of-two number of blocks dividing "
                         f"tile_blocks ({tb}), got {ct}")
    block_d = _p2(d, 16)
    part_ml = torch.empty(s, hq, n_split, 2, dtype=torch.float32, device=q.device) if partial else dummy
    part_acc = torch.empty(s, hq, n_split, block_d, dtype=torch.float32, device=q.device) if partial else dummy
    # tl.dot needs every dimension >= 16: the query heads are padded to 16 rows (masked), the
    # block (BS tokens) and head dim must reach 16 themselves; smaller shapes keep fp32 broadcasts.
    dot = bs >= 16 and _p2(d, 16) >= 16
    # 16-bit operands on a GPU; the interpreter multiplies bf16 dots wrongly (numpy has no bf16: a
    # 16 x 16 bf16 tl.dot is off by 1e10 in Triton 3.x's interpreter), so there it dots in fp32.
    dot_16bit = os.environ.get("TRITON_INTERPRET") != "1"
    g_pad = max(_p2(g, 1), 16) if dot else _p2(g, 1)
    vg = _value_group(key_group, block_d)
    # the compressed kernel only where a pool can be named (row 0 alone: nothing is compressed)
    comp = reader == "kernel" and descriptors.shape[0] > 1
    cml = torch.empty(s, hq, n_split, 2, dtype=torch.float32, device=q.device) if comp else dummy
    cacc = torch.empty(s, hq, n_split, block_d, dtype=torch.float32, device=q.device) if comp else dummy
    if comp:
        _comp_decode_kernel[(s, h, n_split)](
            q, q.stride(0), q.stride(1), seq_lens, query_start_loc, slot_mapping,
            owner, entries, entries.shape[1], descriptors, _anchor(q.device),
            entry_lse if observe else dummy, entry_lse.shape[1] if entry_lse is not None else 0, cml, cacc,
            hq, sm_scale * LOG2E, n_split,
            G=g, G_PAD=g_pad, D=d, BLOCK_D=block_d, BS=bs, OBSERVE=observe, DOT=dot, DOT_16BIT=dot_16bit,
            TILE_BLOCKS=tb, VG=vg, KEY_ROW=key_group is not None and key_group >= bs, SCAN=COMP_SCAN,
            ALIGN=d % 64 == 0, num_warps=comp_warps or COMP_WARPS, num_stages=comp_stages or COMP_STAGES,
        )  # fmt: skip
    _mixed_decode_kernel[(s, h, n_split)](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1),
        kv_cache, *kv_cache.stride()[:3],
        block_table, block_table.stride(0), seq_lens, query_start_loc, slot_mapping,
        owner, entries, entries.shape[1], descriptors,
        entry_lse if observe else dummy, entry_lse.shape[1] if entry_lse is not None else 0,
        lse if lse is not None else dummy, part_ml, part_acc, cml, cacc,
        hq, sm_scale * LOG2E, n_split,
        G=g, G_PAD=g_pad, D=d, BLOCK_D=block_d, BS=bs, OBSERVE=observe,
        DOT=dot, DOT_16BIT=dot_16bit, PARTIAL=partial, TILE_BLOCKS=tb, COMP_TILE=ct,
        VG=vg, LEAN=lean, TILES=reader == "tiles", COMP_IN=comp,
        num_warps=num_warps or NUM_WARPS,
    )  # fmt: skip
    if partial:
        _combine_splits_kernel[(s, h)](
            part_ml, part_acc, out, out.stride(0), out.stride(1), lse if lse is not None else dummy, hq, n_split,
            G=g, G_PAD=_p2(g, 1), D=d, BLOCK_D=block_d, SPLITS_PAD=_p2(n_split, 1), OBSERVE=observe,
        )  # fmt: skip


@triton.jit
def _block_importance_kernel(
    ent_ptr, NB_OUT, lse_ptr,  # [S, NB_OUT, Hq] per-block and [S, Hq] per-row log-sum-exp (natural log)
    seq_ptr, qsl_ptr, slot_ptr,  # vLLM's seq_lens, query_start_loc, slot_mapping
    owner_ptr, ent_tab_ptr, NB,  # device block table: owner [N], entries [rows, NB, 2]
    imp_owner_ptr, imp_ptr,  # importance rows: owner [N], importance [rows, NB, H] float32
    Hq, H, decay,
    G: tl.constexpr, G_PAD: tl.constexpr, BS: tl.constexpr, FOLD_MAX: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    og = tl.arange(0, G_PAD)
    mg = og < G
    qh = h * G + og
    first = tl.load(slot_ptr + tl.load(qsl_ptr + r))
    key = tl.maximum(first, 0) // BS
    trow = tl.where(first >= 0, tl.load(owner_ptr + key), 0).to(tl.int64)
    irow = tl.where(first >= 0, tl.load(imp_owner_ptr + key), 0).to(tl.int64)
    if irow != 0:  # row 0: padding, or a request that got no importance row
        lse = tl.load(lse_ptr + r * Hq + qh, mask=mg, other=0.0)
        seq_len = tl.load(seq_ptr + r)
        for j in range(0, tl.minimum(tl.cdiv(seq_len, BS), NB_OUT)):
            ent = tl.load(ent_ptr + (r * NB_OUT + j) * Hq + qh, mask=mg, other=float("-inf"))
            mass = tl.where(ent > float("-inf"), tl.exp(ent - lse), 0.0)
            if FOLD_MAX:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
                folded = tl.max(tl.where(mg, mass, float("-inf")), axis=0)
            else:
                folded = tl.sum(mass, axis=0) / G
            old = tl.load(imp_ptr + (irow * NB + j) * H + h)
            new = tl.where(old != old, folded, decay * old + (1.0 - decay) * folded)  # NaN: first sight
            code = tl.load(ent_tab_ptr + (trow * NB + j) * 2)
            tl.store(imp_ptr + (irow * NB + j) * H + h, new, mask=code == 0)


def update_block_importance(
    entry_lse: torch.Tensor, lse: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    slot_mapping: torch.Tensor, owner: torch.Tensor, entries: torch.Tensor, imp_owner: torch.Tensor,
    importance: torch.Tensor, *, decay: float, aggregate: str, block_size: int,
) -> None:
    """Fold one observed step into the device importance (`DeviceBlockTable.importance`), one launch.

    entry_lse [S, NB_OUT, Hq] and lse [S, Hq]: what `mixed_decode` wrote for the observed layer.
    Each row's blocks get mass = exp(entry_lse - lse) (as `block_mass`), folded over the KV head's
    query heads by `aggregate` ("max" or "mean", `observation.fold_heads`), then
    importance = decay * importance + (1 - decay) * mass, or mass where it was NaN (first sight).
    Only hot blocks (code 0) are updated: a compressed block keeps the value it had when it was
    compressed, as the torch observation (which cannot see compressed blocks) leaves it."""
    if aggregate not in ("max", "mean"):
        raise ValueError(f"importance.aggregate is 'max' or 'mean', got {aggregate!r}")
    s, nb_out, hq = entry_lse.shape
    h = importance.shape[2]
    if lse.shape != (s, hq) or hq % h or importance.shape[1] != entries.shape[1]:
        raise ValueError(f"entry_lse {tuple(entry_lse.shape)}, lse {tuple(lse.shape)}, importance "
                         f"{tuple(importance.shape)} and entries {tuple(entries.shape)} do not match")
    if s == 0:
        return
    g = hq // h
    _block_importance_kernel[(s, h)](
        entry_lse, nb_out, lse, seq_lens, query_start_loc, slot_mapping,
        owner, entries, entries.shape[1], imp_owner, importance,
        hq, h, decay, G=g, G_PAD=_p2(g, 1), BS=block_size, FOLD_MAX=aggregate == "max",
    )  # fmt: skip


def block_mass(entry_lse: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[S, NB, Hq] attention mass of each logical block (0 past a row's end)."""
    return torch.exp(entry_lse - lse.unsqueeze(1)).nan_to_num(0.0)


__all__ = ["MAX_CODES", "READS_QUANTS", "auto_splits", "block_mass", "mixed_decode", "pool_descriptors",
           "update_block_importance"]

