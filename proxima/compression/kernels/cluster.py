"""STAR-KV k-means kernel: seeds, Lloyd steps and value means of each (block, head) in one program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from proxima.compression.kernels.common import (
    INTERPRET,
    STEP_TABLE,
    STEP_VARYING,
    _p2,
    _ranks_of,
    _step_slot,
    _to_out,
)
from proxima.compression.reference import PIN_BY


@triton.jit
def _tf32_split(x):
    """x = hi + lo exactly, hi with tf32's 10 mantissa bits (lo carries the rest, |lo| < 2^-10 |x|)."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _dot_f32(a, b, EXACT_A: tl.constexpr, EXACT_B: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b to about float32 accuracy on tensor cores (relative error ~2^-21 against the exact
    product, beside fp32's own 2^-24 per rounding; the reference's summation order differs anyway).

    An operand whose values are tf32 numbers (EXACT: bf16 / fp16 keys and values) needs no split;
    the other is split into tf32 hi + lo, two products instead of tf32x3's three, and, more to
    the point, one register copy of the large key tile in each operand layout instead of two
    (tf32x3 spilled: 255 registers + 1.8 KB of stack a thread, compile-only).
    """
    if EXACT_A and not EXACT_B:
        b_hi, b_lo = _tf32_split(b)
        acc = tl.dot(a, b_lo, input_precision=PRECISION)
        return tl.dot(a, b_hi, acc, input_precision=PRECISION)
    elif EXACT_B and not EXACT_A:
        a_hi, a_lo = _tf32_split(a)
        acc = tl.dot(a_lo, b, input_precision=PRECISION)
        return tl.dot(a_hi, b, acc, input_precision=PRECISION)
    elif EXACT_A and EXACT_B:
        return tl.dot(a, b, input_precision=PRECISION)
    else:
        return tl.dot(a, b, input_precision="ieee" if PRECISION == "ieee" else "tf32x3")


@triton.jit
def _split_bf16(x):
    """float32 x = hi + mid + lo, three bf16 (8 significant bits each: x's 24, exactly)."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    return hi, mid, (r - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _mma16(a, b, acc, INTERPRET_: tl.constexpr):
    """acc + a @ b (acc None: a @ b) of bf16 tiles with float32 sums. The interpreter's bf16 dot is wrong (it read
    the operands as other numbers, 2026-12-02), so there the exact bf16 values go in as float32."""
    if INTERPRET_:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _dot_bf16x3(a, b, A16: tl.constexpr, INTERPRET_: tl.constexpr):
    """a @ b, one operand bf16 (A16: a) and the other float32 split three ways (`_split_bf16`):
    three bf16 MMAs with exact products and float32 sums, smallest parts first. Against
    `_dot_f32`'s tf32 hi + lo it holds the bf16 tile in each operand layout at half the registers
    (the k-means kernel: 192 registers and no spill at 16 centroids, against 255 + 88 B)."""
    if A16:
        hi, mid, lo = _split_bf16(b)
        return _mma16(a, hi, _mma16(a, mid, _mma16(a, lo, None, INTERPRET_), INTERPRET_), INTERPRET_)
    else:
        hi, mid, lo = _split_bf16(a)
        return _mma16(hi, b, _mma16(mid, b, _mma16(lo, b, None, INTERPRET_), INTERPRET_), INTERPRET_)


@triton.jit(do_not_specialize=STEP_VARYING, do_not_specialize_on_alignment=STEP_TABLE)
def _cluster_kernel(
    k_ptr,
    v_ptr,  # [N, T, H, D] source, contiguous
    w_ptr,  # [N, T, H] float32 weights > 0
    imp_ptr,  # [N, T, H] importance for the seed ranks (same as w up to the clamp)
    prot_ptr,  # [N, T] uint8 protected flags
    ko_ptr,
    vo_ptr,  # [N, C, H, D] centroids and value means (float32 or the source dtype), contiguous
    lc_ptr,  # [N, C, H] float32 log(count)
    cnt_ptr,  # [N, T, H] float32 tokens each row stands for (read only with COUNTS)
    tbl_ptr,  # LC_SLOTS: the step table (`common._step_slot`), else unused
    rows_ptr,  # LC_SLOTS with HAS_ROWS: the group's stack rows
    A,  # W_MODE 1 / LC_SLOTS: actions per layer (blocks are layer-major, n = layer * A + action)
    lc_layer,  # LC_SLOTS: strides of the destination side table's log-counts [L, slots, C, H]
    lc_slot,
    T,
    H,
    C,
    P,  # pinned rows (protected tokens kept as they are), 0 <= P < C
    W_MODE: tl.constexpr,  # 0: w_ptr / imp_ptr [N, T, H]; 1: imp_ptr [A, T, H] per action, w = max(imp, 1e-6);
    # 2: from the counts (COUNTS): w = count, rank score 1 (count > 0) or -1 (`compress_blocks`' re-merge)
    LC_SLOTS: tl.constexpr,  # log-counts into the destination slots of the step table, not [N, C, H]
    HAS_ROWS: tl.constexpr,
    ITERS: tl.constexpr,
    HAS_PROT: tl.constexpr,
    HAS_PIN: tl.constexpr,  # P > 0
    PIN_BY: tl.constexpr,  # 0 mixed, 1 outlier, 2 importance (reference.PIN_BY's order)
    COUNTS: tl.constexpr,  # rows are centroids being merged again: a centroid's count sums theirs
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    EXACT16: tl.constexpr,  # k and v are bf16 / fp16, so every element is a tf32 number
    BF16: tl.constexpr,  # k and v are bf16: the products run on bf16 tiles (`_dot_bf16x3`)
    PRECISION: tl.constexpr,  # "tf32" on the GPU; "ieee" under the interpreter
    HW_CVT: tl.constexpr,
):
    """One (block, head) per program, its whole [T, D] key tile in registers; all blocks and heads
    of a call are one launch (issue 15: this replaced a kernel whose fp32 FMA dots spilled ~3,000
    registers a thread at C = 32, 60 ms for 256 MiB).

    Merging centroids again (COUNTS) is the same program: the caller folds the counts into the
    weights (an empty centroid, count 0, weighs 0 and so never moves a mean nor is picked as a
    seed while a weighted row is left) and ranks empty rows last through `imp_ptr`, as
    `compress_blocks` does for the reference; only the new counts differ, summed from the rows'.

    Pinned rows (HAS_PIN, `reference.pinned_rows`): P rows picked first are the first P
    centroids, never moved and joined by no other row; their keys and values are copied, so a
    protected token comes out bit-exact with its own count."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ot = tl.arange(0, BLOCK_T)
    od = tl.arange(0, BLOCK_D)
    oc = tl.arange(0, BLOCK_C)
    mt = ot < T
    md = od < D
    mc = oc < C
    m2 = mt[:, None] & md[None, :]
    row = (n * T + ot) * H + h  # [BLOCK_T] int64
    K16 = tl.load(k_ptr + row[:, None] * D + od[None, :], mask=m2, other=0.0)
    K = K16.to(tl.float32)
    # The step kernels' modes compute in the kernel what `compress_blocks` computes in torch before
    # the launch, with the same float32 operations (a max, a comparison): the same bits.
    if W_MODE == 0:
        w = tl.load(w_ptr + row, mask=mt, other=0.0)
        s = tl.load(imp_ptr + row, mask=mt, other=float("-inf")).to(tl.float32)
    elif W_MODE == 1:
        s = tl.load(imp_ptr + ((n % A) * T + ot) * H + h, mask=mt, other=float("-inf")).to(tl.float32)
        w = tl.where(mt, tl.maximum(s, 1e-6), 0.0)
    else:
        w = tl.load(cnt_ptr + row, mask=mt, other=0.0)
        s = tl.where(mt, tl.where(w > 0, 1.0, -1.0), float("-inf"))
    rank = _ranks_of(s, prot_ptr, n, T, HAS_PROT, BLOCK_T, False)  # [BLOCK_T] as columns
    BIG = BLOCK_T + 1
    chosen = ot < 0
    seeds = tl.zeros((BLOCK_C,), tl.int64)
    pin_of = tl.full((BLOCK_T,), -1, tl.int32)  # the pinned centroid of each row, -1: none
    if HAS_PIN:
        # reference.pinned_rows: outlier = squared distance from the count-weighted mean key
        if COUNTS:  # noqa: SIM108 (a Triton branch on a constexpr)
            rc0 = tl.load(cnt_ptr + row, mask=mt, other=0.0)
        else:
            rc0 = tl.where(mt, 1.0, 0.0)
        live = (rc0 > 0) & mt
        mean = tl.sum(K * rc0[:, None], axis=0) / tl.maximum(tl.sum(rc0, axis=0), 1e-30)
        dev = K - mean[None, :]
        score = tl.where(live, tl.sum(dev * dev, axis=1), -1.0)
        score = tl.where(mt, score, float("-inf"))
        impv = tl.where(mt, s, 0.0)
        flat = tl.max(tl.where(live, impv, float("-inf")), axis=0) == tl.min(tl.where(live, impv, float("inf")), axis=0)
        for j in range(P):
            p_out = tl.argmax(tl.where(chosen, float("-inf"), score), axis=0, tie_break_left=True)
            p_rank = tl.argmin(tl.where((~chosen) & mt, rank, BIG), axis=0)
            if PIN_BY == 1:
                pick = p_out
            elif PIN_BY == 2:
                pick = p_rank
            else:
                pick = tl.where((j % 2 == 0) | flat, p_out, p_rank)
            chosen = chosen | (ot == pick)
            pin_of = tl.where(ot == pick, j, pin_of)
            seeds = tl.where(oc == j, (n * T + pick) * H + h, seeds)
    # Seeds of the other centroids as reference.seed_tokens: the best-ranked unpinned row first,
    # then weighted farthest point (first index on ties), the best-ranked unchosen token once
    # every unchosen one is a duplicate. Squared distances to a seed are from differences, as in
    # the reference, so a duplicate's is exactly 0 (a |k|^2 - 2 k.s + |s|^2 form would leave it
    # a rounding error above 0).
    pick = tl.argmin(tl.where((~chosen) & mt, rank, BIG), axis=0)
    mind = tl.full((BLOCK_T,), float("inf"), tl.float32)
    for j in range(P, C):
        if j > P:
            sc = tl.where((~chosen) & mt, w * mind, -1.0)
            best, far = tl.max(sc, axis=0, return_indices=True, return_indices_tie_break_left=True)
            if best > 0:  # noqa: SIM108 (a Triton branch: the argmin runs only when needed)
                pick = far
            else:
                pick = tl.argmin(tl.where((~chosen) & mt, rank, BIG), axis=0)
        chosen = chosen | (ot == pick)
        seed_row = (n * T + pick) * H + h
        seeds = tl.where(oc == j, seed_row, seeds)
        # the seed's key from L1 (this program just read it), not a masked sum over the tile
        krow = tl.load(k_ptr + seed_row * D + od, mask=md, other=0.0).to(tl.float32)
        diff = K - krow[None, :]
        mind = tl.minimum(mind, tl.sum(diff * diff, axis=1))
    cent = tl.load(k_ptr + seeds[:, None] * D + od[None, :], mask=mc[:, None] & md[None, :], other=0.0)
    cent = cent.to(tl.float32)
    knorm = tl.sum(K * K, axis=1)
    # Lloyd steps: distances |k|^2 - 2 k.c + |c|^2 (the reference's form) with the products on
    # the tensor cores at float32 accuracy (`_dot_f32`)
    onehot = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.int1)
    aw = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    sw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for _ in range(ITERS):  # a loop, not unrolled: four copies of the tile's temporaries spilled
        cn = tl.sum(cent * cent, axis=1)
        if BF16:
            kc = _dot_bf16x3(K16, tl.trans(cent), True, PRECISION == "ieee")
        else:
            kc = _dot_f32(K, tl.trans(cent), EXACT_A=EXACT16, EXACT_B=False, PRECISION=PRECISION)
        dist = knorm[:, None] - 2.0 * kc + cn[None, :]
        dist = tl.where(mc[None, :], dist, float("inf"))
        if HAS_PIN:  # a pinned row keeps its own centroid, which no other row joins
            pin_d = tl.where(pin_of[:, None] == oc[None, :], float("-inf"), float("inf"))
            dist = tl.where((oc < P)[None, :], pin_d, dist)
        assign = tl.argmin(dist, axis=1, tie_break_left=True)
        onehot = (assign[:, None] == oc[None, :]) & mt[:, None]
        aw = tl.where(onehot, w[:, None], 0.0)
        sw = tl.sum(aw, axis=0)
        if BF16:
            new = _dot_bf16x3(tl.trans(aw), K16, False, PRECISION == "ieee")
        else:
            new = _dot_f32(tl.trans(aw), K, EXACT_A=False, EXACT_B=EXACT16, PRECISION=PRECISION)
        cent = tl.where(((sw > 0) & (oc >= P))[:, None], new / tl.maximum(sw, 1e-30)[:, None], cent)
    V16 = tl.load(v_ptr + row[:, None] * D + od[None, :], mask=m2, other=0.0)
    if BF16:
        vc = _dot_bf16x3(tl.trans(aw), V16, False, PRECISION == "ieee")
    else:
        vc = _dot_f32(tl.trans(aw), V16.to(tl.float32), EXACT_A=False, EXACT_B=EXACT16, PRECISION=PRECISION)
    vc = vc / tl.maximum(sw, 1e-30)[:, None]
    if HAS_PIN:  # copied, not w v / w
        mp = (oc < P)[:, None] & md[None, :]
        vc = tl.where(mp, tl.load(v_ptr + seeds[:, None] * D + od[None, :], mask=mp, other=0.0).to(tl.float32), vc)
    if COUNTS:
        rc = tl.load(cnt_ptr + row, mask=mt, other=0.0)
        count = tl.sum(tl.where(onehot, rc[:, None], 0.0), axis=0)
    else:
        count = tl.sum(onehot.to(tl.float32), axis=0)
    lc = tl.where(count > 0, tl.log(count), float("-inf"))
    dst = ((n * C + oc[:, None]) * H + h) * D + od[None, :]
    mo = mc[:, None] & md[None, :]
    tl.store(ko_ptr + dst, _to_out(cent, ko_ptr.dtype.element_ty, HW_CVT), mask=mo)
    tl.store(vo_ptr + dst, _to_out(vc, vo_ptr.dtype.element_ty, HW_CVT), mask=mo)
    if LC_SLOTS:
        layer, slot = _step_slot(tbl_ptr, rows_ptr, n, A, 2, HAS_ROWS)
        lc_base = layer * lc_layer + slot * lc_slot
    else:
        lc_base = n * C * H
    tl.store(lc_ptr + lc_base + oc * H + h, lc, mask=mc)


CLUSTER_WARPS = 4
CLUSTER_BF16 = True
CLUSTER_MAX_REGISTERS: int | None = 168
"""k-means launch: warps, bf16 products for bf16 sources (`_dot_bf16x3`) and a ptxas register cap
(None: the compiler's choice). See docs/compression.md, session 9, for the timings behind them."""


def cluster(
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    protected: torch.Tensor | None,
    n_centroids: int,
    iters: int,
    importance: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    counts: torch.Tensor | None = None,
    n_pinned: int = 0,
    pin_by: str = "mixed",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (k_c [N, C, H, D] out_dtype, v_c, log_count [N, C, H] f32); see reference.cluster.

    `counts` [N, T, H]: the tokens each row stands for (re-merging centroids), summed into the new
    log-counts as `reference.cluster(..., counts=counts)` does; the caller folds them into
    `weights` and ranks empty rows last through `importance` (see `compress_blocks`).

    `out_dtype` other than float32 equals `reference.cluster(...)[0].to(out_dtype)` (the kernel
    rounds once, to nearest even), which saves compress_blocks a pass over the centroids.

    `n_pinned` rows picked by `pin_by` stay as they are (`reference.cluster(..., n_pinned=,
    pin_by=, importance=)`, the same picks from the same `importance`)."""
    if not 0 <= n_pinned < n_centroids:
        raise ValueError(f"n_pinned must be in [0, {n_centroids}) for {n_centroids} centroids, got {n_pinned}")
    n, t, h, d = k.shape
    k, v = k.contiguous(), v.contiguous()
    w = weights.float().contiguous()
    imp = w if importance is None else importance.float().contiguous()
    ko = torch.empty(n, n_centroids, h, d, device=k.device, dtype=out_dtype)
    vo = torch.empty_like(ko)
    lc = torch.empty(n, n_centroids, h, device=k.device, dtype=torch.float32)
    prot = protected.to(torch.uint8).contiguous() if protected is not None else w
    cnt = counts.float().contiguous() if counts is not None else w
    if n:
        _cluster_kernel[(n, h)](
            k, v, w, imp, prot, ko, vo, lc, cnt, w, w, 1, 0, 0, t, h, n_centroids, n_pinned,
            W_MODE=0, LC_SLOTS=False, HAS_ROWS=False, ITERS=iters, HAS_PROT=protected is not None,
            HAS_PIN=n_pinned > 0, PIN_BY=PIN_BY.index(pin_by),
            COUNTS=counts is not None, D=d,
            BLOCK_T=_p2(t, 16), BLOCK_D=_p2(d, 16), BLOCK_C=_p2(n_centroids, 16),
            EXACT16=k.dtype in (torch.bfloat16, torch.float16), BF16=k.dtype == torch.bfloat16 and CLUSTER_BF16,
            PRECISION="ieee" if INTERPRET else "tf32",
            HW_CVT=not INTERPRET, num_warps=CLUSTER_WARPS,
            **({"maxnreg": CLUSTER_MAX_REGISTERS} if CLUSTER_MAX_REGISTERS and not INTERPRET else {}),
        )  # fmt: skip
    return ko, vo, lc
