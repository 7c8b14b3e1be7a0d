"""Quality probes as pure functions: numbers in, verdicts out. No I/O, no clocks, no vLLM, no torch.

Three probes watch quality (DESIGN.md, "Quality probes and fallback"):

1. **Compression-time** (`choose_within_bound`): before an action is applied, the integration
   measures the relative attention-output error of the candidate format on the observation
   window; a format over the policy's bound is refused and the next milder one is tried.
2. **Canary** (`evaluate_canary`): fixed prompts whose reference log-probs were taken
   uncompressed are rerun under the live policy; mean KL(reference || live) and top-1 agreement
   are compared with the policy's limits.
3. **Live drift** (`drift_test`): token log-probs and entropies of compressed requests are
   compared with an uncompressed holdout share by a one-sided Mann-Whitney U test each.

Each returns a `ProbeResult` whose `passed` feeds the fallback ladder (`proxima.policy.fallback`).
Everything is numpy only: scipy is present on some machines, not all, and the tests check the
U test against scipy where it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

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


def _rank_with_ties(x: np.ndarray) -> tuple[np.ndarray, float]:
    """Average ranks (1-based) and the tie term sum(t^3 - t) used by the variance correction."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # Boundaries of runs of equal values.
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    counts = np.diff(np.r_[starts, x.size])
    avg = starts + (counts + 1) / 2.0  # average of ranks start+1 .. start+count
    ranks = np.empty(x.size)
    ranks[order] = np.repeat(avg, counts)
    return ranks, float(np.sum(counts.astype(np.float64) ** 3 - counts))


def mann_whitney_less(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """One-sided Mann-Whitney U test of H1 "a tends to be smaller than b".

    Returns (U statistic of `a`, p-value) using the normal approximation with tie correction and
    continuity correction (as scipy's `method="asymptotic"`); the windows here are >= 10 per side,
    where it is accurate. Chosen over Welch's t because token log-probs are heavy-tailed.
    """
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    n1, n2 = a.size, b.size
    if n1 == 0 or n2 == 0:
        raise ValueError(f"mann_whitney_less: both samples need values, got {n1} and {n2}")
    ranks, ties = _rank_with_ties(np.concatenate([a, b]))
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2.0)
    n = n1 + n2
    mean = n1 * n2 / 2.0
    var = n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:  # every value equal: no evidence either way
        return u1, 1.0
    z = (u1 - mean + 0.5) / math.sqrt(var)  # +0.5: continuity correction towards the null
    return u1, 0.5 * math.erfc(-z / math.sqrt(2.0))  # P(Z <= z)


@dataclass(frozen=True)
class DriftSample:
    """Per-token measurements of one population (compressed requests, or the holdout)."""

    logprob: np.ndarray
    """Log-prob of each generated token, `[N]`."""
    entropy: np.ndarray
    """Entropy of the next-token distribution at each generated token, `[N]`."""


def drift_test(compressed: DriftSample, holdout: DriftSample, cfg: DriftProbe) -> ProbeResult:
    """Has compression made the model less sure of its own tokens?

    Two one-sided tests: compressed log-probs lower than the holdout's, and compressed entropies
    higher. Bonferroni: each is run at p_value / 2 so the probe's false-alarm rate stays at the
    policy's `p_value`. Tokens within a request are correlated, which makes the test somewhat
    liberal; callers should pass per-request means when requests are long (the ladder also needs
    `failures_to_step_down` failures in a row, which damps false alarms further).
    """
    _, p_lp = mann_whitney_less(compressed.logprob, holdout.logprob)
    _, p_ent = mann_whitney_less(-compressed.entropy, -holdout.entropy)
    alpha = cfg.p_value / 2.0
    why = []
    if p_lp < alpha:
        why.append(f"token log-prob lower than holdout (p={p_lp:.2g})")
    if p_ent < alpha:
        why.append(f"entropy higher than holdout (p={p_ent:.2g})")
    values = {
        "p_logprob": p_lp,
        "p_entropy": p_ent,
        "delta_logprob": float(np.mean(compressed.logprob) - np.mean(holdout.logprob)),
        "delta_entropy": float(np.mean(compressed.entropy) - np.mean(holdout.entropy)),
    }
    return ProbeResult(
        "drift",
        passed=not why,
        values=values,
        detail="; ".join(why) or f"no significant drift (p={min(p_lp, p_ent):.2g})",
    )


__all__ = [
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
]
