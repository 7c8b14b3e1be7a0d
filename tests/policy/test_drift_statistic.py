"""The drift verdict's statistic: requests are the units, a minimum per side, paired windows judged
by a paired test, and levels the window cannot reach refused by the policy schema."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from proxima.policy.probes import MIN_REQUESTS_PER_SIDE, DriftSample, drift_test, smallest_paired_p
from proxima.policy.schema import DriftProbe


def _pairs(rng: np.random.Generator, n: int, effect: float = 0.0) -> tuple[DriftSample, DriftSample]:
    """Per-request means of n pairs measured alike: each pair shares a large common part (its output
    positions: entropy right after a prompt is nats higher than later), plus a small own noise."""
    common = rng.choice([0.2, 1.5, 4.0], n) + rng.normal(0, 0.5, n)
    hold = DriftSample(-common + rng.normal(0, 0.1, n), common + rng.normal(0, 0.1, n))
    comp = DriftSample(-common + rng.normal(0, 0.1, n) - effect, common + rng.normal(0, 0.1, n) + effect)
    return comp, hold


def test_fewer_requests_than_the_minimum_give_no_verdict() -> None:
    n = MIN_REQUESTS_PER_SIDE - 1
    ok = DriftSample(np.zeros(MIN_REQUESTS_PER_SIDE), np.ones(MIN_REQUESTS_PER_SIDE))
    short = DriftSample(np.zeros(n), np.ones(n))
    cfg = DriftProbe(enabled=True)
    with pytest.raises(ValueError, match=f"holdout side has {n} requests, fewer than the {MIN_REQUESTS_PER_SIDE}"):
        drift_test(ok, short, cfg)
    with pytest.raises(ValueError, match="compressed side has 3 log-probs but 10 entropies"):
        drift_test(DriftSample(np.zeros(3), np.ones(10)), ok, cfg)
    with pytest.raises(ValueError, match="paired sides differ in size"):
        drift_test(ok, DriftSample(np.zeros(12), np.ones(12)), cfg, paired=True)
    with pytest.raises(ValueError, match="non-finite"):
        drift_test(DriftSample(np.r_[np.nan, np.zeros(9)], np.ones(10)), ok, cfg)


def test_paired_windows_keep_the_level() -> None:
    """Pairs measured alike (the scheduler's position-matched windows) under no effect: the paired
    verdict alarms at most at about its level."""
    rng = np.random.default_rng(0)
    cfg = DriftProbe(enabled=True, window=20, p_value=0.05)
    paired = [not drift_test(*_pairs(rng, 20), cfg, paired=True).passed for _ in range(1000)]
    # Expected <= 50 of 1000 (binomial sd ~7): 75 would be a level broken by half again.
    assert sum(paired) <= 75, sum(paired)


def test_the_paired_verdict_catches_a_small_consistent_effect() -> None:
    """0.3 nats a pair, far inside the 1.5-4 nats the pairs' positions spread the values: the paired
    test sees it; the unpaired one, swamped by that spread, does not."""
    rng = np.random.default_rng(1)
    cfg = DriftProbe(enabled=True, window=20, p_value=0.01)
    comp, hold = _pairs(rng, 20, effect=0.3)
    r = drift_test(comp, hold, cfg, paired=True)
    assert not r.passed and r.values["p_logprob"] < 0.005 and r.values["p_entropy"] < 0.005, r
    assert "entropy higher" in r.detail and r.values["delta_entropy"] == pytest.approx(0.3, abs=0.1)
    assert drift_test(comp, hold, cfg).passed
    # One-sided: the same effect the other way is no regression.
    assert drift_test(hold, comp, cfg, paired=True).passed


def test_identical_pairs_are_no_evidence() -> None:
    same = DriftSample(np.linspace(-2, 0, 10), np.linspace(0, 3, 10))
    r = drift_test(same, same, DriftProbe(enabled=True), paired=True)
    assert r.passed and r.values["p_logprob"] == 1.0 and r.values["p_entropy"] == 1.0


def test_a_level_the_window_cannot_reach_is_refused() -> None:
    assert smallest_paired_p(10) == pytest.approx(2.0 ** -10)
    with pytest.raises(ValidationError, match=r"p_value 0\.001 cannot be reached with window 10"):
        DriftProbe(enabled=True, window=10, p_value=0.001)
    DriftProbe(enabled=True, window=20, p_value=2e-4)  # 1e-4 per test > 2^-20
    DriftProbe(enabled=False, window=10, p_value=0.001)  # off: nothing to reach


def test_a_window_of_all_pairs_one_way_fails_at_the_smallest_reachable_level() -> None:
    n = 20
    hold = DriftSample(np.linspace(-2, -1, n), np.linspace(1, 2, n))
    comp = DriftSample(hold.logprob - np.linspace(0.01, 0.2, n), hold.entropy + 0.01)
    cfg = DriftProbe(enabled=True, window=n, p_value=2e-4)
    r = drift_test(comp, hold, cfg, paired=True)
    assert not r.passed and r.values["p_logprob"] == pytest.approx(smallest_paired_p(n))
