"""Quality probes: the compression-time bound, the canary's KL and top-1, the drift test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats  # with scikit-learn (a dependency): a missing one fails the run, never skips
from hypothesis import given, settings
from hypothesis import strategies as st

from proxima.formats import Format
from proxima.policy.probes import (
    DriftSample,
    choose_within_bound,
    drift_test,
    entropy,
    evaluate_canary,
    kl_per_position,
    mann_whitney_less,
    relative_error,
)
from proxima.policy.schema import CanaryProbe, CompressionProbe, DriftProbe

INT2, INT4, INT8 = Format.parse("int2"), Format.parse("int4"), Format.parse("int8")


# -- compression-time probe ------------------------------------------------------------------------


def test_relative_error() -> None:
    ref = np.ones((4, 3, 8))
    assert relative_error(ref, ref) == 0.0
    assert relative_error(ref, ref * 1.1) == pytest.approx(0.1)
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_error(np.zeros(3), np.ones(3)) == math.inf
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(np.zeros(3), np.zeros(4))


def test_too_lossy_format_falls_back_to_milder() -> None:
    cfg = CompressionProbe(max_error={"int2": 0.3, "int4": 0.05, "int8": 0.01})
    errors = {INT2: 0.5, INT4: 0.08, INT8: 0.004}
    v = choose_within_bound([INT2, INT4, INT8], errors.__getitem__, cfg)
    assert v.chosen == INT8
    assert v.rejected == [INT2, INT4]
    assert [a[0] for a in v.attempts] == [INT2, INT4, INT8]
    r = v.result()
    assert r.kind == "compression" and not r.passed and r.values["rejected"] == 2


def test_nothing_within_bound_leaves_block_alone() -> None:
    v = choose_within_bound([INT4], lambda f: float("nan"), CompressionProbe())
    assert v.chosen is None and v.rejected == [INT4]


def test_first_candidate_within_bound_is_taken_without_measuring_others() -> None:
    measured = []
    v = choose_within_bound([INT4, INT8], lambda f: measured.append(f) or 0.0, CompressionProbe())
    assert v.chosen == INT4 and measured == [INT4] and v.result().passed


def test_disabled_probe_measures_nothing() -> None:
    v = choose_within_bound([INT2], lambda f: 1 / 0, CompressionProbe(enabled=False))
    assert v.chosen == INT2 and v.attempts == ()


# -- canary ----------------------------------------------------------------------------------------


def _logprobs(rng: np.random.Generator, t: int, v: int) -> np.ndarray:
    x = rng.standard_normal((t, v)) * 3
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_kl_matches_definition_and_is_zero_for_identical() -> None:
    rng = np.random.default_rng(0)
    p, q = _logprobs(rng, 5, 7), _logprobs(rng, 5, 7)
    expected = (np.exp(p) * (p - q)).sum(-1)
    np.testing.assert_allclose(kl_per_position(p, q), expected, rtol=1e-12)
    np.testing.assert_allclose(kl_per_position(p, p), 0.0, atol=1e-12)
    # Logits give the same answer as log-probs (normalisation is idempotent).
    np.testing.assert_allclose(kl_per_position(p + 5.0, q - 2.0), expected, rtol=1e-9)
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        kl_per_position(p, q[:3])


def test_canary_passes_identical_and_fails_damaged() -> None:
    rng = np.random.default_rng(1)
    ref = [_logprobs(rng, 20, 50) for _ in range(3)]
    cfg = CanaryProbe(max_kl=0.05, min_top1=0.9)
    ok = evaluate_canary(ref, [r.copy() for r in ref], cfg)
    assert ok.passed and ok.values["kl"] == pytest.approx(0.0, abs=1e-12) and ok.values["top1"] == 1.0
    bad = evaluate_canary(ref, [r + rng.standard_normal(r.shape) * 3 for r in ref], cfg)
    assert not bad.passed and bad.values["kl"] > 0.05
    assert "mean KL" in bad.detail
    with pytest.raises(ValueError):
        evaluate_canary(ref, ref[:2], cfg)


def test_top1_alone_can_fail_the_canary() -> None:
    # Two nearly tied tokens swapped: tiny KL, but every top-1 disagrees.
    ref = np.log(np.array([[0.501, 0.499]] * 10))
    live = np.log(np.array([[0.499, 0.501]] * 10))
    r = evaluate_canary([ref], [live], CanaryProbe(max_kl=0.05, min_top1=0.95))
    assert r.values["kl"] < 1e-4 and r.values["top1"] == 0.0 and not r.passed
    assert "top-1" in r.detail


# -- drift -----------------------------------------------------------------------------------------


def test_entropy_uniform_and_peaked() -> None:
    assert entropy(np.log(np.full((1, 8), 1 / 8)))[0] == pytest.approx(math.log(8))
    assert entropy(np.array([[0.0, -1e9, -1e9]]))[0] == pytest.approx(0.0, abs=1e-9)


def test_mann_whitney_against_scipy() -> None:
    rng = np.random.default_rng(2)
    for n1, n2, shift, ties in [(30, 40, 0.0, False), (50, 20, -0.5, False), (25, 25, 0.3, True)]:
        a = rng.standard_normal(n1) + shift
        b = rng.standard_normal(n2)
        if ties:
            a, b = np.round(a), np.round(b)
        u, p = mann_whitney_less(a, b)
        ref = scipy.stats.mannwhitneyu(a, b, alternative="less", method="asymptotic", use_continuity=True)
        assert u == pytest.approx(ref.statistic)
        assert p == pytest.approx(ref.pvalue, rel=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=30), st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=30))
def test_mann_whitney_is_a_probability_and_u_in_range(a: list[float], b: list[float]) -> None:
    u, p = mann_whitney_less(np.array(a), np.array(b))
    assert 0.0 <= p <= 1.0
    assert 0.0 <= u <= len(a) * len(b)


def test_all_equal_samples_give_no_evidence() -> None:
    assert mann_whitney_less(np.ones(20), np.ones(20))[1] == 1.0


def _sample(rng: np.random.Generator, n: int, lp_shift: float = 0.0, ent_shift: float = 0.0) -> DriftSample:
    return DriftSample(logprob=-rng.exponential(1.0, n) + lp_shift, entropy=rng.gamma(2.0, 1.0, n) + ent_shift)


def test_drift_detects_lower_logprob_and_higher_entropy() -> None:
    rng = np.random.default_rng(3)
    cfg = DriftProbe(p_value=0.01)
    hold = _sample(rng, 200)
    r = drift_test(_sample(rng, 200, lp_shift=-0.5), hold, cfg)
    assert not r.passed and "log-prob" in r.detail and r.values["delta_logprob"] < 0
    r = drift_test(_sample(rng, 200, ent_shift=0.8), hold, cfg)
    assert not r.passed and "entropy" in r.detail
    # Better than the holdout is never a regression (one-sided).
    assert drift_test(_sample(rng, 200, lp_shift=+0.5, ent_shift=-0.5), hold, cfg).passed


def test_drift_false_alarm_rate_near_p_value() -> None:
    rng = np.random.default_rng(4)
    cfg = DriftProbe(p_value=0.05)
    alarms = sum(not drift_test(_sample(rng, 100), _sample(rng, 100), cfg).passed for _ in range(400))
    # Expected 5% (20 of 400); allow generous sampling noise but catch a broken test statistic.
    assert alarms <= 40


def test_compression_step_fails_only_when_many_blocks_were_refused() -> None:
    from proxima.policy.probes import compression_step

    cfg = CompressionProbe(max_refused_fraction=0.25)
    ok = compression_step([0.01, 0.02, 0.3, float("nan")], measured=4, refused=1, cfg=cfg)
    assert ok.kind == "compression" and ok.passed and ok.values["refused_fraction"] == 0.25
    assert ok.values["max_error"] == 0.3 and ok.values["nonfinite"] == 1.0
    bad = compression_step([0.4, 0.5], measured=2, refused=2, cfg=cfg)
    assert not bad.passed and "more than 25%" in bad.detail
    with pytest.raises(ValueError, match="no block"):
        compression_step([], measured=0, refused=0, cfg=cfg)
