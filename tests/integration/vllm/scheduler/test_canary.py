"""Canary requests on a real vLLM `KVCacheManager` turned into Proxima's (no engine), and their verdict."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from vllm.logprobs import Logprob

from proxima.integration.vllm.scheduler import canary
from proxima.policy.loader import load_policy
from proxima.policy.schema import CanaryProbe
from tests.integration.vllm.scheduler.test_live_control import B, _manager, _prefilled

ROOT = Path(__file__).resolve().parents[4]


def test_canaries_are_compressed_without_pressure_and_references_never() -> None:
    policy = load_policy(ROOT / "proxima" / "policies" / "conservative.yaml")  # compresses from 80% pressure
    policy = policy.model_copy(update={"protect": policy.protect.model_copy(update={"sink_tokens": 0,
                                                                                    "recent_tokens": 0})})
    m = _manager(policy, blocks=64)  # 3 requests of 7 blocks: about 30% used, far below every band
    for rid in ("user-1", f"{canary.REFERENCE_PREFIX}0-x", f"{canary.CANARY_PREFIX}0-x"):
        _prefilled(m, rid, 6 * B)
    assert m.px.probes.canaries == 2
    plan = m.build_plan(["user-1", f"{canary.REFERENCE_PREFIX}0-x", f"{canary.CANARY_PREFIX}0-x"])
    assert plan.actions and {a.req_id for a in plan.actions} == {f"{canary.CANARY_PREFIX}0-x"}
    # The top band's ladder (conservative's `high`: int4), as if the pool were full.
    assert {a.fmt.name for a in plan.actions} == {"int4"}
    assert m.px.engine.active_band is None, "a canary does not move the engine's band"
    m.free(m.px.ledger[f"{canary.CANARY_PREFIX}0-x"].request)
    assert m.px.probes.canaries == 1
    m.check_accounting()


def _entry(lps: dict[int, float]) -> dict[int, Logprob]:
    ranked = sorted(lps, key=lambda t: -lps[t])
    return {t: Logprob(lps[t], rank=ranked.index(t) + 1) for t in lps}


def test_canary_verdict_from_top_k_prompt_logprobs() -> None:
    cfg = CanaryProbe(enabled=True, max_kl=0.05, min_top1=0.9)
    ref = [None, _entry({1: math.log(0.7), 2: math.log(0.2)}), _entry({3: math.log(0.9), 4: math.log(0.05)})]
    same = canary.evaluate([ref], [ref], cfg)
    assert same.passed and same.values["kl"] == pytest.approx(0.0, abs=1e-9) and same.values["top1"] == 1.0
    # The live run prefers another token at the second position: top-1 drops to 0.5, KL grows.
    live = [None, ref[1], _entry({4: math.log(0.6), 3: math.log(0.3)})]
    bad = canary.evaluate([ref], [live], cfg)
    assert not bad.passed and bad.values["top1"] == 0.5 and bad.values["kl"] > 0.05
    # The live top-1 outside the reference's top-k is a bin of its own (top-1 is exact).
    live2 = [None, ref[1], _entry({9: math.log(0.5), 3: math.log(0.45)})]
    r_bins, l_bins = canary.logprob_bins(ref, live2)
    assert r_bins.shape == l_bins.shape == (2, canary.TOP_K + 2)
    assert canary.evaluate([ref], [live2], cfg).values["top1"] == 0.5
