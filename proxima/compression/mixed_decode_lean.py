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
with the centred codes (k + 1/2 for small integers k: exact in float16) and multiplies the
[heads, tokens] scores by s_t; the probabilities times s_t go into a second accumulator kept in
the rotated basis, turned back once at the end. Per block: the same two float16 dot products as
any other format (`mixed_slots.py`'s style: codes by the e4m3 convert, scales on score and
probability columns), no D x D work.

The lean blocks keep a softmax state of their own (max, sum, rotated output), live only in the
kernel's pass over compressed blocks and merged into the plain state at its end, as two splits
are: the plain steps stay exactly what they were instead of rescaling a second accumulator.

H is made in registers from the bit parity of (i & j) and R's first column (sign / sqrt(D)) is
the only thing of the rotation read from memory (`mixed_decode_pools.lean_rotation_column`, its
address in the lean code's descriptor row). q R = ((q * col) @ H) and acc R^T = (acc @ H) * col.
"""

from __future__ import annotations

import triton
import triton.language as tl

from proxima.compression.mixed_decode_pools import _desc
from proxima.compression.mixed_slots import _dot_qk, _small_codes


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
def rotate_query(q, rot_addr, sm_scale_log2, od, md, BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    """q R for the query rows q [G_PAD, BLOCK_D] as loaded (the query passed, not a float32 copy:
    that would stay live through the kernel's pass over vLLM's pages; `rot_addr`: R's first column, a descriptor
    field), as the compressed slots take the query (`mixed_decode`'s q16): scaled by a power of two
    into [-1, 1] and rounded to float16, with the factor that undoes it times the softmax scale."""
    col = tl.load(rot_addr.to(tl.pointer_type(tl.float32), bitcast=True) + od, mask=md, other=0.0)
    qr = _times_hadamard(q.to(tl.float32) * col[None, :], BLOCK_D, DOT)
    qmax = tl.max(tl.max(tl.abs(qr), axis=1), axis=0)
    qn = tl.where(qmax > 0, tl.math.exp2(tl.math.ceil(tl.math.log2(tl.maximum(qmax, 1e-30)))), 1.0)
    return (qr * (1.0 / qn)).to(tl.float16), sm_scale_log2 * qn


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
def lean_block(ent_ptr, desc_ptr, h, trow, NB, code, j, seq_len, q, qr16, lean_scale, sm_scale_log2, ot, od, md,
               BS: tl.constexpr, DOT: tl.constexpr, DOT_16BIT: tl.constexpr):  # fmt: skip
    """Logical block `j` of the row, a lean slot of format `code`, read as `mixed_slots._slot_tile`
    reads the other formats' tiles. Returns its scores [G_PAD, BS] (log2 units, the key mean's term
    and the centroids' log count added, -inf where no token is), its centred value codes [BS, BLOCK_D] float16 (rotated
    basis; 0 where no token is) and the value scale of each probability column. q: the query
    (as loaded, for the key mean's term); qr16 / lean_scale: `rotate_query`'s."""
    seen = tl.minimum(seq_len - j * BS, BS)
    sid = tl.load(ent_ptr + (trow * NB + j) * 2 + 1).to(tl.int64)
    tokens = _desc(desc_ptr, code, 1)
    # as `_slot_tile`: a quantized slot keeps token order (clipped like a page), a reduced one
    # (cluster(R)+int4h) is all or nothing
    ntok = tl.where(_desc(desc_ptr, code, 2) != 0, tl.where(seen == BS, tokens, 0), tl.minimum(seen, tokens))
    valid = ot < ntok
    vm = valid[:, None] & md[None, :]
    row_off = sid * _desc(desc_ptr, code, 4) + h * _desc(desc_ptr, code, 6) + ot * _desc(desc_ptr, code, 5)
    kb = _desc(desc_ptr, code, 22).to(tl.pointer_type(tl.uint8), bitcast=True) + row_off
    vb = _desc(desc_ptr, code, 7).to(tl.pointer_type(tl.uint8), bitcast=True) + row_off
    # codes come as code * 2^-9 (the e4m3 convert); * 512 - HALF is exact in float16. Rows without a
    # token (any bytes) are zeroed: their scale columns are 0 too, and no NaN can enter a product.
    if _desc(desc_ptr, code, 0) == 5:  # int4h: 2 codes a byte, HALF 7.5
        kc = tl.where(vm, _small_codes(kb, od, vm, 2) * 512.0 - 7.5, 0.0).to(tl.float16)
        v16 = tl.where(vm, _small_codes(vb, od, vm, 2) * 512.0 - 7.5, 0.0).to(tl.float16)
    else:  # int2h: 4 codes a byte, HALF 1.5
        kc = tl.where(vm, _small_codes(kb, od, vm, 4) * 512.0 - 1.5, 0.0).to(tl.float16)
        v16 = tl.where(vm, _small_codes(vb, od, vm, 4) * 512.0 - 1.5, 0.0).to(tl.float16)
    ks_p = _desc(desc_ptr, code, 8).to(tl.pointer_type(tl.float16), bitcast=True)
    vs_p = _desc(desc_ptr, code, 10).to(tl.pointer_type(tl.float16), bitcast=True)
    kz_p = _desc(desc_ptr, code, 9).to(tl.pointer_type(tl.float16), bitcast=True)
    ks_row = sid * _desc(desc_ptr, code, 13) + h * _desc(desc_ptr, code, 15) + ot * _desc(desc_ptr, code, 14)
    vs_row = sid * _desc(desc_ptr, code, 16) + h * _desc(desc_ptr, code, 18) + ot * _desc(desc_ptr, code, 17)
    ksc = tl.load(ks_p + ks_row, mask=valid, other=0.0).to(tl.float32)
    vcol = tl.load(vs_p + vs_row, mask=valid, other=0.0).to(tl.float32)
    kz_row = sid * _desc(desc_ptr, code, 23) + h * _desc(desc_ptr, code, 24)
    kz = tl.load(kz_p + kz_row + od, mask=md, other=0.0).to(tl.float32)
    qz = tl.sum(q.to(tl.float32) * kz[None, :], axis=1)  # q . z: one term per query head for the whole block
    s = _dot_qk(qr16, kc, DOT, DOT_16BIT) * (ksc * lean_scale)[None, :] + (qz * sm_scale_log2)[:, None]
    lc_addr = _desc(desc_ptr, code, 12)
    if lc_addr != 0:  # centroids (cluster(R)+int4h): log(count) on each logit
        lc_p = lc_addr.to(tl.pointer_type(tl.float32), bitcast=True)
        bias = tl.load(
            lc_p + sid * _desc(desc_ptr, code, 19) + ot * _desc(desc_ptr, code, 20) + h * _desc(desc_ptr, code, 21),
            mask=valid,
            other=0.0,
        )
        s = s + (bias * 1.4426950408889634)[None, :]
    s = tl.where(valid[None, :], s, float("-inf"))
    return s, v16, vcol
