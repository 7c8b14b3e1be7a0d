"""Triton kernels for every compression op; semantics are those of `reference.py`, step for step.

Importing this module imports triton. On CPU the kernels run under the interpreter
(TRITON_INTERPRET=1 set before triton is imported), which the tests use; on CUDA they compile.
Offsets that can exceed 2^31 (slot * slot stride on a many-GB pool) are computed in int64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from proxima.compression.spec import FP8_E4M3_MAX, INT8_MAX, QUANT_CODE, VALUES_PER_BYTE

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Kernels that work around interpreter-only bugs check this (it is read once, like triton does)."""


def _p2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


# ============================================================================================
# quantize


@triton.jit
def _round_to_e4m3(y):
    """Round float32 y (|y| <= 448) to the nearest float8 e4m3 value, ties to even, in fp32.

    The cast that follows is then exact. Rounding by hand matters because Triton's interpreter
    (3.9) mis-rounds fp32 -> fp8 when the mantissa carries into the exponent (124.3 -> 64), and it
    costs nothing measurable in a memory-bound kernel. Normal range: keep 3 mantissa bits by an
    integer add of half an ulp (+1 if the kept lsb is odd); subnormals (|y| < 2^-6) sit on a
    fixed 2^-9 grid, rounded half to even as well (z = y * 2^9 is exact; a tie that floor(z + 0.5)
    rounded to an odd integer goes one down), keeping the sign of zero, so the codes equal torch's
    bit for bit.
    """
    bits = y.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = r.to(tl.float32, bitcast=True)
    z = y * 512.0
    t = tl.floor(z + 0.5)
    t = tl.where((t - z == 0.5) & (t - 2.0 * tl.floor(t * 0.5) != 0.0), t - 1.0, t)
    sub = tl.where(y < 0, -tl.abs(t), t) / 512.0  # a negative value that rounds to zero is -0, as in torch
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


@triton.jit
def _round_to_bf16(x):
    """Round float32 to the nearest bfloat16, ties to even, so the cast after it is exact (the
    interpreter's fp32 -> bf16 cast truncates; the GPU's rounds, and this matches both)."""
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(
    x_ptr,  # [N, T, H, D] source keys or values (any float dtype, any strides)
    d_ptr,  # [N, T, H, P] output codes (P = D / values per byte), contiguous
    s_ptr,  # scale: [N, T, H] (fp8/int8) | keys [N, Gk, H, D] | values [N, T, H, D/G], contiguous
    z_ptr,  # zero point, same layout as scale (sub-byte formats only)
    T,  # tokens per block
    H,  # KV heads
    sx_n,
    sx_t,
    sx_h,
    sx_d,  # strides of x
    QUANT: tl.constexpr,  # spec.QUANT_CODE: 1 fp8, 2 int8, 3 int4, 4 int2
    IS_KEY: tl.constexpr,  # sub-byte keys group along tokens (KIVI), values along channels
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program; == GROUP for sub-byte keys
    BLOCK_D: tl.constexpr,  # next power of two >= D
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,  # values per byte (1 for fp8/int8)
    QMAX: tl.constexpr,  # 448 (fp8) or 127 (int8)
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    tb = tl.program_id(2)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mt = offs_t < T
    md = offs_d < D
    m2 = mt[:, None] & md[None, :]
    x = tl.load(
        x_ptr + n * sx_n + offs_t[:, None].to(tl.int64) * sx_t + h * sx_h + offs_d[None, :] * sx_d,
        mask=m2,
        other=0.0,
    ).to(tl.float32)
    P: tl.constexpr = D // PER
    if QUANT == 1 or (QUANT == 2 and not IS_KEY):
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)
        # one division per row, a multiply per element (per-element IEEE division: int8 compress
        # at 28% of copy bandwidth on the H200, run 1); reference.py does the same two steps
        y = x * tl.math.div_rn(tl.full((BLOCK_T,), 1.0, tl.float32), scale)[:, None]
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        d_off = ((n * T + offs_t[:, None]) * H + h) * P + offs_d[None, :]
        if QUANT == 1:
            tl.store(d_ptr + d_off, _round_to_e4m3(y).to(tl.float8e4nv), mask=m2)
        else:
            tl.store(d_ptr + d_off, tl.floor(y + 0.5).to(tl.int8), mask=m2)
        tl.store(s_ptr + (n * T + offs_t) * H + h, scale, mask=mt)
    else:
        LEVELS: tl.constexpr = (1 << BITS) - 1
        if IS_KEY:
            # one token group per program: min/max per channel over the group's tokens
            lo = tl.min(tl.where(m2, x, float("inf")), axis=0)
            hi = tl.max(tl.where(m2, x, float("-inf")), axis=0)
            lo = tl.where(md, lo, 0.0)
            hi = tl.where(md, hi, 0.0)
            rng = hi - lo
            scale = tl.where(rng > 0, tl.math.div_rn(rng, LEVELS * 1.0), 1.0).to(tl.float16)
            zero = lo.to(tl.float16)
            inv = tl.math.div_rn(tl.full((BLOCK_D,), 1.0, tl.float32), scale.to(tl.float32))
            codes = tl.floor((x - zero.to(tl.float32)[None, :]) * inv[None, :] + 0.5)
            GK = (T + GROUP - 1) // GROUP
            m_off = ((n * GK + tb) * H + h) * D + offs_d
            tl.store(s_ptr + m_off, scale, mask=md)
            tl.store(z_ptr + m_off, zero, mask=md)
        else:
            NG: tl.constexpr = BLOCK_D // GROUP
            x3 = tl.reshape(x, (BLOCK_T, NG, GROUP))
            lo = tl.min(x3, axis=2)
            hi = tl.max(x3, axis=2)
            rng = hi - lo
            scale = tl.where(rng > 0, tl.math.div_rn(rng, LEVELS * 1.0), 1.0).to(tl.float16)
            zero = lo.to(tl.float16)
            inv = tl.math.div_rn(tl.full((BLOCK_T, NG), 1.0, tl.float32), scale.to(tl.float32))
            c3 = tl.floor((x3 - zero.to(tl.float32)[:, :, None]) * inv[:, :, None] + 0.5)
            codes = tl.reshape(c3, (BLOCK_T, BLOCK_D))
            offs_g = tl.arange(0, NG)
            DG: tl.constexpr = D // GROUP
            mg = mt[:, None] & (offs_g[None, :] < DG)
            m_off = ((n * T + offs_t[:, None]) * H + h) * DG + offs_g[None, :]
            tl.store(s_ptr + m_off, scale, mask=mg)
            tl.store(z_ptr + m_off, zero, mask=mg)
        codes = tl.minimum(tl.maximum(codes, 0.0), LEVELS * 1.0).to(tl.int32)
        # pack PER codes per byte: fields do not overlap, so a weighted sum is a bitwise or
        BP: tl.constexpr = BLOCK_D // PER
        c3 = tl.reshape(codes, (BLOCK_T, BP, PER))
        shift = tl.arange(0, PER) * BITS
        packed = tl.sum(c3 << shift[None, None, :], axis=2)
        offs_p = tl.arange(0, BP)
        mp = mt[:, None] & (offs_p[None, :] < P)
        d_off = ((n * T + offs_t[:, None]) * H + h) * P + offs_p[None, :]
        tl.store(d_ptr + d_off, packed.to(tl.uint8), mask=mp)


def quantize(
    x: torch.Tensor, quant: str, group: int, *, is_key: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [N, T, H, D] -> (data [N, T, H, P], scale, zero | None); layouts as in reference.py."""
    n, t, h, d = x.shape
    dev = x.device
    per = VALUES_PER_BYTE.get(quant, 1)
    code = QUANT_CODE[quant]
    zero: torch.Tensor | None
    kivi = quant in ("int4", "int2") or (quant == "int8" and is_key)
    bits = 8 // per
    if not kivi:
        data = torch.empty(n, t, h, d, device=dev, dtype=torch.float8_e4m3fn if quant == "fp8" else torch.int8)
        scale = torch.empty(n, t, h, device=dev, dtype=torch.float32)
        zero = None
        # 32 tokens x D per program: measured on the H200 (see bench/results) as enough to fill HBM.
        block_t = min(32, _p2(t))
    else:
        data = torch.empty(n, t, h, d // per, device=dev, dtype=torch.uint8)
        if is_key:
            gk = -(-t // group)
            scale = torch.empty(n, gk, h, d, device=dev, dtype=torch.float16)
            block_t = group
        else:
            scale = torch.empty(n, t, h, d // group, device=dev, dtype=torch.float16)
            block_t = min(32, _p2(t))
        zero = torch.empty_like(scale)
    if n == 0:
        return data, scale, zero
    grid = (n, h, triton.cdiv(t, block_t))
    _quantize_kernel[grid](
        x, data, scale, zero if zero is not None else scale,
        t, h, *x.stride(),
        QUANT=code, IS_KEY=is_key, D=d, BLOCK_T=block_t, BLOCK_D=_p2(d, 16),
        GROUP=group, BITS=bits, PER=per,
        QMAX=FP8_E4M3_MAX if quant == "fp8" else INT8_MAX,
    )  # fmt: skip
    return data, scale, zero


# ============================================================================================
# dequantize


@triton.jit
def _load_dequant(
    d_ptr,
    s_ptr,
    z_ptr,  # codes and their metadata (layouts as in _quantize_kernel)
    slot,
    t,
    h,
    d,  # int64 slot id [R] or scalar, token [R], head (scalar), channel [C]
    mask,  # [R, C]
    sd_slot,
    sd_t,
    sd_h,  # strides of the code tensor (last dim contiguous)
    ss_slot,
    ss_t,
    ss_h,  # strides of the scale/zero tensors (last dim contiguous)
    QUANT: tl.constexpr,
    IS_KEY: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
):
    """Dequantized float32 tile [R, C] for rows (slot, t) and channels d of head h."""
    base = slot * sd_slot + t.to(tl.int64) * sd_t + h * sd_h  # [R]
    if QUANT == 0:
        return tl.load(d_ptr + base[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    elif QUANT == 1 or (QUANT == 2 and not IS_KEY):
        # no `other`: it cannot be cast to fp8; masked lanes are zeroed below instead (garbage
        # there could be NaN, and 0 * NaN in the attention's P @ V would poison the row)
        raw = tl.load(d_ptr + base[:, None] + d[None, :], mask=mask).to(tl.float32)
        # callers pass in-range (slot, t) for every row, masked rows included, so no mask is needed
        sc = tl.load(s_ptr + slot * ss_slot + t * ss_t + h * ss_h)
        return tl.where(mask, raw * sc[:, None], 0.0)
    else:
        byte = tl.load(d_ptr + base[:, None] + (d // PER)[None, :], mask=mask, other=0).to(tl.int32)
        code = ((byte >> ((d % PER) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        if IS_KEY:
            m_off = slot * ss_slot + (t // GROUP) * ss_t + h * ss_h
            m_off2 = m_off[:, None] + d[None, :]
        else:
            m_off = slot * ss_slot + t * ss_t + h * ss_h
            m_off2 = m_off[:, None] + (d // GROUP)[None, :]
        sc = tl.load(s_ptr + m_off2, mask=mask, other=1.0).to(tl.float32)
        zp = tl.load(z_ptr + m_off2, mask=mask, other=0.0).to(tl.float32)
        return code * sc + zp


@triton.jit
def _dequantize_kernel(
    d_ptr,
    s_ptr,
    z_ptr,  # codes [N, T, H, P] and metadata (contiguous)
    o_ptr,  # [N, T, H, D] output, contiguous
    T,
    H,
    sd_slot,
    sd_t,
    sd_h,  # code strides
    ss_slot,
    ss_t,
    ss_h,  # metadata strides
    QUANT: tl.constexpr,
    IS_KEY: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # output is bf16: round to nearest even before the cast
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    t_safe = tl.where(offs_t < T, offs_t, 0)
    x = _load_dequant(
        d_ptr, s_ptr, z_ptr, n, t_safe, h, offs_d, mask,
        sd_slot, sd_t, sd_h, ss_slot, ss_t, ss_h, QUANT, IS_KEY, GROUP, BITS, PER,
    )  # fmt: skip
    o_off = ((n * T + offs_t[:, None]) * H + h) * D + offs_d[None, :]
    if ROUND_BF16:
        x = _round_to_bf16(x)
    tl.store(o_ptr + o_off, x.to(o_ptr.dtype.element_ty), mask=mask)


def _meta_strides(scale: torch.Tensor | None) -> tuple[int, int, int]:
    if scale is None:
        return (0, 0, 0)
    return tuple(scale.stride()[:3])  # type: ignore[return-value]


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    quant: str,
    group: int,
    head_dim: int,
    is_key: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """data [N, T, H, P] + metadata -> [N, T, H, D] in out_dtype."""
    n, t, h, _ = data.shape
    out = torch.empty(n, t, h, head_dim, device=data.device, dtype=out_dtype)
    if n == 0 or t == 0:
        return out
    per = VALUES_PER_BYTE.get(quant, 1)
    block_t = min(32, _p2(t))
    s = scale if scale is not None else data
    _dequantize_kernel[(n, h, triton.cdiv(t, block_t))](
        data, s, zero if zero is not None else s, out, t, h,
        *data.stride()[:3], *_meta_strides(scale),
        QUANT=QUANT_CODE[quant], IS_KEY=is_key, GROUP=group, BITS=8 // per if per > 1 else 8,
        PER=per, D=head_dim, BLOCK_T=block_t, BLOCK_D=_p2(head_dim, 16),
        ROUND_BF16=out_dtype == torch.bfloat16,
    )  # fmt: skip
    return out


# ============================================================================================
# token ranks, sparsify, cluster


@triton.jit
def _ranks(imp_ptr, prot_ptr, n, h, T, H, HAS_PROT: tl.constexpr, BLOCK_T: tl.constexpr, ROW: tl.constexpr):
    """Rank of each token of (block n, head h); ROW picks the layout of the result ([T] as rows
    (axis 0) or as columns). Same total order as reference.token_ranks."""
    oi = tl.arange(0, BLOCK_T)
    mi = oi < T
    s = tl.load(imp_ptr + (n * T + oi) * H + h, mask=mi, other=float("-inf")).to(tl.float32)
    if HAS_PROT:
        p = tl.load(prot_ptr + n * T + oi, mask=mi, other=0)
        s = tl.where(p != 0, float("inf"), s)
    si = s[:, None]
    sj = s[None, :]
    ii = oi[:, None]
    jj = oi[None, :]
    before = ((sj > si) | ((sj == si) & (jj < ii))) & (jj < T)
    if ROW:
        return tl.sum(before.to(tl.int32), axis=1)
    else:
        # the same relation transposed: rank of token j = sum over i of (i before j)
        before_t = ((si > sj) | ((si == sj) & (ii < jj))) & (ii < T)
        return tl.sum(before_t.to(tl.int32), axis=0)


@triton.jit
def _sparsify_kernel(
    k_ptr,
    v_ptr,  # [N, T, H, D] source, contiguous
    imp_ptr,  # [N, T, H] importance, contiguous
    prot_ptr,  # [N, T] uint8 protected flags, contiguous (unused without HAS_PROT)
    ko_ptr,
    vo_ptr,  # [N, C, H, D] kept tokens, contiguous
    idx_ptr,  # [N, C, H] int32 source token of each kept token
    T,
    H,
    C,
    HAS_PROT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rank = _ranks(imp_ptr, prot_ptr, n, h, T, H, HAS_PROT, BLOCK_T, True)
    oi = tl.arange(0, BLOCK_T)
    kept = (rank < C) & (oi < T)
    pos = tl.cumsum(kept.to(tl.int32), axis=0) - 1
    tl.store(idx_ptr + (n * C + pos) * H + h, oi, mask=kept)
    for d0 in range(0, D, BLOCK_D):
        od = d0 + tl.arange(0, BLOCK_D)
        m = kept[:, None] & (od < D)[None, :]
        src = ((n * T + oi[:, None]) * H + h) * D + od[None, :]
        dst = ((n * C + pos[:, None]) * H + h) * D + od[None, :]
        tl.store(ko_ptr + dst, tl.load(k_ptr + src, mask=m), mask=m)
        tl.store(vo_ptr + dst, tl.load(v_ptr + src, mask=m), mask=m)


def sparsify(
    k: torch.Tensor, v: torch.Tensor, importance: torch.Tensor, protected: torch.Tensor | None, keep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, t, h, d = k.shape
    k, v = k.contiguous(), v.contiguous()
    imp = importance.float().contiguous()
    ko = torch.empty(n, keep, h, d, device=k.device, dtype=k.dtype)
    vo = torch.empty_like(ko)
    idx = torch.empty(n, keep, h, device=k.device, dtype=torch.int32)
    prot = protected.to(torch.uint8).contiguous() if protected is not None else imp
    if n:
        _sparsify_kernel[(n, h)](
            k, v, imp, prot, ko, vo, idx, t, h, keep,
            HAS_PROT=protected is not None, D=d, BLOCK_T=_p2(t, 16), BLOCK_D=min(64, _p2(d, 16)),
        )  # fmt: skip
    return ko, vo, idx


@triton.jit
def _cluster_kernel(
    k_ptr,
    v_ptr,  # [N, T, H, D] source, contiguous
    w_ptr,  # [N, T, H] float32 weights > 0
    imp_ptr,  # [N, T, H] importance for the seed ranks (same as w up to the clamp)
    prot_ptr,  # [N, T] uint8 protected flags
    ko_ptr,
    vo_ptr,  # [N, C, H, D] float32 centroids and value means, contiguous
    lc_ptr,  # [N, C, H] float32 log(count)
    T,
    H,
    C,
    ITERS: tl.constexpr,
    HAS_PROT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ot = tl.arange(0, BLOCK_T)
    od = tl.arange(0, BLOCK_D)
    oc = tl.arange(0, BLOCK_C)
    mt = ot < T
    md = od < D
    m2 = mt[:, None] & md[None, :]
    src = ((n * T + ot[:, None]) * H + h) * D + od[None, :]
    K = tl.load(k_ptr + src, mask=m2, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + (n * T + ot) * H + h, mask=mt, other=0.0)
    rank = _ranks(imp_ptr, prot_ptr, n, h, T, H, HAS_PROT, BLOCK_T, False)  # [BLOCK_T] as columns
    # seeds as reference.seed_tokens: best rank first, then weighted farthest point
    chosen = ot < 0
    mind = tl.full((BLOCK_T,), float("inf"), tl.float32)
    cent = tl.zeros((BLOCK_C, BLOCK_D), tl.float32)
    BIG = BLOCK_T + 1
    for j in range(C):
        by_rank = tl.argmin(tl.where((~chosen) & mt, rank, 2 * BIG + ot), axis=0)
        sc = tl.where((~chosen) & mt, w * mind, -1.0)
        far = tl.argmax(sc, axis=0)
        best = tl.max(sc, axis=0)
        pick = tl.where((j > 0) & (best > 0), far, by_rank)
        chosen = chosen | (ot == pick)
        krow = tl.sum(tl.where((ot == pick)[:, None], K, 0.0), axis=0)  # [BLOCK_D]
        cent = tl.where((oc == j)[:, None], krow[None, :], cent)
        diff = K - krow[None, :]
        mind = tl.minimum(mind, tl.sum(diff * diff, axis=1))
    knorm = tl.sum(K * K, axis=1)
    onehot = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    aw = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    sw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for _ in range(ITERS):
        cn = tl.sum(cent * cent, axis=1)
        kc = tl.dot(K, tl.trans(cent), input_precision="ieee")  # [BLOCK_T, BLOCK_C]
        dist = knorm[:, None] - 2.0 * kc + cn[None, :]
        dist = tl.where((oc < C)[None, :], dist, float("inf"))
        assign = tl.argmin(dist, axis=1)
        onehot = ((assign[:, None] == oc[None, :]) & mt[:, None]).to(tl.float32)
        aw = onehot * w[:, None]
        sw = tl.sum(aw, axis=0)
        new = tl.dot(tl.trans(aw), K, input_precision="ieee") / tl.maximum(sw, 1e-30)[:, None]
        cent = tl.where((sw > 0)[:, None], new, cent)
    V = tl.load(v_ptr + src, mask=m2, other=0.0).to(tl.float32)
    vc = tl.dot(tl.trans(aw), V, input_precision="ieee") / tl.maximum(sw, 1e-30)[:, None]
    count = tl.sum(onehot, axis=0)
    lc = tl.where(count > 0, tl.log(count), float("-inf"))
    mc = oc < C
    dst = ((n * C + oc[:, None]) * H + h) * D + od[None, :]
    mo = mc[:, None] & md[None, :]
    tl.store(ko_ptr + dst, cent, mask=mo)
    tl.store(vo_ptr + dst, vc, mask=mo)
    tl.store(lc_ptr + (n * C + oc) * H + h, lc, mask=mc)


def cluster(
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    protected: torch.Tensor | None,
    n_centroids: int,
    iters: int,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (k_c [N, C, H, D] f32, v_c f32, log_count [N, C, H] f32); see reference.cluster."""
    n, t, h, d = k.shape
    k, v = k.contiguous(), v.contiguous()
    w = weights.float().contiguous()
    imp = w if importance is None else importance.float().contiguous()
    ko = torch.empty(n, n_centroids, h, d, device=k.device, dtype=torch.float32)
    vo = torch.empty_like(ko)
    lc = torch.empty(n, n_centroids, h, device=k.device, dtype=torch.float32)
    prot = protected.to(torch.uint8).contiguous() if protected is not None else w
    if n:
        _cluster_kernel[(n, h)](
            k, v, w, imp, prot, ko, vo, lc, t, h, n_centroids,
            ITERS=iters, HAS_PROT=protected is not None, D=d,
            BLOCK_T=_p2(t, 16), BLOCK_D=_p2(d, 16), BLOCK_C=_p2(n_centroids, 16),
            num_warps=8,
        )  # fmt: skip
    return ko, vo, lc
