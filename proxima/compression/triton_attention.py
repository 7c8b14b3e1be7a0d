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

from proxima.compression.attention import KVSegment
from proxima.compression.spec import QUANT_CODE, VALUES_PER_BYTE
from proxima.compression.triton_ops import INTERPRET, _load_dequant, _p2, _round_to_bf16

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


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
            k = _load_dequant(
                k_ptr, ks_ptr, kz_ptr, slot, t, h, od, m2, sk_slot, sk_t, sk_h,
                sks_slot, sks_t, sks_h, QUANT, True, GROUP, BITS, PER,
            )  # fmt: skip
            v = _load_dequant(
                v_ptr, vs_ptr, vz_ptr, slot, t, h, od, m2, sv_slot, sv_t, sv_h,
                svs_slot, svs_t, svs_h, QUANT, False, GROUP, BITS, PER,
            )  # fmt: skip
            # the tensor cores take q's dtype; dequantized values are rounded to it, as the
            # reference does when it decompresses to the cache dtype
            if DOT_F32:
                k = _round_to_bf16(k)
                v = _round_to_bf16(v)
            else:
                k = k.to(q_ptr.dtype.element_ty)
                v = v.to(q_ptr.dtype.element_ty)
        if DOT_F32:
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


def segment_partial(
    q: torch.Tensor, seg: KVSegment, sm_scale: float, num_splits: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [SPLITS, S, Hq, D] f32, lse [SPLITS, S, Hq] f32, entry_lse [S, E, Hq] f32) of one segment."""
    st = seg.store
    s, hq, d = q.shape
    h, c = st.num_kv_heads, st.slot_tokens
    e = seg.slot_table.shape[1]
    if c & (c - 1):
        raise ValueError(f"{st.fmt}: the Triton decode kernel needs a power-of-two slot capacity, got {c}")
    for name, t in (("k_data", st.k_data), ("v_data", st.v_data), ("q", q)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    slots_per_it = max(1, 64 // c)
    splits = num_splits or default_splits(s, h, e, slots_per_it, q.device)
    # whole iterations per split, so SLOTS_PER_IT groups never straddle a split boundary
    e_per_split = triton.cdiv(triton.cdiv(max(e, 1), splits), slots_per_it) * slots_per_it
    dev = q.device
    o = torch.empty(splits, s, hq, d, device=dev, dtype=torch.float32)
    lse = torch.empty(splits, s, hq, device=dev, dtype=torch.float32)
    ent = torch.full((s, e, hq), float("-inf"), device=dev, dtype=torch.float32)
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
        BLOCK_D=_p2(d, 16), C=c, SLOTS_PER_IT=slots_per_it, DOT_F32=INTERPRET,
    )  # fmt: skip
    return o, lse, ent
