"""Triton split-K decode attention over one segment (one format) of paged slots.

One program handles (sequence, KV head, split): all G query heads of the KV head at once (the
GQA group padded to 16 rows so `tl.dot` applies), and a contiguous range of the sequence's
entries, a few slots per iteration (SLOTS_PER_IT * C tokens, gathered through the slot table).
Keys and values are dequantized in registers (nothing is written back), so a compressed format
moves only its own bytes plus metadata: that is where the decode speed-up comes from.
Outputs per split: normalised output and log-sum-exp; per entry: the log-sum-exp of its
logits, from which `attention.decode_attention` derives the entry's attention mass after the
merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from proxima.compression.segment import KVSegment
from proxima.compression.spec import QUANT_CODE, VALUES_PER_BYTE
from proxima.compression.triton_ops import INTERPRET, _load_dequant, _p2, _round_to_bf16

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _unpack_tile(
    d_ptr,
    rows,
    mask_r,  # code tensor, int64 row offsets [R] (slot, token, head), row mask [R]
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
):
    """float32 codes [R, BLOCK_D] from packed bytes. The bytes are loaded as a dense [R, D / PER]
    tile (wide, coalesced loads) and split in registers: one load per byte, not one per code
    (the per-code gather ran int4 decode at 50 GB/s on the H200, run 1 in bench/results)."""
    BP: tl.constexpr = BLOCK_D // PER
    op = tl.arange(0, BP)
    byte = tl.load(d_ptr + rows[:, None] + op[None, :], mask=mask_r[:, None] & (op < D // PER)[None, :], other=0)
    byte = byte.to(tl.int32)
    if PER == 1:
        return byte.to(tl.float32)
    else:
        sh = tl.arange(0, PER) * BITS
        codes = (byte[:, :, None] >> sh[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(codes, (R, BLOCK_D)).to(tl.float32)


@triton.jit
def _kivi_keys_tile(
    k_ptr,
    ks_ptr,
    kz_ptr,
    tab_ptr,
    seq,
    E,
    e0,
    e_end,
    slot,
    t,
    h,
    valid,
    sk_slot,
    sk_t,
    sk_h,
    sks_slot,
    sks_t,
    sks_h,
    BLOCK_N: tl.constexpr,
    C: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    GROUP: tl.constexpr,
    EG: tl.constexpr,
):
    """Dequantized keys [BLOCK_N, BLOCK_D]: scale and zero are loaded once per token group
    (EG = min(GROUP, C) rows share them) and broadcast, not gathered per element."""
    codes = _unpack_tile(
        k_ptr, slot * sk_slot + t.to(tl.int64) * sk_t + h * sk_h, valid, BLOCK_N, D, BLOCK_D, BITS, PER
    )
    NGT: tl.constexpr = BLOCK_N // EG
    row0 = tl.arange(0, NGT) * EG
    eg = e0 + row0 // C
    mg = eg < e_end
    slot_g = tl.load(tab_ptr + seq * E + eg, mask=mg, other=0).to(tl.int64)
    slot_g = tl.where(mg, slot_g, 0)
    grp = (row0 % C) // GROUP
    od = tl.arange(0, BLOCK_D)
    moff = slot_g[:, None] * sks_slot + grp[:, None] * sks_t + h * sks_h + od[None, :]
    mm = mg[:, None] & (od < D)[None, :]
    sc = tl.load(ks_ptr + moff, mask=mm, other=0.0).to(tl.float32)
    zp = tl.load(kz_ptr + moff, mask=mm, other=0.0).to(tl.float32)
    k3 = tl.reshape(codes, (NGT, EG, BLOCK_D)) * sc[:, None, :] + zp[:, None, :]
    return tl.reshape(k3, (BLOCK_N, BLOCK_D))


@triton.jit
def _kivi_values_tile(
    v_ptr,
    vs_ptr,
    vz_ptr,
    slot,
    t,
    h,
    valid,
    sv_slot,
    sv_t,
    sv_h,
    svs_slot,
    svs_t,
    svs_h,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Dequantized values [BLOCK_N, BLOCK_D]: one scale and zero per (token, channel group)."""
    codes = _unpack_tile(
        v_ptr, slot * sv_slot + t.to(tl.int64) * sv_t + h * sv_h, valid, BLOCK_N, D, BLOCK_D, BITS, PER
    )
    NG: tl.constexpr = BLOCK_D // GROUP
    og = tl.arange(0, NG)
    moff = slot[:, None] * svs_slot + t[:, None].to(tl.int64) * svs_t + h * svs_h + og[None, :]
    mm = valid[:, None] & (og < D // GROUP)[None, :]
    sc = tl.load(vs_ptr + moff, mask=mm, other=0.0).to(tl.float32)
    zp = tl.load(vz_ptr + moff, mask=mm, other=0.0).to(tl.float32)
    v3 = tl.reshape(codes, (BLOCK_N, NG, GROUP)) * sc[:, :, None] + zp[:, :, None]
    return tl.reshape(v3, (BLOCK_N, BLOCK_D))


@triton.jit
def _decode_kernel(
    q_ptr,
    sq_s,
    sq_h,  # [S, Hq, D] queries (D contiguous)
    k_ptr,
    sk_slot,
    sk_t,
    sk_h,  # key pool [slots, C, H, P] (P contiguous)
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
    E_PER_SPLIT,
    sm_scale_log2,
    QUANT: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    C: tl.constexpr,
    SLOTS_PER_IT: tl.constexpr,
    DOT_F32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong (Triton 3.9), so dot in f32
    EG: tl.constexpr,  # rows sharing one key scale: min(GROUP, C)
):
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    BLOCK_N: tl.constexpr = SLOTS_PER_IT * C
    og = tl.arange(0, G_PAD)
    od = tl.arange(0, BLOCK_D)
    on = tl.arange(0, BLOCK_N)
    md = od < D
    mg = og < G
    qh = h * G + og  # query heads of this KV head
    q = tl.load(q_ptr + seq * sq_s + qh[:, None] * sq_h + od[None, :], mask=mg[:, None] & md[None, :], other=0.0)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D), tl.float32)
    e_begin = split * E_PER_SPLIT
    e_end = tl.minimum(e_begin + E_PER_SPLIT, E)
    t = on % C
    el = on // C
    for e0 in range(e_begin, e_end, SLOTS_PER_IT):
        e = e0 + el
        me = e < e_end
        slot = tl.load(tab_ptr + seq * E + e, mask=me, other=0).to(tl.int64)
        nt = tl.load(ntok_ptr + seq * E + e, mask=me, other=0)
        valid = me & (t < nt)
        slot = tl.where(valid, slot, 0)  # padding entries may hold any id; read slot 0 instead
        m2 = valid[:, None] & md[None, :]
        if QUANT == 0:
            k = tl.load(
                k_ptr + slot[:, None] * sk_slot + t[:, None] * sk_t + h * sk_h + od[None, :], mask=m2, other=0.0
            )
            v = tl.load(
                v_ptr + slot[:, None] * sv_slot + t[:, None] * sv_t + h * sv_h + od[None, :], mask=m2, other=0.0
            )
        else:
            if QUANT == 1:
                k = _load_dequant(
                    k_ptr, ks_ptr, kz_ptr, slot, t, h, od, m2, sk_slot, sk_t, sk_h,
                    sks_slot, sks_t, sks_h, QUANT, True, GROUP, BITS, PER,
                )  # fmt: skip
            else:  # int8 / int4 / int2 keys are KIVI-grouped
                k = _kivi_keys_tile(
                    k_ptr, ks_ptr, kz_ptr, tab_ptr, seq, E, e0, e_end, slot, t, h, valid,
                    sk_slot, sk_t, sk_h, sks_slot, sks_t, sks_h,
                    BLOCK_N, C, D, BLOCK_D, BITS, PER, GROUP, EG,
                )  # fmt: skip
            if QUANT <= 2:  # fp8 / int8 values: one scale per token
                v = _load_dequant(
                    v_ptr, vs_ptr, vz_ptr, slot, t, h, od, m2, sv_slot, sv_t, sv_h,
                    svs_slot, svs_t, svs_h, QUANT, False, GROUP, BITS, PER,
                )  # fmt: skip
            else:
                v = _kivi_values_tile(
                    v_ptr, vs_ptr, vz_ptr, slot, t, h, valid, sv_slot, sv_t, sv_h, svs_slot, svs_t, svs_h,
                    BLOCK_N, D, BLOCK_D, BITS, PER, GROUP,
                )  # fmt: skip
            # the tensor cores take q's dtype; dequantized values are rounded to it, as the
            # reference does when it decompresses to the cache dtype
            if DOT_F32:
                k = _round_to_bf16(k)
                v = _round_to_bf16(v)
            else:
                k = k.to(q_ptr.dtype.element_ty)
                v = v.to(q_ptr.dtype.element_ty)
        if DOT_F32:  # noqa: SIM108 - a constexpr branch: Triton compiles only one side
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * sm_scale_log2  # [G_PAD, BLOCK_N], log2 units
        if HAS_COUNT:
            lc = tl.load(lc_ptr + slot * slc_slot + t * slc_t + h * slc_h, mask=valid, other=0.0)
            s = s + lc[None, :] * 1.4426950408889634
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        # per-entry log-sum-exp, for the block attention mass
        pe = tl.sum(tl.reshape(p, (G_PAD, SLOTS_PER_IT, C)), axis=2)  # [G_PAD, SLOTS_PER_IT]
        ent = tl.where(pe > 0, tl.math.log2(tl.maximum(pe, 1e-30)) + m_use[:, None], float("-inf")) * 0.6931471805599453
        oe = e0 + tl.arange(0, SLOTS_PER_IT)
        ment = mg[:, None] & (oe < e_end)[None, :]
        tl.store(ent_ptr + (seq * E + oe[None, :]) * Hq + qh[:, None], ent, mask=ment)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    row = (split * S + seq) * Hq + qh
    tl.store(o_ptr + row[:, None] * D + od[None, :], o, mask=mg[:, None] & md[None, :])
    tl.store(lse_ptr + row, lse, mask=mg)


def _strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else tuple(t.stride()[:3])  # type: ignore[return-value]


def default_splits(s: int, h: int, entries: int, slots_per_it: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about 4 times over (split-K), each with >= 2 iterations."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = triton.cdiv(4 * sms, max(1, s * h))
    return max(1, min(want, triton.cdiv(entries, 2 * slots_per_it)))


def plan_splits(q: torch.Tensor, seg: KVSegment, num_splits: int | None) -> int:
    c = seg.store.slot_tokens
    return num_splits or default_splits(
        q.shape[0], seg.store.num_kv_heads, seg.slot_table.shape[1], max(1, 64 // c), q.device
    )


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
    for name, t in (("k_data", st.k_data), ("v_data", st.v_data), ("q", q)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    slots_per_it = max(1, 64 // c)
    # whole iterations per split, so SLOTS_PER_IT groups never straddle a split boundary
    e_per_split = triton.cdiv(triton.cdiv(max(e, 1), splits), slots_per_it) * slots_per_it
    dev = q.device
    # every entry lies in exactly one split's range and is written there: no fill needed
    ent = torch.empty((s, e, hq), device=dev, dtype=torch.float32)
    tab = seg.slot_table.to(device=dev, dtype=torch.int32).contiguous()
    ntok = seg.slot_tokens.to(device=dev, dtype=torch.int32).contiguous()
    # fp32 queries (tests) go through tf32 dots on the GPU: about 1e-3 relative error
    q_ = q
    quant = st.fmt.quant
    per = VALUES_PER_BYTE.get(quant, 1)
    g = hq // h
    dummy = st.k_data
    lc = st.log_count
    _decode_kernel[(s, h, splits)](
        q_, *q_.stride()[:2],
        st.k_data, *st.k_data.stride()[:3],
        st.v_data, *st.v_data.stride()[:3],
        st.k_scale if st.k_scale is not None else dummy, st.k_zero if st.k_zero is not None else dummy,
        *_strides3(st.k_scale),
        st.v_scale if st.v_scale is not None else dummy, st.v_zero if st.v_zero is not None else dummy,
        *_strides3(st.v_scale),
        lc if lc is not None else dummy, *_strides3(lc),
        tab, ntok, o, lse, ent,
        s, e, hq, e_per_split, sm_scale * LOG2E,
        QUANT=QUANT_CODE[quant], HAS_COUNT=lc is not None, GROUP=st.group_size,
        BITS=8 // per if per > 1 else 8, PER=per, G=g, G_PAD=_p2(g, 16), D=d,
        BLOCK_D=_p2(d, 16), C=c, SLOTS_PER_IT=slots_per_it, DOT_F32=INTERPRET, EG=min(st.group_size, c),
    )  # fmt: skip
    return ent


@triton.jit
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
