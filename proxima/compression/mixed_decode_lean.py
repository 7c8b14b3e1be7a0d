"""How the one-pass decode (`mixed_decode.py`) reads lean slots (int4h / int2h, `spec.LEAN_BITS`)
without dequantizing them to the head's basis.

A lean slot stores, per token t and head, codes c_t of the rotated row and one float16 scale s_t;
a key also lost its slot's per-channel mean z (`reference.quantize_lean`):
    k_t = s_t (c_t - HALF) R^T + z,   v_t = s_t (c_t - HALF) R^T,
with R = diag(sign) H / sqrt(D) (`reference.rotation`: Sylvester Hadamard H, one global sign
vector from a constant seed, so the same R in every layer). Hence
    q . k_t = s_t ((q R) . (c_t - HALF)) + q . z
    sum_t p_t v_t = (sum_t (p_t s_t) (c_t - HALF)) R^T.
So the kernel rotates the query once per program (the first time it meets a lean block), dots it
with the raw centred codes (small integers and halves: exact in 16 bits) and multiplies the
[heads, tokens] logits by s_t; the probabilities times s_t go into a second accumulator kept in
the rotated basis, turned back once at the end. Per block: the same two dot products as any other
format, no D x D work, and no per-element scale multiply on either side.

The lean blocks keep a softmax state of their own (max, sum, rotated output) and it is merged into
the plain state at the end, as two splits are: the plain steps (vLLM's pages above all) then stay
exactly what they were, instead of rescaling a second accumulator at every step.

H is made in registers from the bit parity of (i & j) and R's first column (sign / sqrt(D)) is
the only thing of the rotation read from memory (`mixed_decode_pools.lean_rotation_column`, its
address in the lean code's descriptor row). q R = ((q * col) @ H) and acc R^T = (acc @ H) * col.
"""

from __future__ import annotations

import triton
import triton.language as tl

from proxima.compression.mixed_decode_pools import _desc


@triton.jit
def _hadamard(BLOCK_D: tl.constexpr):
    """[BLOCK_D, BLOCK_D] float32 Sylvester Hadamard (+-1, unnormalised): H[i, j] = (-1)^popcount(i & j)."""
    od = tl.arange(0, BLOCK_D)
    x = od[:, None] & od[None, :]
    x = x ^ (x >> 8)  # fold the parity of up to 16 bits into bit 0 (head dims up to 65536)
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return 1.0 - 2.0 * (x & 1).to(tl.float32)


@triton.jit
def _times_hadamard(x, BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    """x [M, BLOCK_D] float32 @ H. With DOT (M >= 16) on tensor cores: x in fp32 operands (tf32 on
    a GPU: 10 bits of mantissa, an error below the 16-bit dot that follows), H exact."""
    hm = _hadamard(BLOCK_D)
    if DOT:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        y = tl.dot(x, hm)
    else:
        y = tl.sum(x[:, :, None] * hm[None, :, :], axis=1)
    return y


@triton.jit
def rotate_query(q, rot_addr, od, md, BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    """q R for q [G_PAD, BLOCK_D] float32; `rot_addr`: R's first column (a descriptor field)."""
    col = tl.load(rot_addr.to(tl.pointer_type(tl.float32), bitcast=True) + od, mask=md, other=0.0)
    return _times_hadamard(q * col[None, :], BLOCK_D, DOT)


@triton.jit
def merge_rotated(m_i, l_i, acc, m_r, l_r, acc_r, rot_addr, od, md, BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    """The lean blocks' state (m_r, l_r, acc_r in the rotated basis) merged into the plain one:
    acc_r R^T, then the two partial softmax states combined (log2 units, as `_softmax_step`)."""
    col = tl.load(rot_addr.to(tl.pointer_type(tl.float32), bitcast=True) + od, mask=md, other=0.0)
    back = _times_hadamard(acc_r, BLOCK_D, DOT) * col[None, :]
    m = tl.maximum(m_i, m_r)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    a_i = tl.math.exp2(m_i - m_use)  # an empty state (max -inf) weighs 0
    a_r = tl.math.exp2(m_r - m_use)
    return m, l_i * a_i + l_r * a_r, acc * a_i[:, None] + back * a_r[:, None]


@triton.jit
def lean_step(ent_ptr, desc_ptr, h, trow, NB, code, j, seq_len, ot, od, md, q, qr, m_r, l_r, acc_r, sm_scale_log2,
              q_ptr, BS: tl.constexpr, DOT: tl.constexpr, DOT_16BIT: tl.constexpr):  # fmt: skip
    """Logical block `j` of the row, a lean slot of format `code`, into the lean softmax state.
    q [G_PAD, BLOCK_D] the query (for the key mean's term), qr = q R. Returns the new state and the
    block's probabilities relative to `m_use` (log2 units), for the observed layer's block sums."""
    seen = tl.minimum(seq_len - j * BS, BS)
    sid = tl.load(ent_ptr + (trow * NB + j) * 2 + 1).to(tl.int64)
    tokens = _desc(desc_ptr, code, 1)
    # as `_load_slot_block`: a quantized slot keeps token order (clipped like a page), a reduced one
    # (cluster(R)+int4h) is all or nothing
    ntok = tl.where(_desc(desc_ptr, code, 2) != 0, tl.where(seen == BS, tokens, 0), tl.minimum(seen, tokens))
    valid = ot < ntok
    vm = valid[:, None] & md[None, :]
    per = tl.where(_desc(desc_ptr, code, 0) == 5, 2, 4)  # int4h (QUANT_CODE 5): 2 codes a byte, int2h 4
    bits = 8 // per
    half = ((1 << bits) - 1) * 0.5
    shift = ((od % per) * bits).to(tl.uint8)
    cmask = ((1 << bits) - 1).to(tl.uint8)
    row_off = (sid * _desc(desc_ptr, code, 4) + h * _desc(desc_ptr, code, 6)) + ot[:, None] * _desc(desc_ptr, code, 5)
    kb = _desc(desc_ptr, code, 22).to(tl.pointer_type(tl.uint8), bitcast=True) + row_off
    vb = _desc(desc_ptr, code, 7).to(tl.pointer_type(tl.uint8), bitcast=True) + row_off
    # padding rows may hold any bytes: their codes are masked to 0 (finite) and their scales to 0
    kc = ((tl.load(kb + (od // per)[None, :], mask=vm, other=0) >> shift[None, :]) & cmask).to(tl.float32) - half
    vc = ((tl.load(vb + (od // per)[None, :], mask=vm, other=0) >> shift[None, :]) & cmask).to(tl.float32) - half
    kc = tl.where(vm, kc, 0.0)
    vc = tl.where(vm, vc, 0.0)
    ks_p = _desc(desc_ptr, code, 8).to(tl.pointer_type(tl.float16), bitcast=True)
    vs_p = _desc(desc_ptr, code, 10).to(tl.pointer_type(tl.float16), bitcast=True)
    kz_p = _desc(desc_ptr, code, 9).to(tl.pointer_type(tl.float16), bitcast=True)
    ks_row = sid * _desc(desc_ptr, code, 13) + h * _desc(desc_ptr, code, 15) + ot * _desc(desc_ptr, code, 14)
    vs_row = sid * _desc(desc_ptr, code, 16) + h * _desc(desc_ptr, code, 18) + ot * _desc(desc_ptr, code, 17)
    ksc = tl.load(ks_p + ks_row, mask=valid, other=0.0).to(tl.float32)
    vsc = tl.load(vs_p + vs_row, mask=valid, other=0.0).to(tl.float32)
    kz_row = sid * _desc(desc_ptr, code, 23) + h * _desc(desc_ptr, code, 24)
    kz = tl.load(kz_p + kz_row + od, mask=md, other=0.0).to(tl.float32)
    bias = tl.zeros((BS,), tl.float32)
    lc_addr = _desc(desc_ptr, code, 12)
    if lc_addr != 0:  # centroids (cluster(R)+int4h): log(count) on each logit
        lc_p = lc_addr.to(tl.pointer_type(tl.float32), bitcast=True)
        bias = tl.load(
            lc_p + sid * _desc(desc_ptr, code, 19) + ot * _desc(desc_ptr, code, 20) + h * _desc(desc_ptr, code, 21),
            mask=valid,
            other=0.0,
        )
    qz = tl.sum(q * kz[None, :], axis=1)  # q . z: one term per query head for the whole block
    if DOT:
        if DOT_16BIT:  # centred codes are exact in 16 bits; q R rounds as any 16-bit query does
            qk = tl.dot(qr.to(q_ptr.dtype.element_ty), tl.trans(kc.to(q_ptr.dtype.element_ty)))
        else:
            qk = tl.dot(qr, tl.trans(kc))
    else:
        qk = tl.sum(qr[:, None, :] * kc[None, :, :], axis=2)
    s = (qk * ksc[None, :] + qz[:, None]) * sm_scale_log2 + (bias * 1.4426950408889634)[None, :]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_r, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_r - m_use)
    l_r = l_r * alpha + tl.sum(p, axis=1)
    ps = p * vsc[None, :]  # the value scales folded into the probabilities: [heads, tokens], not [tokens, D]
    if DOT:
        if DOT_16BIT:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
            pv = tl.dot(ps.to(q_ptr.dtype.element_ty), vc.to(q_ptr.dtype.element_ty))
        else:
            pv = tl.dot(ps, vc)
    else:
        pv = tl.sum(ps[:, :, None] * vc[None, :, :], axis=1)
    acc_r = acc_r * alpha[:, None] + pv
    return m_new, l_r, acc_r, p, m_use
