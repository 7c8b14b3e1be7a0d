"""Torch reference implementations of every compression op (the semantics the kernels match).

All functions are batched over blocks. Named dims: N blocks, T tokens of a block, H KV heads,
D head dim, P packed dim (D / values per byte), C kept tokens or centroids, G group size.

Arithmetic is float32 and written so the Triton kernels can follow it step for step:
quantization codes are `floor(x * (1 / scale) + 0.5)` (not torch's round-half-even), sub-byte scales
and zero points are rounded to float16 *before* the codes are computed (so the stored metadata
is the one the codes were made with), and k-means distances are `|k|^2 - 2 k.c + |c|^2`.
"""

from __future__ import annotations

import functools

import torch

from proxima.compression.spec import FP8_E4M3_MAX, INT8_MAX, VALUES_PER_BYTE

# --------------------------------------------------------------------------------------------
# bit packing (sub-byte formats pack along D; see spec.VALUES_PER_BYTE)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] integer codes in [0, 2^bits) -> [..., D * bits / 8] uint8."""
    per = 8 // bits
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., P] uint8 -> [..., P * 8 / bits] int32 codes."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _round(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x + 0.5)


def _true_div(x: torch.Tensor, d: float) -> torch.Tensor:
    """x / d correctly rounded, on every device, as the kernels' `div_rn` computes it.

    A plain `x / d` with a Python number is not: on CUDA, torch multiplies by the reciprocal of a
    CPU scalar, one ulp off the quotient for some x. That ulp moved an fp8 scale, and a value
    that sat exactly on an e4m3 rounding tie (bf16 data times 448 / amax often does) then rounded
    one step away from the kernel's: the "one e4m3 step" mismatches seen on the H200. Dividing by
    a tensor takes the true division path everywhere.
    """
    return x / torch.full_like(x, d)


# --------------------------------------------------------------------------------------------
# quantization


def quantize_per_token(x: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 / int8 with one float32 scale per (token, head).

    x: [N, T, H, D] -> (data [N, T, H, D] float8_e4m3fn | int8, scale [N, T, H] float32).
    """
    xf = x.float()
    amax = xf.abs().amax(-1)
    qmax = FP8_E4M3_MAX if quant == "fp8" else INT8_MAX
    # An all-zero row gets scale 1 so that 0 / scale stays 0 (and never NaN).
    scale = torch.where(amax > 0, _true_div(amax, qmax), torch.ones_like(amax))
    y = xf * (1.0 / scale).unsqueeze(-1)  # a reciprocal, then multiplies: what the kernel does
    if quant == "fp8":
        return y.to(torch.float8_e4m3fn), scale
    return _round(y).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_per_token(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_per_token`, float32 [N, T, H, D]."""
    return data.float() * scale.float().unsqueeze(-1)


def _asym_meta(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 (scale, zero) of asymmetric min/max quantization over a group."""
    levels = (1 << bits) - 1
    rng = hi - lo
    scale = torch.where(rng > 0, _true_div(rng, levels), torch.ones_like(rng)).to(torch.float16)
    return scale, lo.to(torch.float16)


def _asym_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in [0, 2^bits); scale and zero broadcast against x."""
    return _round((x - zero.float()) * (1.0 / scale.float())).clamp(0, (1 << bits) - 1)


def quantize_kivi_keys(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, ...]:
    """KIVI keys: per channel, groups of `group` tokens (the last group may be short).

    x: [N, T, H, D] -> (packed [N, T, H, P] uint8, scale [N, Gk, H, D] fp16, zero [N, Gk, H, D] fp16)
    with Gk = ceil(T / group).
    """
    n, t, h, d = x.shape
    gk = -(-t // group)
    xf = x.float()
    pad = gk * group - t
    # Pad with copies of the last token (it is in the last group), so padding never widens a
    # group's min/max range.
    xp = torch.cat([xf, xf[:, -1:].expand(n, pad, h, d)], 1) if pad else xf
    xg = xp.reshape(n, gk, group, h, d)
    scale, zero = _asym_meta(xg.amin(2), xg.amax(2), bits)  # [N, Gk, H, D]
    codes = _asym_codes(xg, scale.unsqueeze(2), zero.unsqueeze(2), bits)
    codes = codes.reshape(n, gk * group, h, d)[:, :t]
    return pack_codes(codes, bits), scale, zero


def dequantize_kivi_keys(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int
) -> torch.Tensor:
    codes = unpack_codes(packed, bits).float()  # [N, T, H, D]
    t = codes.shape[1]
    g_of_t = torch.arange(t, device=codes.device) // group
    return codes * scale.float()[:, g_of_t] + zero.float()[:, g_of_t]


def quantize_kivi_values(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, ...]:
    """KIVI values: per token, groups of `group` channels.

    x: [N, T, H, D] -> (packed [N, T, H, P] uint8, scale [N, T, H, D/G] fp16, zero same).
    """
    n, t, h, d = x.shape
    xg = x.float().reshape(n, t, h, d // group, group)
    scale, zero = _asym_meta(xg.amin(-1), xg.amax(-1), bits)  # [N, T, H, D/G]
    codes = _asym_codes(xg, scale.unsqueeze(-1), zero.unsqueeze(-1), bits)
    return pack_codes(codes.reshape(n, t, h, d), bits), scale, zero


def dequantize_kivi_values(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int
) -> torch.Tensor:
    codes = unpack_codes(packed, bits).float()
    n, t, h, d = codes.shape
    cg = codes.reshape(n, t, h, d // group, group)
    return (cg * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).reshape(n, t, h, d)


def bits_of(quant: str) -> int:
    return 8 // VALUES_PER_BYTE.get(quant, 1)


# --------------------------------------------------------------------------------------------
# lean formats (int4h / int2h, spec.LEAN_BITS): one fp16 scale per (token, head), keys rotated

ROTATION_SEED = 0x50524F58  # "PROX"; changing it changes every stored int4h / int2h key
LEAN_MIN_SCALE = 2.0**-14
"""Smallest lean scale (float16's smallest normal): an all-zero or tiny row stays finite and exact
to 2^-15 instead of dividing by a scale that rounded to 0 in float16."""


def _rotation_signs(d: int) -> list[float]:
    """d signs from splitmix64 seeded with ROTATION_SEED: plain integer arithmetic, so the same on
    every machine and torch version (the stored keys depend on them; both integrations call this)."""
    out, x, m = [], ROTATION_SEED, (1 << 64) - 1
    for _ in range(d):
        x = (x + 0x9E3779B97F4A7C15) & m
        z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        out.append(-1.0 if (z ^ (z >> 31)) & 1 else 1.0)
    return out


@functools.lru_cache(maxsize=16)
def _rotation_cpu(d: int) -> torch.Tensor:
    if d < 16 or d & (d - 1):
        raise ValueError(f"the lean formats' Hadamard rotation needs a power-of-two head_dim >= 16, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(_rotation_signs(d), dtype=torch.float64)
    return (signs[:, None] * h / d**0.5).float().contiguous()


def rotation(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[D, D] float32 orthogonal R = diag(s) H / sqrt(D) (s: seeded random signs, H: Sylvester
    Hadamard). Lean keys are stored as codes of k @ R and read back as k_hat @ R^T, so dot products
    with unrotated queries are unchanged up to the quantization error."""
    dev = torch.device(device)
    return _rotation_cpu(d) if dev.type == "cpu" else _rotation_on(d, str(dev))


@functools.lru_cache(maxsize=32)
def _rotation_on(d: int, device: str) -> torch.Tensor:
    return _rotation_cpu(d).to(device)  # one copy per device, not one per compression call


LEAN_CLIP: dict[int, tuple[int, int]] = {4: (20, 7), 2: (10, 7)}
"""bits -> (K, n): each row's scale is the best (least squared error) of n candidates
amax * (K - i) / K / HALF, i = 0 .. n-1 (4-bit: amax x 1.00 .. 0.70, 2-bit: 1.0 .. 0.4). A rotated
row is close to Gaussian, where clipping its few largest values costs less than the coarser grid
amax would give everything else (SmolLM2's real KV, bench/results/experiments/lean-formats/)."""


def lean_codes(y: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows y [..., D] float32 -> (codes [..., D] in [0, 2^bits) as float32, scale [...] float16).

    Mid-rise grid: value = (code - HALF) * scale, HALF = (2^bits - 1) / 2, code =
    floor(y / scale + HALF + 0.5) clamped; scale from `LEAN_CLIP`, rounded to float16 before the codes
    are made (the stored scale is the one used). Ties between candidates go to the larger scale."""
    half = ((1 << bits) - 1) / 2
    k_den, n = LEAN_CLIP[bits]
    amax = y.abs().amax(-1)

    def candidate(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = _true_div(amax * float(k_den - i), k_den * half).clamp_min(LEAN_MIN_SCALE).to(torch.float16)
        sf = s.float().unsqueeze(-1)
        c = torch.floor(y * (1.0 / sf) + (half + 0.5)).clamp(0, 2 * half)
        return c, s, ((c - half) * sf - y).square().sum(-1)

    best_c, best_s, best_e = candidate(0)
    for i in range(1, n):
        c, s, e = candidate(i)
        better = e < best_e
        best_c = torch.where(better.unsqueeze(-1), c, best_c)
        best_s, best_e = torch.where(better, s, best_s), torch.where(better, e, best_e)
    return best_c, best_s


def quantize_lean(x: torch.Tensor, bits: int, is_key: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [N, T, H, D] -> (packed [N, T, H, P] uint8, scale [N, T, H] float16, keys: zero [N, 1, H, D]
    float16, the block's per-channel mean, else None).

    Keys: the per-channel mean of the block's T tokens is taken out first (a key channel's offset is
    stable over a block: KIVI's observation; rotated, it would widen every row's range), then the
    rows are rotated. Values are rotated only. Codes from `lean_codes`."""
    xf = x.float()
    zero = None
    if is_key:
        zero = xf.mean(1, keepdim=True).to(torch.float16)
        xf = xf - zero.float()
    codes, scale = lean_codes(xf @ rotation(x.shape[-1], x.device), bits)
    return pack_codes(codes, bits), scale, zero


def dequantize_lean(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """Inverse of `quantize_lean`, float32 [N, T, H, D]: rotated back, the keys' mean added."""
    half = ((1 << bits) - 1) / 2
    x = (unpack_codes(packed, bits).float() - half) * scale.float().unsqueeze(-1)
    x = x @ rotation(x.shape[-1], x.device).T
    return x if zero is None else x + zero.float()


# --------------------------------------------------------------------------------------------
# token reduction


def token_ranks(importance: torch.Tensor, protected: torch.Tensor | None) -> torch.Tensor:
    """Rank of each token within its (block, head): 0 = most important.

    importance: [N, T, H] float; protected: [N, T] bool or None. Protected tokens rank first;
    ties go to the lower token index, so the order is total and deterministic.
    Returns int64 [N, T, H].
    """
    s = importance.float()
    if protected is not None:
        s = torch.where(protected.unsqueeze(-1), torch.full_like(s, float("inf")), s)
    t = s.shape[1]
    idx = torch.arange(t, device=s.device)
    si, sj = s.unsqueeze(2), s.unsqueeze(1)  # [N, T(i), 1, H], [N, 1, T(j), H]
    before = (sj > si) | ((sj == si) & (idx.view(1, 1, t, 1) < idx.view(1, t, 1, 1)))
    return before.sum(2)


def sparsify(
    k: torch.Tensor, v: torch.Tensor, ranks: torch.Tensor, keep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the `keep` best-ranked tokens per (block, head), in their original order.

    k, v: [N, T, H, D]; ranks: [N, T, H] from `token_ranks`.
    Returns (k_kept [N, C, H, D], v_kept, token_index [N, C, H] int32) with C = keep.
    """
    kept = ranks < keep
    pos = torch.cumsum(kept.to(torch.int64), 1) - 1
    n, t, h, _ = k.shape
    src = torch.arange(t, device=k.device).view(1, t, 1).expand(n, t, h)
    # Non-kept tokens scatter into a spill column `keep` that is dropped afterwards.
    dst = torch.where(kept, pos, torch.full_like(pos, keep))
    full = torch.zeros(n, keep + 1, h, dtype=torch.int64, device=k.device)
    full.scatter_(1, dst, src)
    token_index = full[:, :keep]
    gidx = token_index.unsqueeze(-1).expand(n, keep, h, k.shape[-1])
    return k.gather(1, gidx), v.gather(1, gidx), token_index.to(torch.int32)


def cluster(
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    ranks: torch.Tensor,
    n_centroids: int,
    iters: int,
    counts: torch.Tensor | None = None,
    n_pinned: int = 0,
    pin_by: str = "mixed",
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """STAR-KV: importance-weighted k-means of each (block, head)'s keys.

    k, v: [N, T, H, D]; weights: [N, T, H] > 0; ranks: [N, T, H]; seeds from `seed_ranks`.
    `iters` Lloyd steps of (assign to the nearest centroid, lowest index
    on ties; move each non-empty centroid to its members' weighted mean). Values are the
    weighted means of the final assignment.
    counts: [N, T, H] tokens each input row stands for (None: one each). Re-merging centroids
    passes their counts, so a centroid's count is the number of *original* tokens it holds (the
    caller folds counts into `weights` too).
    n_pinned: P rows per (block, head) stay as they are, each a centroid of its own (the first
    P outputs, its key and value bit-exact, its count its own: 1 for a token): the protected
    tokens of a merged block (`pinned_rows` picks them by `pin_by` from `importance`, the values
    `ranks` were made from, and the keys). The other T - P rows are merged into C - P centroids,
    seeded and moved as above but never joined to a pinned centroid. 0 <= P < C.
    Returns (k_c [N, C, H, D] f32, v_c [N, C, H, D] f32, log_count [N, C, H] f32 (-inf when
    empty), assign [N, T, H] int64).
    """
    kf, vf, w = k.float().transpose(1, 2), v.float().transpose(1, 2), weights.float().transpose(1, 2)
    c, p = n_centroids, n_pinned
    if not 0 <= p < c:
        raise ValueError(f"n_pinned must be in [0, {c}) for {c} centroids, got {p}")
    cols = torch.arange(c, device=k.device)
    pins = torch.zeros(k.shape[0], 0, k.shape[2], dtype=torch.int64, device=k.device)
    if p:
        imp = importance if importance is not None else weights
        pins = pinned_rows(k, imp, ranks, counts, p, pin_by)  # [N, P, H]
    pinned = torch.zeros(ranks.shape, dtype=torch.bool, device=k.device).scatter_(1, pins, True)
    rest = seed_tokens(k, weights, ranks, c - p, exclude=pinned)
    seed_tok = torch.cat([pins, rest], 1).transpose(1, 2)  # [N, H, C]
    cent = kf.gather(2, seed_tok.unsqueeze(-1).expand(-1, -1, -1, kf.shape[-1]))  # [N, H, C, D]
    knorm = (kf * kf).sum(-1, keepdim=True)  # [N, H, T, 1]
    # A pinned row belongs to its own centroid (distance -inf), and no other row may join it (inf).
    pin_col = torch.full(ranks.shape, -1, dtype=torch.int64, device=k.device)
    pin_col.scatter_(1, pins, cols[:p].view(1, p, 1).expand_as(pins))
    own = pin_col.transpose(1, 2).unsqueeze(-1) == cols  # [N, H, T, C]
    pin_dist = torch.where(own, float("-inf"), float("inf"))
    assign = torch.zeros(kf.shape[:3], dtype=torch.int64, device=k.device)
    for _ in range(iters):
        dist = knorm - 2 * (kf @ cent.transpose(-1, -2)) + (cent * cent).sum(-1).unsqueeze(-2)
        dist = torch.where(cols < p, pin_dist, dist)
        assign = dist.argmin(-1)  # torch returns the first minimum
        onehot = (assign.unsqueeze(-1) == cols).float()  # [N,H,T,C]
        aw = onehot * w.unsqueeze(-1)
        sw = aw.sum(2)  # [N, H, C]
        new = (aw.transpose(-1, -2) @ kf) / sw.clamp_min(1e-30).unsqueeze(-1)
        # a pinned centroid is its row's key as read: w k / w would round it
        cent = torch.where(((sw > 0) & (cols >= p)).unsqueeze(-1), new, cent)
    onehot = (assign.unsqueeze(-1) == cols).float()
    aw = onehot * w.unsqueeze(-1)
    sw = aw.sum(2)
    vc = (aw.transpose(-1, -2) @ vf) / sw.clamp_min(1e-30).unsqueeze(-1)
    if p:
        vpin = vf.gather(2, pins.transpose(1, 2).unsqueeze(-1).expand(-1, -1, -1, vf.shape[-1]))
        vc = torch.cat([vpin, vc[:, :, p:]], 2)
    count = onehot.sum(2) if counts is None else (onehot * counts.float().transpose(1, 2).unsqueeze(-1)).sum(2)
    log_count = torch.where(count > 0, count.log(), torch.full_like(count, float("-inf")))
    return (
        cent.transpose(1, 2).contiguous(),
        vc.transpose(1, 2).contiguous(),
        log_count.transpose(1, 2).contiguous(),
        assign.transpose(1, 2).contiguous(),
    )


def seed_tokens(
    k: torch.Tensor, weights: torch.Tensor, ranks: torch.Tensor, c: int, exclude: torch.Tensor | None = None
) -> torch.Tensor:
    """Deterministic k-means seeds: the most important token first, then each next seed is the
    token maximising weight * (squared distance to the nearest seed so far), first index on
    ties (a weighted farthest-point start). Duplicated keys have distance 0 and are never
    picked while a distinct key is left; if none is left, the best-ranked unchosen token is.
    Plain top-c-by-importance seeds were tried first and left whole mixture components without
    a centroid (objective 4.7x scikit-learn's best k-means++ on a Gaussian mixture; this: 1.0x).
    `exclude` [N, T, H] bool: rows that are never seeds (pinned rows: they take no part in the
    merge, so the farthest-point distances do not count them either).
    k [N, T, H, D], weights [N, T, H] > 0, ranks [N, T, H] -> [N, C, H] int64.
    """
    kf = k.float().transpose(1, 2)  # [N, H, T, D]
    r = ranks.transpose(1, 2)  # [N, H, T]
    w = weights.float().transpose(1, 2)
    n, h, t, _ = kf.shape
    chosen = torch.zeros(n, h, t, dtype=torch.bool, device=k.device)
    if exclude is not None:
        chosen = exclude.transpose(1, 2).clone()
    mind = torch.full((n, h, t), float("inf"), device=k.device)
    out = torch.zeros(n, h, c, dtype=torch.int64, device=k.device)
    for j in range(c):
        by_rank = torch.where(chosen, r + t + 1, r).argmin(-1)
        if j == 0:
            pick = by_rank
        else:
            sc = torch.where(chosen, torch.full_like(w, -1.0), w * mind)
            best, far = sc.max(-1)
            pick = torch.where(best > 0, far, by_rank)
        out[:, :, j] = pick
        chosen.scatter_(2, pick.unsqueeze(-1), True)
        seed = kf.gather(2, pick.view(n, h, 1, 1).expand(-1, -1, 1, kf.shape[-1]))
        mind = torch.minimum(mind, ((kf - seed) ** 2).sum(-1))
    return out.transpose(1, 2)


PIN_BY = ("mixed", "outlier", "importance")
"""How a merged block's protected tokens are picked (`pinned_rows`)."""


def outlier_scores(k: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
    """Squared distance of each row's key from the block's mean key (per head, rows weighted by
    their counts), -1 for an empty row: the tokens no mean stands for. k [N, T, H, D] -> [N, T, H].

    Why: a block compressed before its question (the `after` setting) holds tokens no observed
    query has looked at, so importance cannot mark them; a token unlike the rest of its block is
    what a merge would blur most."""
    kf = k.float()
    c = torch.ones(k.shape[:3], device=k.device) if counts is None else counts.float()
    mean = (kf * c.unsqueeze(-1)).sum(1, keepdim=True) / c.sum(1).clamp_min(1e-30).unsqueeze(1).unsqueeze(-1)
    s = ((kf - mean) ** 2).sum(-1)
    return torch.where(c > 0, s, torch.full_like(s, -1.0))


def pinned_rows(
    k: torch.Tensor,
    importance: torch.Tensor,
    ranks: torch.Tensor,
    counts: torch.Tensor | None,
    p: int,
    by: str = "mixed",
) -> torch.Tensor:
    """The P rows of each (block, head) a merge keeps as they are, in pick order: [N, P, H] int64.

    `by`: "importance" takes the best `ranks` (protected tokens first, then importance; lowest
    index on ties), "outlier" the highest `outlier_scores`, "mixed" alternates, an outlier first,
    so that a block compressed before its question keeps what no query marked. Where importance
    says nothing (every non-empty row's `importance` equal: a block never observed, or the
    merged rows the vLLM worker ranks uniformly) every pick of "mixed" is an outlier.
    Lowest index on ties throughout; empty rows (count 0) come last by either score."""
    if by not in PIN_BY:
        raise ValueError(f"pin_by must be one of {PIN_BY}, got {by!r}")
    n, t, h = ranks.shape
    score = outlier_scores(k, counts).transpose(1, 2)  # [N, H, T]
    r = ranks.transpose(1, 2)
    live = torch.ones(n, h, t, dtype=torch.bool, device=k.device) if counts is None else counts.transpose(1, 2) > 0
    imp = importance.float().transpose(1, 2)
    hi = torch.where(live, imp, float("-inf")).amax(-1)
    lo = torch.where(live, imp, float("inf")).amin(-1)
    flat = hi == lo  # [N, H]: importance ranks nothing here
    chosen = torch.zeros(n, h, t, dtype=torch.bool, device=k.device)
    out = torch.zeros(n, h, p, dtype=torch.int64, device=k.device)
    for j in range(p):
        by_out = torch.where(chosen, float("-inf"), score).argmax(-1)  # first maximum
        by_rank = torch.where(chosen, r + t + 1, r).argmin(-1)
        turn = by == "outlier" or (by == "mixed" and j % 2 == 0)
        use_out = torch.full_like(flat, turn) | (flat & (by != "importance"))
        pick = torch.where(use_out, by_out, by_rank)
        out[:, :, j] = pick
        chosen.scatter_(2, pick.unsqueeze(-1), True)
    return out.transpose(1, 2)


def kmeans_objective(k: torch.Tensor, weights: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """Weighted within-cluster sum of squares per (block, head), nearest-centroid assignment.

    k: [N, T, H, D], weights [N, T, H], cent [N, C, H, D] -> [N, H] float64.
    """
    kf, cf = k.double().transpose(1, 2), cent.double().transpose(1, 2)
    d2 = torch.cdist(kf, cf).pow(2).amin(-1)  # [N, H, T]
    return (d2 * weights.double().transpose(1, 2)).sum(-1)
