"""Triton split-K decode attention over one segment (one format) of paged slots.

One program handles (sequence, KV head, split): all G query heads of the KV head at once (the
GQA group padded to 16 rows so `tl.dot` runs on the tensor cores) and a contiguous range of the
sequence's entries, `EPT` entries (slots) per iteration. With one entry per iteration (every
shipped configuration at slot capacity 64; at vLLM's block 16 a 64-token tile holds 4) the slot
id is a scalar load and every address is a scalar base plus a loop-invariant row offset; with
several, each row's slot id and valid-token count are loaded as vectors the software pipeliner
prefetches together with the data tiles that depend on them. A padding entry's slot id is read as
0. KIVI key scales are loaded once per group of `RS` tokens and broadcast.

Dequantization happens in registers and never goes through an int -> float conversion
instruction (a unit at an eighth of the FMA rate on the H200): int4 / int2 codes become float16
through the hardware e4m3 -> f16 convert, int8 codes by the f16 magic number, fp8 by the e4m3
convert. With `planes` (the shipped int4 / int2 configs) a tile is unpacked into PER channel
planes (plane i: channels PER j + i, `_nibble_planes_f16`, `_crumb_planes_f16`), elementwise in
the loaded bytes, each contracted by its own dot (q, the key scales and the output are split /
interleaved per plane once, in registers); `unpack_asm` does the unpacking by inline PTX four
bytes at a time, which Triton's byte-wise code needed 3-4 instructions per code for.
Compressed formats multiply in f16, the hot path in bf16. Per-token scales (fp8 keys and values,
int8 values) are not applied per code: a key scale multiplies the score column, a value scale the
probability column before P @ V, or, with `scale_values` (fp8's shipped config), the value rows.

The launch configuration (tokens per iteration, warps, pipeline stages) is per format
(`DECODE_CONFIGS`, chosen by `bench/kernels.py --sweep` on the H200), and the split count follows
the compiled kernel's occupancy (`choose_splits`). Outputs per split: normalised output and
log-sum-exp; per entry: the log-sum-exp of its logits, from which `attention.decode_attention`
derives the entry's attention mass after the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from proxima.compression.segment import KVSegment
from proxima.compression.spec import QUANT_CODE, VALUES_PER_BYTE
from proxima.compression.triton_codes import (  # noqa: F401 - re-exported: the tests and benchmarks read them here
    LN2,
    LN2_C,
    LOG2E,
    LOG2E_C,
    _codes_f16,
    _crumb_planes_f16,
    _dequant_plane,
    _nibble_planes_f16,
    _planes4,
    _small_codes_f16,
)
from proxima.compression.triton_decode_configs import (  # noqa: F401 - re-exported, as above
    _DEFAULT_OCCUPANCY,
    _OCCUPANCY,
    DECODE_CONFIGS,
    KERNEL_INFO,
    DecodeConfig,
    _entries_per_it,
    _launch_key,
    _occupancy_of,
    _strides3,
    _uses_planes,
    choose_splits,
    parse_decode_spec,
    plan_splits,
)
from proxima.compression.triton_ops import INTERPRET, _p2


# Sizes that change every step (rows, entries, entries per split) are not specialized on: Triton
# would compile a new variant whenever one of them became 1 or a multiple of 16, a stall of 1-3 s
# in the middle of serving (seen on the H100 in the capacity run's mixed steps).
@triton.jit(do_not_specialize=["S", "E", "E_PER_SPLIT"])
def _decode_kernel(
    q_ptr,
    sq_s,
    sq_h,  # [S, Hq, D] queries (D contiguous)
    k_ptr,
    sk_slot,
    sk_t,
    sk_h,  # key pool [slots, C, H, P] (P contiguous); fp8 pools are passed as uint8
    v_ptr,
    sv_slot,
    sv_t,
    sv_h,  # value pool, same shape
    ks_ptr,
    kz_ptr,
    sks_slot,
    sks_t,
    sks_h,  # key scale / zero (see CompressedBlocks)
    vs_ptr,
    vz_ptr,
    svs_slot,
    svs_t,
    svs_h,  # value scale / zero
    lc_ptr,
    slc_slot,
    slc_t,
    slc_h,  # log(count) [slots, C, H] (cluster only)
    tab_ptr,
    ntok_ptr,  # [S, E] int32 slot ids and valid tokens per entry (contiguous)
    o_ptr,
    lse_ptr,  # [SPLITS, S, Hq, D] and [SPLITS, S, Hq] float32 partial results
    ent_ptr,  # [S, E, Hq] float32 per-entry log-sum-exp (natural log)
    S,
    E,
    Hq,
    E_PER_SPLIT,  # entries per split, a multiple of EPT
    sm_scale_log2,
    QUANT: tl.constexpr,  # spec.QUANT_CODE: 0 bf16, 1 fp8, 2 int8, 3 int4, 4 int2
    HAS_COUNT: tl.constexpr,
    GROUP: tl.constexpr,
    PER: tl.constexpr,  # codes per byte (1 for bf16 / fp8 / int8)
    G: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,  # G padded to >= 16 (tl.dot's minimum)
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= D
    C: tl.constexpr,  # slot capacity (tokens), a power of two
    EPT: tl.constexpr,  # entries per iteration
    RS: tl.constexpr,  # tokens per row group: min(GROUP, C) for KIVI keys, else C
    DOT_F32: tl.constexpr,  # interpreter only: its 16-bit tl.dot is wrong (Triton 3.9), so dot in f32
    SCALE_V: tl.constexpr,  # fp8 / int8: per-token value scales on the value rows, not on P
    PLANES: tl.constexpr,  # int4 / int2: PER channel planes, PER key dots per tile (`_nibble_planes_f16`)
    UNPACK_ASM: tl.constexpr,  # int8; int4 / int2 with PLANES: unpack by PTX (compiled only): 1 keys, 2 + values
):
    """Dot dtypes: the hot path multiplies bf16 as cached. Compressed formats dequantize to
    float16 (codes are small integers or e4m3, exact in f16; scales are stored f16) and use f16
    tensor-core dots: q is scaled by a power of two into [-1, 1] first, so f16's range is never
    at stake. int4 / int2 tiles carry a factor 2^-9 (see `_small_codes_f16`), removed from the
    scores and the output in float32."""
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    BLOCK_N: tl.constexpr = EPT * C
    NR: tl.constexpr = BLOCK_N // RS  # row groups per tile (KIVI key scales)
    RPE: tl.constexpr = C // RS  # row groups per entry
    BP: tl.constexpr = BLOCK_D // PER  # stored elements per row, padded to a power of two
    P: tl.constexpr = D // PER
    SMALL: tl.constexpr = QUANT >= 3  # e4m3-unpacked int4 / int2: tiles hold code * 2^-9
    # PLANES (int4 / int2, see `_uses_planes`): channel plane i = channels PER j + i; q, the key
    # scales and the output are loaded / stored contiguously and split into planes / interleaved
    # back in registers; each tile is contracted plane by plane
    PL: tl.constexpr = PER if PLANES else 1
    og = tl.arange(0, G_PAD)
    od = tl.arange(0, BLOCK_D)
    mg = og < G
    md = od < D
    qh = h * G + og  # query heads of this KV head
    q = tl.load(q_ptr + seq * sq_s + qh[:, None] * sq_h + od[None, :], mask=mg[:, None] & md[None, :], other=0.0)
    q1 = q  # planes 1-3 of q (PLANES only)
    q2 = q
    q3 = q
    if PLANES:
        if PER == 2:
            q, q1 = tl.split(tl.reshape(q, (G_PAD, BP, 2)))
        else:
            q, q1, q2, q3 = _planes4(q, G_PAD, BP)
    score_scale = sm_scale_log2
    if SMALL:
        score_scale = score_scale * 512.0
    if DOT_F32:
        q = q.to(tl.float32)
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        q3 = q3.to(tl.float32)
        dot_t: tl.constexpr = tl.float32
    elif QUANT == 0:
        dot_t: tl.constexpr = q_ptr.dtype.element_ty  # type: ignore[no-redef]  # constexpr branches
    else:
        # q / 2^ceil(log2 max|q|) lies in [-1, 1]: exact in f16 down to 2^-14 of the largest element
        qmax = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
        if PLANES:
            qmax = tl.maximum(qmax, tl.max(tl.max(tl.abs(q1.to(tl.float32)), axis=1), axis=0))
            if PER == 4:
                qmax = tl.maximum(qmax, tl.max(tl.max(tl.abs(q2.to(tl.float32)), axis=1), axis=0))
                qmax = tl.maximum(qmax, tl.max(tl.max(tl.abs(q3.to(tl.float32)), axis=1), axis=0))
        qn = tl.where(qmax > 0, tl.math.exp2(tl.math.ceil(tl.math.log2(tl.maximum(qmax, 1e-30)))), 1.0)
        q = (q.to(tl.float32) * (1.0 / qn)).to(tl.float16)
        if PLANES:
            q1 = (q1.to(tl.float32) * (1.0 / qn)).to(tl.float16)
            q2 = (q2.to(tl.float32) * (1.0 / qn)).to(tl.float16)
            q3 = (q3.to(tl.float32) * (1.0 / qn)).to(tl.float16)
        score_scale = score_scale * qn
        dot_t: tl.constexpr = tl.float16  # type: ignore[no-redef]
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D // PL), tl.float32)
    acc1 = tl.zeros((G_PAD, BLOCK_D // PL), tl.float32)  # planes 1-3 (PLANES only)
    acc2 = tl.zeros((G_PAD, BLOCK_D // PL), tl.float32)
    acc3 = tl.zeros((G_PAD, BLOCK_D // PL), tl.float32)
    e_begin = split * E_PER_SPLIT
    e_end = tl.minimum(e_begin + E_PER_SPLIT, E)
    orr = tl.arange(0, NR)
    op = tl.arange(0, BP)
    t0 = (orr % RPE) * RS  # first token of each row group within its slot
    col_entry = tl.arange(0, BLOCK_N) // C  # tile entry of each row / score column
    tn = tl.arange(0, BLOCK_N) % C  # token of each row within its slot
    oe = tl.arange(0, EPT)
    # loop-invariant parts of every per-row offset (the token within its slot, the KV head)
    k_row = tn * sk_t + h * sk_h
    v_row = tn * sv_t + h * sv_h
    ks_row = tn * sks_t + h * sks_h
    vs_row = tn * svs_t + h * svs_h
    lc_row = tn * slc_t + h * slc_h
    for e0 in range(e_begin, e_end, EPT):
        # ---- per-row metadata: the slot id and valid-token count of each row's entry.
        if EPT == 1:
            # one entry per tile: its slot id is a scalar, so every address below is a scalar base
            # plus a loop-invariant row offset (no per-row 64-bit multiply); e0 < e_end here
            nt_n = tl.load(ntok_ptr + seq * E + e0)
            # a padding entry's slot id is ignored (segment.py): slot 0, so no address is computed
            # from it (the KIVI key scales below are read unmasked by token)
            slot_n = tl.where(nt_n > 0, tl.load(tab_ptr + seq * E + e0), 0).to(tl.int64)
            valid_n = tn < nt_n
        else:
            # EPT distinct values per tile, loaded per row (the repeats hit L1); the software
            # pipeliner prefetches these and the data tiles that depend on them
            en = e0 + col_entry
            men = en < e_end
            nt_n = tl.load(ntok_ptr + seq * E + en, mask=men, other=0)
            slot_n = tl.where(nt_n > 0, tl.load(tab_ptr + seq * E + en, mask=men, other=0), 0).to(tl.int64)
            valid_n = men & (tn < nt_n)
        if P == BP:  # noqa: SIM108 - constexpr branch: Triton compiles one side
            m2 = valid_n[:, None]
        else:
            m2 = valid_n[:, None] & (op < P)[None, :]
        k_ptrs = k_ptr + (slot_n * sk_slot + k_row)[:, None] + op[None, :]
        v_ptrs = v_ptr + (slot_n * sv_slot + v_row)[:, None] + op[None, :]
        # ---- keys -> scores [G_PAD, BLOCK_N] in log2 units
        if QUANT == 0:
            k = tl.trans(tl.load(k_ptrs, mask=m2, other=0.0).to(dot_t))
        elif QUANT == 1:  # fp8 e4m3 is exact in f16; the per-token scale goes on the score column
            k = tl.trans(tl.load(k_ptrs, mask=m2, other=0).to(tl.float8e4nv, bitcast=True).to(dot_t))
        else:  # KIVI keys: per channel, one scale / zero row per row group of RS tokens
            if PLANES:
                if PER == 2:
                    kc, kc1 = _nibble_planes_f16(tl.load(k_ptrs, mask=m2, other=0), UNPACK_ASM >= 1)
                    kc2 = kc
                    kc3 = kc
                else:
                    kc, kc1, kc2, kc3 = _crumb_planes_f16(tl.load(k_ptrs, mask=m2, other=0), UNPACK_ASM >= 1)
                kc = tl.reshape(kc, (NR, RS, BP))
                kc1 = tl.reshape(kc1, (NR, RS, BP))
                kc2 = tl.reshape(kc2, (NR, RS, BP))
                kc3 = tl.reshape(kc3, (NR, RS, BP))
            elif SMALL:
                kc = _small_codes_f16(tl.load(k_ptrs, mask=m2, other=0), PER)
            else:
                kc = _codes_f16(tl.load(k_ptrs, mask=m2, other=0), False, UNPACK_ASM >= 1)
            if not PLANES:
                kc = tl.reshape(kc, (NR, RS, BLOCK_D))
            if EPT == 1:
                g_off = slot_n * sks_slot + ((t0 // GROUP) * sks_t + h * sks_h)[:, None] + od[None, :]
                gm = (orr >= 0)[:, None] & md[None, :]
            else:
                er = e0 + orr // RPE
                mr = er < e_end
                nt_r = tl.load(ntok_ptr + seq * E + er, mask=mr, other=0)
                slot_r = tl.where(nt_r > 0, tl.load(tab_ptr + seq * E + er, mask=mr, other=0), 0).to(tl.int64)
                g_off = slot_r[:, None] * sks_slot + (t0 // GROUP)[:, None] * sks_t + h * sks_h + od[None, :]
                gm = mr[:, None] & md[None, :]
            sc = tl.load(ks_ptr + g_off, mask=gm, other=0.0)
            zp = tl.load(kz_ptr + g_off, mask=gm, other=0.0)
            if SMALL:
                zp = zp * 0.001953125  # 2^-9, exact
            if PLANES:  # contiguous loads (the pipeliner prefetches them), split into planes in registers
                if PER == 2:
                    sc, sc1 = tl.split(tl.reshape(sc, (NR, BP, 2)))
                    zp, zp1 = tl.split(tl.reshape(zp, (NR, BP, 2)))
                    sc2, sc3, zp2, zp3 = sc, sc, zp, zp
                else:
                    sc, sc1, sc2, sc3 = _planes4(sc, NR, BP)
                    zp, zp1, zp2, zp3 = _planes4(zp, NR, BP)
            k = tl.reshape(kc.to(dot_t) * sc.to(dot_t)[:, None, :] + zp.to(dot_t)[:, None, :], (BLOCK_N, BLOCK_D // PL))
            k = tl.trans(k)
            if PLANES:  # the other planes
                k1 = kc1.to(dot_t) * sc1.to(dot_t)[:, None, :] + zp1.to(dot_t)[:, None, :]
                k1 = tl.trans(tl.reshape(k1, (BLOCK_N, BP)))
                if PER == 4:
                    k2 = kc2.to(dot_t) * sc2.to(dot_t)[:, None, :] + zp2.to(dot_t)[:, None, :]
                    k2 = tl.trans(tl.reshape(k2, (BLOCK_N, BP)))
                    k3 = kc3.to(dot_t) * sc3.to(dot_t)[:, None, :] + zp3.to(dot_t)[:, None, :]
                    k3 = tl.trans(tl.reshape(k3, (BLOCK_N, BP)))
        s = tl.dot(q, k)  # k is [BLOCK_D // PL, BLOCK_N]
        if PLANES:  # the other planes' partial scores add up
            s = tl.dot(q1, k1, s)
            if PER == 4:
                s = tl.dot(q3, k3, tl.dot(q2, k2, s))
        if QUANT == 1:
            ks = tl.load(ks_ptr + slot_n * sks_slot + ks_row, mask=valid_n, other=0.0)
            s = s * (ks * score_scale)[None, :]
        else:
            s = s * score_scale
        if HAS_COUNT:
            lc = tl.load(lc_ptr + slot_n * slc_slot + lc_row, mask=valid_n, other=0.0)
            s = s + lc[None, :] * LOG2E_C
        s = tl.where(valid_n[None, :], s, float("-inf"))
        # ---- online softmax
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        p_sum = tl.sum(p, axis=1)
        l_i = l_i * alpha + p_sum
        m_i = m_new
        # ---- values
        if QUANT == 0:
            v = tl.load(v_ptrs, mask=m2, other=0.0).to(dot_t)
        elif QUANT == 1:
            v = tl.load(v_ptrs, mask=m2, other=0).to(tl.float8e4nv, bitcast=True).to(dot_t)
        elif QUANT == 2:  # int8 values: symmetric codes in [-127, 127], exact in f16
            v = _codes_f16(tl.load(v_ptrs, mask=m2, other=0), True, UNPACK_ASM >= 2).to(dot_t)
        else:  # int4 / int2 values: scale and zero per (token, GROUP channels)
            NG: tl.constexpr = BLOCK_D // GROUP
            ogr = tl.arange(0, NG)
            vg_off = (slot_n * svs_slot + vs_row)[:, None] + ogr[None, :]
            vgm = valid_n[:, None] & (ogr < D // GROUP)[None, :]
            vsc = tl.load(vs_ptr + vg_off, mask=vgm, other=0.0).to(dot_t)
            vzp = tl.load(vz_ptr + vg_off, mask=vgm, other=0.0).to(dot_t)
            if PLANES:
                # plane column j is channel PER j + i: its value group is j // (GROUP / PER) in all
                vb = tl.load(v_ptrs, mask=m2, other=0)
                vzp = vzp * 0.001953125
                # Each plane gets its own dot and accumulator (`acc`, `acc1`..): joining the planes
                # back into channel order before one dot measured slower on the H200 (int4 315 vs
                # 274 us at 32k x 8, 2026-12-02), although it has fewer instructions.
                if PER == 2:
                    v, v1 = _nibble_planes_f16(vb, UNPACK_ASM >= 2)
                    v2, v3 = v, v
                else:
                    v, v1, v2, v3 = _crumb_planes_f16(vb, UNPACK_ASM >= 2)
                v = _dequant_plane(v, vsc, vzp, BLOCK_N, NG, GROUP // PER)
                v1 = _dequant_plane(v1, vsc, vzp, BLOCK_N, NG, GROUP // PER)
                if PER == 4:
                    v2 = _dequant_plane(v2, vsc, vzp, BLOCK_N, NG, GROUP // PER)
                    v3 = _dequant_plane(v3, vsc, vzp, BLOCK_N, NG, GROUP // PER)
            else:
                vc = tl.reshape(_small_codes_f16(tl.load(v_ptrs, mask=m2, other=0), PER), (BLOCK_N, NG, GROUP))
                if SMALL:
                    vzp = vzp * 0.001953125  # 2^-9, exact
                v = vc.to(dot_t) * vsc[:, :, None] + vzp[:, :, None]
            if not PLANES:
                v = tl.reshape(v, (BLOCK_N, BLOCK_D))
        if QUANT == 1 or QUANT == 2:
            # per-token value scale relative to the tile's largest (so f16 operands stay in range);
            # the dot is scaled back in f32
            vs = tl.load(vs_ptr + slot_n * svs_slot + vs_row, mask=valid_n, other=0.0)
            vmax = tl.maximum(tl.max(vs, axis=0), 1e-30)
            if SCALE_V:
                # on the value rows (one f16 multiply per code); this also keeps the compiler from
                # reading the 8-bit tile from shared memory byte by byte in the dot-operand layout
                # (compile-only: no byte loads, fp8 / int8 at 244 / 188 registers instead of 255)
                pv = tl.dot(p.to(dot_t), v * (vs * (1.0 / vmax)).to(dot_t)[:, None]) * vmax
            else:  # on the probability column (int8's default: the faster of the two on the H200)
                pv = tl.dot((p * (vs * (1.0 / vmax))[None, :]).to(dot_t), v) * vmax
        else:
            pv = tl.dot(p.to(dot_t), v)
        acc = acc * alpha[:, None] + pv
        if PLANES:
            acc1 = acc1 * alpha[:, None] + tl.dot(p.to(dot_t), v1)
            if PER == 4:
                acc2 = acc2 * alpha[:, None] + tl.dot(p.to(dot_t), v2)
                acc3 = acc3 * alpha[:, None] + tl.dot(p.to(dot_t), v3)
        # ---- per-entry log-sum-exp, for the block attention mass
        if EPT == 1:
            pe = p_sum[:, None]  # [G_PAD, 1]
        else:
            pe = tl.zeros((G_PAD, EPT), tl.float32)
            for j in tl.static_range(EPT):
                pj = tl.sum(tl.where((col_entry == j)[None, :], p, 0.0), axis=1)
                pe = tl.where((oe == j)[None, :], pj[:, None], pe)
        ent = tl.where(pe > 0, (tl.math.log2(tl.maximum(pe, 1e-30)) + m_use[:, None]) * LN2_C, float("-inf"))
        me = mg[:, None] & (e0 + oe < e_end)[None, :]
        tl.store(ent_ptr + (seq * E + e0 + oe[None, :]) * Hq + qh[:, None], ent, mask=me)
    has = l_i > 0
    out_scale = 512.0 if SMALL else 1.0
    inv_l = (out_scale / tl.where(has, l_i, 1.0))[:, None]
    o = acc * inv_l
    if PLANES:  # the planes interleave back into channel order
        if PER == 2:
            o = tl.reshape(tl.join(o, acc1 * inv_l), (G_PAD, BLOCK_D))
        else:
            o = tl.reshape(tl.join(tl.join(o, acc2 * inv_l), tl.join(acc1 * inv_l, acc3 * inv_l)), (G_PAD, BLOCK_D))
    lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * LN2_C, float("-inf"))
    row = (split * S + seq) * Hq + qh
    tl.store(o_ptr + row[:, None] * D + od[None, :], o, mask=mg[:, None] & md[None, :])
    tl.store(lse_ptr + row, lse, mask=mg)


def segment_partial(
    q: torch.Tensor, seg: KVSegment, sm_scale: float, splits: int, o: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """Fill o [SPLITS, S, Hq, D] f32 and lse [SPLITS, S, Hq] f32 (contiguous) with one segment's
    partial attention; returns entry_lse [S, E, Hq] f32."""
    st = seg.store
    s, hq, d = q.shape
    h, c = st.num_kv_heads, st.slot_tokens
    e = seg.slot_table.shape[1]
    if o.shape != (splits, s, hq, d) or not o.is_contiguous() or not lse.is_contiguous():
        raise ValueError(f"o must be contiguous [{splits}, {s}, {hq}, {d}], got {tuple(o.shape)}")
    if c & (c - 1):
        raise ValueError(f"{st.fmt}: the Triton decode kernel needs a power-of-two slot capacity, got {c}")
    if d < 32:  # int4 at head_dim 16 computed wrong attention compiled on the H200 (cause not found)
        raise ValueError(f"{st.fmt}: the Triton decode kernel needs head_dim >= 32, got {d}")
    for name, t in (("k_data", st.k_data), ("v_data", st.v_data), ("q", q)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    quant = st.fmt.quant
    if quant not in DECODE_CONFIGS:
        raise ValueError(f"{st.fmt}: the split decode kernel does not read {quant} codes; "
                         "attention.decode_attention passes lean segments dequantized (dequantized_segment)")
    cfg = DECODE_CONFIGS[quant]
    ept = _entries_per_it(seg, cfg)
    # whole iterations per split, so an iteration's entries never straddle a split boundary
    e_per_split = triton.cdiv(triton.cdiv(max(e, 1), splits), ept) * ept
    dev = q.device
    # every entry lies in exactly one split's range and is written there: no fill needed
    ent = torch.empty((s, e, hq), device=dev, dtype=torch.float32)
    tab = seg.slot_table.to(device=dev, dtype=torch.int32).contiguous()
    ntok = seg.slot_tokens.to(device=dev, dtype=torch.int32).contiguous()
    per = VALUES_PER_BYTE.get(quant, 1)
    g = hq // h
    kivi = quant in ("int8", "int4", "int2")
    k_data, v_data = st.k_data, st.v_data
    if quant == "fp8":  # loaded as bytes (a masked fp8 load has no `other`), bitcast in the kernel
        k_data, v_data = k_data.view(torch.uint8), v_data.view(torch.uint8)
    dummy = st.k_data
    lc = st.log_count
    kernel = _decode_kernel[(s, h, splits)](
        q, *q.stride()[:2],
        k_data, *k_data.stride()[:3],
        v_data, *v_data.stride()[:3],
        st.k_scale if st.k_scale is not None else dummy, st.k_zero if st.k_zero is not None else dummy,
        *_strides3(st.k_scale),
        st.v_scale if st.v_scale is not None else dummy, st.v_zero if st.v_zero is not None else dummy,
        *_strides3(st.v_scale),
        lc if lc is not None else dummy, *_strides3(lc),
        tab, ntok, o, lse, ent,
        s, e, hq, e_per_split, sm_scale * LOG2E,
        QUANT=QUANT_CODE[quant], HAS_COUNT=lc is not None, GROUP=st.group_size,
        PER=per, G=g, G_PAD=_p2(g, 16), D=d, BLOCK_D=_p2(d, 16), C=c, EPT=ept,
        RS=min(st.group_size, c) if kivi else c, DOT_F32=INTERPRET, SCALE_V=cfg.scale_values,
        PLANES=_uses_planes(cfg, quant, d, st.group_size),
        UNPACK_ASM=0 if INTERPRET else cfg.unpack_asm,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers and not INTERPRET else {}),
    )  # fmt: skip
    key = _launch_key(seg, q, cfg)
    if dev.type == "cuda" and key not in _OCCUPANCY:
        occ = _occupancy_of(kernel, cfg.num_warps, dev)
        if occ:
            _OCCUPANCY[key] = occ
            KERNEL_INFO[key] = {
                "regs": int(kernel.n_regs), "spills": int(kernel.n_spills),
                "smem": int(kernel.metadata.shared), "occupancy": occ,
            }  # fmt: skip
    return ent


@triton.jit(do_not_specialize=["P", "ROWS"])  # per-step sizes (see `_decode_kernel`)
def _merge_kernel(
    o_ptr,  # [P, S*Hq, D] float32 partial outputs (each normalised over its part)
    lse_ptr,  # [P, S*Hq] float32 partial log-sum-exp (-inf: the part saw nothing)
    out_ptr,  # [S*Hq, D] output, q's dtype
    lse_out_ptr,  # [S*Hq] float32
    P,
    ROWS,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    od = tl.arange(0, BLOCK_D)
    md = od < D
    m = tl.full((), float("-inf"), tl.float32)
    tot = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for p0 in range(0, P, BLOCK_P):
        op = p0 + tl.arange(0, BLOCK_P)
        mp = op < P
        lp = tl.load(lse_ptr + op * ROWS + row, mask=mp, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lp, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(lp - m_use)
        alpha = tl.exp(m - m_use)
        o = tl.load(o_ptr + (op[:, None] * ROWS + row) * D + od[None, :], mask=mp[:, None] & md[None, :], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        tot = tot * alpha + tl.sum(w, axis=0)
        m = m_new
    has = tot > 0
    res = acc / tl.where(has, tot, 1.0)
    tl.store(out_ptr + row * D + od, res.to(out_ptr.dtype.element_ty), mask=md)
    lse = tl.where(has, tl.where(m == float("-inf"), 0.0, m) + tl.log(tl.where(has, tot, 1.0)), float("-inf"))
    tl.store(lse_out_ptr + row, lse)


def merge(o: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch merging P partials: o [P, S, Hq, D], lse [P, S, Hq] -> ([S, Hq, D], [S, Hq])."""
    p, s, hq, d = o.shape
    out = torch.empty(s, hq, d, device=o.device, dtype=out_dtype)
    lse_out = torch.empty(s, hq, device=o.device, dtype=torch.float32)
    _merge_kernel[(s * hq,)](o, lse, out, lse_out, p, s * hq, D=d, BLOCK_D=_p2(d, 16), BLOCK_P=32)
    return out, lse_out
