"""Quality probes as pure functions: numbers in, verdicts out. No I/O, no clocks, no vLLM, no torch.

Three probes watch quality (DESIGN.md, "Quality probes and fallback"):

1. **Compression-time** (`choose_within_bound`): before an action is applied, the integration
   measures the relative attention-output error of the candidate format on the observation
   window; a format over the policy's bound is refused and the next milder one is tried.
2. **Canary** (`evaluate_canary`): fixed prompts whose reference log-probs were taken
   uncompressed are rerun under the live policy; mean KL(reference || live) and top-1 agreement
   are compared with the policy's limits.
3. **Live drift** (`drift_test`): per-request log-probs and entropies of compressed requests are
   compared with an uncompressed holdout share by a one-sided Mann-Whitney U test each.

Each returns a `ProbeResult` whose `passed` feeds the fallback ladder (`proxima.policy.fallback`).
The statistics come from `scipy.stats` (scipy arrives with scikit-learn, a declared dependency).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import scipy.stats

from proxima.formats import Format
from proxima.policy.schema import CanaryProbe, CompressionProbe, DriftProbe

ProbeKind = Literal["compression", "canary", "drift"]


@dataclass(frozen=True)
class ProbeResult:
    """One probe verdict, the unit the fallback ladder and the metrics consume."""

    kind: ProbeKind
    passed: bool
    values: dict[str, float] = field(default_factory=dict)
    """Named measurements (e.g. {"kl": 0.01, "top1": 0.98}), exported as metrics and by the API."""
    detail: str = ""
    """One human sentence: why it passed or failed."""


# -- 1. compression-time probe ---------------------------------------------------------------------


def relative_error(reference: np.ndarray, approx: np.ndarray) -> float:
    """||approx - reference|| / ||reference|| over all elements (0 when both are zero).

    The attention outputs of the observation-window queries, e.g. `[Q, H, D]`, before and after
    compressing a block; any shape works as long as both agree.
    """
    ref = np.asarray(reference, dtype=np.float64)
    app = np.asarray(approx, dtype=np.float64)
    if ref.shape != app.shape:
        raise ValueError(f"relative_error: shapes differ, reference {ref.shape} vs approx {app.shape}")
    denom = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(app - ref))
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom


@dataclass(frozen=True)
class CompressionVerdict:
    """Which format to apply (None: leave the block as it is) and every attempt on the way."""

    chosen: Format | None
    attempts: tuple[tuple[Format, float, float], ...]
    """(format, measured error, bound), in the order tried."""

    @property
    def rejected(self) -> list[Format]:
        return [f for f, err, bound in self.attempts if not err <= bound]

    def result(self) -> ProbeResult:
        worst = max((err / bound for _, err, bound in self.attempts), default=0.0)
        tried = ", ".join(f"{f.name}={err:.3g}/{bound:.3g}" for f, err, bound in self.attempts)
        return ProbeResult(
            "compression",
            passed=self.chosen is not None and not self.rejected,
            values={"worst_error_over_bound": worst, "rejected": float(len(self.rejected))},
            detail=f"chose {self.chosen.name if self.chosen else 'none'} ({tried})",
        )


def choose_within_bound(
    candidates: Sequence[Format], measure: Callable[[Format], float], cfg: CompressionProbe
) -> CompressionVerdict:
    """Try `candidates` in order (the engine's choice first, then milder ones) and keep the first
    whose measured error is within the policy's bound.

    `measure(fmt)` is supplied by the integration (it runs the format's kernel on the block); this
    function only decides, so it stays testable without tensors. A NaN error counts as over the
    bound: a kernel that produced garbage must never be applied.
    """
    if not cfg.enabled:
        return CompressionVerdict(candidates[0] if candidates else None, ())
    attempts: list[tuple[Format, float, float]] = []
    for fmt in candidates:
        err = float(measure(fmt))
        bound = cfg.bound(fmt)
        attempts.append((fmt, err, bound))
        if err <= bound:  # False for NaN
            return CompressionVerdict(fmt, tuple(attempts))
    return CompressionVerdict(None, tuple(attempts))


def compression_step(errors: Sequence[float], measured: int, refused: int, cfg: CompressionProbe) -> ProbeResult:
    """One engine step's compression-time verdict, the unit the fallback ladder counts.

    `errors`: every measurement of the step; `measured`: blocks measured in the format the engine
    chose, `refused` of them over the bound. A single refused block is handled by the refusal
    itself; a step fails when more than `cfg.max_refused_fraction` of its blocks were refused,
    i.e. when the engine's choices, not a stray block, are too lossy for the model.
    """
    if measured <= 0:
        raise ValueError("compression_step: no block was measured")
    frac = refused / measured
    errs = np.asarray(errors, dtype=np.float64)
    finite = errs[np.isfinite(errs)]  # a NaN error (a refused garbage block) is counted, not averaged
    passed = frac <= cfg.max_refused_fraction
    return ProbeResult(
        "compression",
        passed=passed,
        values={"measured": float(measured), "refused": float(refused), "refused_fraction": frac,
                "max_error": float(finite.max()) if finite.size else 0.0,
                "nonfinite": float(errs.size - finite.size)},
        detail=f"{refused} of {measured} blocks over the error bound"
        + ("" if passed else f" (more than {cfg.max_refused_fraction:.0%})"),
    )


# -- 2. canary probe ---------------------------------------------------------------------------------


def _log_softmax(x: np.ndarray) -> np.ndarray:
    # Inputs may be raw logits or already-normalised log-probs; normalising again is harmless.
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def kl_per_position(reference_logprobs: np.ndarray, live_logprobs: np.ndarray) -> np.ndarray:
    """KL(reference || live) in nats for every position. Inputs `[T, V]` (log-probs or logits)."""
    ref = np.asarray(reference_logprobs, dtype=np.float64)
    live = np.asarray(live_logprobs, dtype=np.float64)
    if ref.shape != live.shape or ref.ndim != 2:
        raise ValueError(f"canary: expected two [T, V] arrays of equal shape, got {ref.shape} and {live.shape}")
    lp, lq = _log_softmax(ref), _log_softmax(live)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    return np.maximum(kl, 0.0)  # rounding can give -1e-17


@dataclass(frozen=True)
class CanaryResult:
    kl_mean: float
    kl_max: float
    top1: float
    positions: int

    def result(self, cfg: CanaryProbe) -> ProbeResult:
        ok_kl = self.kl_mean <= cfg.max_kl
        ok_top1 = self.top1 >= cfg.min_top1
        why = []
        if not ok_kl:
            why.append(f"mean KL {self.kl_mean:.4g} > {cfg.max_kl:g}")
        if not ok_top1:
            why.append(f"top-1 agreement {self.top1:.3f} < {cfg.min_top1:g}")
        return ProbeResult(
            "canary",
            passed=ok_kl and ok_top1,
            values={"kl": self.kl_mean, "kl_max": self.kl_max, "top1": self.top1},
            detail="; ".join(why) or f"KL {self.kl_mean:.4g}, top-1 {self.top1:.3f} over {self.positions} positions",
        )


def evaluate_canary(reference: Sequence[np.ndarray], live: Sequence[np.ndarray], cfg: CanaryProbe) -> ProbeResult:
    """Compare the live run of every canary prompt with its reference.

    `reference[i]` and `live[i]` are `[T_i, V]` log-probs (or logits) of prompt i over the same
    forced continuation (teacher forcing, so positions align). KL is averaged over all positions
    of all prompts (long prompts weigh more, as they hold more evidence).
    """
    if len(reference) != len(live):
        raise ValueError(f"canary: {len(reference)} reference prompts but {len(live)} live ones")
    if not reference:
        raise ValueError("canary: no prompts to compare")
    kls, agree = [], []
    for ref, cur in zip(reference, live, strict=True):
        kls.append(kl_per_position(ref, cur))
        agree.append(np.argmax(ref, axis=-1) == np.argmax(cur, axis=-1))
    kl = np.concatenate(kls)
    top = np.concatenate(agree)
    return CanaryResult(float(kl.mean()), float(kl.max()), float(top.mean()), int(kl.size)).result(cfg)


# -- 3. live drift -----------------------------------------------------------------------------------


def entropy(logprobs: np.ndarray) -> np.ndarray:
    """Entropy in nats of each row of `[T, V]` log-probs (or logits)."""
    lp = _log_softmax(np.asarray(logprobs, dtype=np.float64))
    return -np.sum(np.exp(lp) * lp, axis=-1)


MIN_REQUESTS_PER_SIDE = 10
"""Fewest requests per side `drift_test` gives a verdict on. Below it a single odd request moves
the rank sums by a large share, and the smallest p-value the exact tests can give grows towards
the thresholds in use (n = 10: 1 / C(20, 10) = 5.4e-6 unpaired, 2^-10 = 9.8e-4 paired)."""
EXACT_MAX_PAIRS = 10_000
"""Up to n1 * n2 pairs (100 a side) a tie-free comparison uses the exact null distribution of U."""


def mann_whitney_less(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """One-sided Mann-Whitney U test of H1 "a tends to be smaller than b" (scipy's normal
    approximation with tie and continuity corrections). Returns (U statistic of `a`, p-value).

    Chosen over Welch's t because log-probs and entropies are heavy-tailed. All values equal:
    p = 1 (no evidence either way)."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    if a.size == 0 or b.size == 0:
        raise ValueError(f"mann_whitney_less: both samples need values, got {a.size} and {b.size}")
    r = scipy.stats.mannwhitneyu(a, b, alternative="less", method="asymptotic", use_continuity=True)
    p = float(r.pvalue)
    return float(r.statistic), 1.0 if math.isnan(p) else p


def _p_less(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of "a tends to be smaller than b": exact when there are no ties and the samples are
    small (the normal approximation's tail is off by tens of percent at 10 a side, exactly where a
    verdict is decided), the tie-corrected approximation otherwise."""
    if a.size * b.size <= EXACT_MAX_PAIRS and np.unique(np.concatenate([a, b])).size == a.size + b.size:
        return float(scipy.stats.mannwhitneyu(a, b, alternative="less", method="exact").pvalue)
    return mann_whitney_less(a, b)[1]


def _p_paired_less(diff: np.ndarray) -> float:
    """p-value of "the paired differences tend to be negative" (Wilcoxon signed-rank, one-sided):
    exact below 50 pairs without ties or zeros, scipy's normal approximation otherwise. All
    differences zero: p = 1."""
    if not np.any(diff):
        return 1.0
    p = float(scipy.stats.wilcoxon(diff, alternative="less").pvalue)
    return 1.0 if math.isnan(p) else p


def smallest_paired_p(pairs: int) -> float:
    """The smallest one-sided p-value the exact signed-rank test can give for `pairs` pairs: all
    differences of one sign, 2^-pairs. A level below it could never fail a verdict."""
    return 0.5 ** pairs


@dataclass(frozen=True)
class DriftSample:
    """One population (compressible requests, or the holdout): ONE value per request, `[N]` each.

    Requests, not tokens, are the units: the tokens of one request share its prompt and its text,
    so they are not independent and a token-level test would count one odd request many times."""

    logprob: np.ndarray
    """Each request's mean log-prob of its generated tokens, `[N]`."""
    entropy: np.ndarray
    """Each request's mean entropy of the next-token distributions it sampled from, `[N]`."""


def drift_test(compressed: DriftSample, holdout: DriftSample, cfg: DriftProbe, paired: bool = False) -> ProbeResult:
    """Has compression made the model less sure of its own tokens?

    Two one-sided rank tests over per-request values: compressed log-probs lower than the
    holdout's, and compressed entropies higher. Unpaired: Mann-Whitney U (exact on small tie-free
    windows). `paired=True`: the i-th request of each side were measured alike (the scheduler
    averages both over the output positions they share, `DriftWindows.verdict`), so the values of
    a pair are correlated and only their difference is evidence: Wilcoxon's signed-rank test on the
    differences (the unpaired test on such values is not valid: on 100 windows resampled from a recorded
    good run it alarmed once at a level of 2e-4).

    The verdict fails when either test rejects, so the two share the policy's `p_value`
    (Bonferroni: each at p_value / 2): under the null (which request lands on which side is
    random) the verdict's false-alarm rate is at most `p_value`, exactly so with the exact tests.
    Over a run of V verdicts the chance of any false failure is at most V * p_value, and the ladder
    steps down only after `failures_to_step_down` failures in a row. Needs `MIN_REQUESTS_PER_SIDE`
    requests per side (and as many on both when paired).
    """
    sides = {"compressed": compressed, "holdout": holdout}
    values_of: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, side in sides.items():
        lp = np.asarray(side.logprob, dtype=np.float64).ravel()
        ent = np.asarray(side.entropy, dtype=np.float64).ravel()
        if lp.size != ent.size:
            raise ValueError(f"drift_test: {name} side has {lp.size} log-probs but {ent.size} entropies")
        if lp.size < MIN_REQUESTS_PER_SIDE:
            raise ValueError(f"drift_test: {name} side has {lp.size} requests, fewer than the "
                             f"{MIN_REQUESTS_PER_SIDE} a verdict needs")
        if not (np.all(np.isfinite(lp)) and np.all(np.isfinite(ent))):
            raise ValueError(f"drift_test: {name} side has non-finite values")
        values_of[name] = (lp, ent)
    (c_lp, c_ent), (h_lp, h_ent) = values_of["compressed"], values_of["holdout"]
    if paired:
        if c_lp.size != h_lp.size:
            raise ValueError(f"drift_test: paired sides differ in size ({c_lp.size} compressed, {h_lp.size} holdout)")
        p_lp = _p_paired_less(c_lp - h_lp)
        p_ent = _p_paired_less(h_ent - c_ent)
    else:
        p_lp = _p_less(c_lp, h_lp)
        p_ent = _p_less(-c_ent, -h_ent)
    alpha = cfg.p_value / 2.0
    why = []
    if p_lp < alpha:
        why.append(f"request log-prob lower than holdout (p={p_lp:.2g})")
    if p_ent < alpha:
        why.append(f"entropy higher than holdout (p={p_ent:.2g})")
    values = {
        "p_logprob": p_lp,
        "p_entropy": p_ent,
        "delta_logprob": float(np.mean(c_lp) - np.mean(h_lp)),
        "delta_entropy": float(np.mean(c_ent) - np.mean(h_ent)),
        "threshold": alpha,
    }
    return ProbeResult(
        "drift",
        passed=not why,
        values=values,
        detail="; ".join(why) or f"no significant drift (p={min(p_lp, p_ent):.2g}, threshold {alpha:.2g})",
    )


__all__ = [
    "MIN_REQUESTS_PER_SIDE",
    "CanaryResult",
    "CompressionVerdict",
    "DriftSample",
    "ProbeKind",
    "ProbeResult",
    "choose_within_bound",
    "compression_step",
    "drift_test",
    "entropy",
    "evaluate_canary",
    "kl_per_position",
    "mann_whitney_less",
    "relative_error",
    "smallest_paired_p",
]
