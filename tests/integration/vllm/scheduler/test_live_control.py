"""The runtime API over a real vLLM `KVCacheManager` turned into Proxima's (no engine: no model, no workers).

The test plays the engine thread itself: it calls the connector's per-step hooks in the order
vLLM does (`before_plan`, `build_plan`, `after_plan`, `commit`) and talks to the API over HTTP.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from proxima.formats import HOT, Format
from proxima.integration.vllm.plan import ProximaReport
from proxima.integration.vllm.scheduler.live import API_HOST_ENV, API_PORT_ENV, LiveControl, api_address
from proxima.integration.vllm.scheduler.manager import ProximaKVCacheManager, install
from proxima.policy.loader import load_policy
from proxima.policy.schema import Policy

INT8, INT4 = Format.parse("int8"), Format.parse("int4")

HERE = Path(__file__).parents[1]
B = 32  # tokens per block (the KIVI group of the int4 side table needs a multiple of 32)
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _manager(policy: Policy, blocks: int = 16) -> ProximaKVCacheManager:
    spec = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])
    m = install(
        KVCacheManager(cfg, max_model_len=512, scheduler_block_size=B, hash_block_size=B, enable_caching=False), policy
    )
    assert m is not None
    return m


def _prefilled(m: ProximaKVCacheManager, rid: str, tokens: int) -> Request:
    req = Request(rid, list(range(1, tokens + 1)), SamplingParams(max_tokens=8), None)
    assert m.allocate_slots(req, tokens) is not None
    req.num_computed_tokens = tokens  # as if the forward pass of the prefill ran
    assert m.allocate_slots(req, 1) is not None  # the first decode step's token opens one more block
    return req


def _step(live: LiveControl, m: ProximaKVCacheManager, rids: list[str], ok: bool = True) -> int:
    """One engine step as the connector drives it; returns the actions planned."""
    live.before_plan()
    plan = m.build_plan(rids)
    live.after_plan()
    ids = [a.action_id for a in plan.actions]
    live.commit(ProximaReport(ok=ids) if ok else ProximaReport(failed=ids, errors=["RuntimeError: test"]))
    return len(ids)


def test_api_address_from_policy_and_environment() -> None:
    off = Policy(enabled=False)
    assert api_address(off, {}) is None
    assert api_address(off, {API_PORT_ENV: "9100"}) == ("127.0.0.1", 9100)
    assert api_address(off, {API_PORT_ENV: "9100", API_HOST_ENV: "0.0.0.0"}) == ("0.0.0.0", 9100)
    on = off.model_copy(update={"api": off.api.model_copy(update={"enabled": True, "port": 9200})})
    assert api_address(on, {}) == ("127.0.0.1", 9200)
    with pytest.raises(ValueError, match=API_PORT_ENV):
        api_address(off, {API_PORT_ENV: "http"})


@contextlib.contextmanager
def _served(m: ProximaKVCacheManager) -> Iterator[tuple[LiveControl, httpx.Client]]:
    """The runtime API serving `m` on a free port, and a client for it; both stopped after."""
    live = LiveControl(m, m.px.policy, "127.0.0.1", _free_port())
    live.start()
    api = httpx.Client(base_url=f"http://{live.host}:{live.port}", timeout=10)
    try:
        yield live, api
    finally:
        api.close()
        live.stop()


def test_live_control_swaps_policy_reports_steps_and_publishes_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROXIMA_API_TOKEN", TOKEN)
    m = _manager(load_policy(HERE / "force-int4.yaml"))
    with _served(m) as (live, api):
        _prefilled(m, "a", 6 * B)  # 6 full blocks and the hot tail block (never compressed): 7 logical
        s0 = api.get("/v1/stats").json()
        assert s0["blocks_by_format"] == {}, "stats are what the engine published, not a read of live state"

        planned = _step(live, m, ["a"])
        s1 = api.get("/v1/stats").json()
        assert planned > 0 and s1["step"] == 1 and s1["applied_policy_version"] == 1
        assert s1["blocks_by_format"].get("int4") == planned and s1["blocks_by_format"]["bf16"] == 7 - planned
        # int4 packs 4 slots per block: the destinations hold `planned` slots, the rest is fragmentation.
        dests = -(-planned // 4)
        # (the blocks held back for the side tables are their meta_bytes, not owned KV blocks)
        side = len(m.px.charge.held)
        assert s1["owned_blocks"] == 7 - planned + dests and s1["free_blocks"] + s1["owned_blocks"] + side == 15
        assert s1["fragmentation_blocks"] == pytest.approx(dests - planned / 4)
        # Ratios are bytes: the int4 slots' side-table metadata counts against the savings.
        assert s1["meta_bytes"] > 0
        assert s1["saved_bytes"] == (7 - s1["owned_blocks"]) * s1["block_bytes"] - s1["meta_bytes"]
        held = s1["owned_blocks"] * s1["block_bytes"] + s1["meta_bytes"]
        assert s1["effective_compression"] == pytest.approx(7 * s1["block_bytes"] / held, rel=1e-5)
        assert s1["effective_compression"] < s1["nominal_compression"]

        # Disable compression through the API: the very next step plans under it.
        assert api.patch("/v1/policy", json={"enabled": False}).status_code == 401
        r = api.patch("/v1/policy", json={"enabled": False}, headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == 2
        assert m.px.policy.enabled, "the engine thread adopts a change, not the API thread"
        _prefilled(m, "b", 6 * B)
        assert _step(live, m, ["a", "b"]) == 0 and not m.px.policy.enabled
        s2 = api.get("/v1/stats").json()
        assert s2["applied_policy_version"] == 2 and s2["policy_version"] == 2
        assert s2["blocks_by_format"]["bf16"] == 14 - planned

        # Roll back: compression resumes; a failing worker batch is counted as an error.
        assert api.post("/v1/policy/rollback", json={"version": 1}, headers=AUTH).json()["version"] == 3
        failed = _step(live, m, ["a", "b"], ok=False)
        assert failed > 0 and m.px.stats.failed == failed

        # The operator's fallback pin reaches the engine state at the next step.
        levels = len(m.px.policy.fallback.levels)
        r = api.post("/v1/fallback", json={"level": levels - 1}, headers=AUTH)
        assert r.status_code == 200
        assert levels > 1
        committed = planned + _step(live, m, ["a", "b"])
        assert m.px.engine.fallback_level == levels - 1

        metrics = api.get("/metrics").text
        assert "proxima_engine_steps_total 4.0" in metrics
        assert f'proxima_engine_decisions_total{{action="compress",format="int4"}} {float(committed)}' in metrics
        assert f'proxima_engine_compression_errors_total{{reason="kernel"}} {float(failed)}' in metrics
        assert "proxima_policy_version 3.0" in metrics
        m.check_accounting()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # uvicorn's SystemExit
def test_busy_port_fails_loudly() -> None:
    m = _manager(Policy(enabled=False))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        live = LiveControl(m, m.px.policy, "127.0.0.1", taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="could not start"):
            live.start()


def test_every_step_is_reported_once_even_when_reports_arrive_late() -> None:
    # vLLM's async scheduling may plan step N+1 before step N's worker report arrives.
    m = _manager(load_policy(HERE / "force-int4.yaml"))
    live = LiveControl(m, m.px.policy, "127.0.0.1", 0)  # not started: the hooks need no server
    _prefilled(m, "a", 6 * B)
    steps = live.controller.metrics.steps
    live.before_plan()
    ids = [a.action_id for a in m.build_plan(["a"]).actions]
    live.after_plan()
    live.before_plan()  # step 2 planned before step 1's report: step 1 is reported (empty)
    m.build_plan(["a"])
    live.after_plan()
    assert steps._value.get() == 1
    live.commit(ProximaReport(ok=ids))  # step 1's report closes step 2
    live.commit(ProximaReport())  # a report with no open step: carried, not a step of its own
    assert steps._value.get() == 2
    decisions = live.controller.metrics.decisions.labels(action="compress", format="int4")
    assert ids and decisions._value.get() == len(ids)
    live.before_plan()
    m.build_plan(["a"])
    live.after_plan()
    live.before_plan()  # the step with no worker report is reported at the next step's start
    assert steps._value.get() == 3


def test_failing_compressions_back_off_with_one_alert_then_resume() -> None:
    """Every batch fails for 60 steps, then the fault clears: the manager stops re-planning the
    doomed compressions (growing pauses), the controller raises one alert and counts every pause,
    and compression resumes by itself."""
    m = _manager(load_policy(HERE / "force-int4.yaml"))
    live = LiveControl(m, m.px.policy, "127.0.0.1", 0)  # hooks only, no server
    _prefilled(m, "a", 6 * B)
    per_step = [_step(live, m, ["a"], ok=False) for _ in range(60)]
    attempts = [i for i, n in enumerate(per_step) if n]
    assert per_step[0] > 1 and attempts == [0, 5, 14, 31], per_step  # pauses of 4, 8, 16, then 32 steps
    assert sum(per_step) == per_step[0] + 3  # each retry is a one-block probe (instead of 60 x per_step[0])
    assert m.summary()["backoff"]["formats"]["int4"]["failures"] == len(attempts)
    alerts = live.controller.alerts.recent()
    assert [(a.kind, a.severity) for a in alerts] == [("compression_backoff", "warning")]
    assert alerts[0].details["format"] == "int4" and "paused for 4 steps" in alerts[0].message
    metrics = live.controller.metrics
    assert metrics.compression_backoffs.labels(format="int4")._value.get() == len(attempts)
    assert metrics.compression_backoff_formats._value.get() == 1
    # The fault is gone: the next probe batch commits, and compression goes on as before.
    committed = [_step(live, m, ["a"]) for _ in range(40)]
    first = next(i for i, n in enumerate(committed) if n)
    assert first == 4 and committed[first:first + 2] == [1, per_step[0] - 1]  # paused to step 65; a probe; the rest
    assert m.px.stats.committed == sum(committed)
    assert m.summary()["backoff"]["formats"] == {} and metrics.compression_backoff_formats._value.get() == 0
    assert len(live.controller.alerts.recent()) == 1
    m.check_accounting()


def test_a_policy_change_reaches_the_worker_with_the_next_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROXIMA_API_TOKEN", TOKEN)
    m = _manager(load_policy(HERE / "force-int4.yaml"))
    with _served(m) as (live, api):
        _prefilled(m, "a", 2 * B)
        live.before_plan()
        plan = m.build_plan(["a"])
        assert plan.policy is None and plan.policy_version == 0  # the worker loaded the startup policy itself
        r = api.patch("/v1/policy", json={"importance": {"observation_window": 7}}, headers=AUTH)
        assert r.status_code == 200
        live.before_plan()
        plan = m.build_plan(["a"])
        assert plan.policy_version == 2 and plan.policy is not None
        assert plan.policy.importance.observation_window == 7
        live.before_plan()
        later = m.build_plan(["a"])
        assert later.policy is None and later.policy_version == 2  # sent once


def test_refused_blocks_are_replanned_milder_and_refusals_step_the_ladder_down() -> None:
    """The worker's probe refuses every int4 block (naming int8, within the bound): the manager
    plans those blocks as int8 next, and the steps' verdicts move the ladder by themselves."""
    policy = load_policy(HERE / "force-int4.yaml")
    band = policy.bands[0].model_copy(update={"ladder": [INT4, INT8]})
    probes = policy.probes.model_copy(update={"compression": policy.probes.compression.model_copy(
        update={"enabled": True, "window_blocks": 4})})
    policy = policy.model_copy(update={"bands": [band], "probes": probes})
    m = _manager(policy, blocks=32)
    live = LiveControl(m, m.px.policy, "127.0.0.1", 0)  # hooks only, no server
    _prefilled(m, "a", 6 * B)
    live.before_plan()
    plan = m.build_plan(["a"])
    live.after_plan()
    assert plan.actions and {a.fmt.name for a in plan.actions} == {"int4"}
    refused = {a.action_id: INT8 for a in plan.actions}
    first = len(refused)
    live.commit(ProximaReport(rejected=refused, probe_errors=[(INT4, 0.3)] * len(refused) + [(INT8, 0.004)],
                              probe_measured_ids=list(refused), probe_refused_ids=list(refused), probe_seconds=0.001))
    assert m.px.stats.rejected == len(refused) and not m.px.in_flight and m.px.stats.failed == 0
    assert m.summary()["backoff"]["formats"] == {}, "a refusal is not a kernel failure"
    m.check_accounting()
    assert live.controller.fallback_state()["consecutive_failures"] == 1
    live.before_plan()
    plan = m.build_plan(["a"])
    live.after_plan()
    assert plan.actions and {a.fmt.name for a in plan.actions} == {"int8"}, "the cap the probe named"
    refused = {a.action_id: HOT for a in plan.actions}
    live.commit(ProximaReport(rejected=refused, probe_errors=[(INT8, 0.5)] * len(refused),
                              probe_measured_ids=list(refused), probe_refused_ids=list(refused)))
    st = live.controller.fallback_state()
    assert st["level"] == 1 and st["automatic_level"] == 1  # failures_to_step_down = 2
    alerts = live.controller.alerts.recent()
    assert [a.kind for a in alerts] == ["fallback_step_down"] and alerts[0].details["probe"]["kind"] == "compression"
    probes = live.controller.probes()["probes"]["compression"]
    assert probes["failures"] == 2 and probes["last"]["values"]["refused_fraction"] == 1.0
    metrics = live.controller.metrics
    assert metrics.probe_error.labels(format="int4")._sum.get() == pytest.approx(0.3 * first)
    assert metrics.probe_error.labels(format="int8")._sum.get() == pytest.approx(0.004 + 0.5 * len(refused))
    assert metrics.compression_rejected._value.get() == first + len(refused)
    live.before_plan()
    assert m.px.engine.fallback_level == 1
    assert not m.build_plan(["a"]).actions, "every block is capped at bf16 or refused: nothing left to try"
    m.check_accounting()


def test_a_block_not_measured_yet_is_planned_again_in_its_format() -> None:
    m = _manager(load_policy(HERE / "force-int4.yaml"))
    _prefilled(m, "a", 3 * B)
    plan = m.build_plan(["a"])
    assert plan.actions
    m.apply_report(ProximaReport(rejected={a.action_id: a.fmt for a in plan.actions}))  # the worker deferred them
    assert not m.px.ledger["a"].caps and not m.px.in_flight and m.px.stats.failed == 0
    again = m.build_plan(["a"])
    assert [(a.index, a.fmt) for a in again.actions] == [(a.index, a.fmt) for a in plan.actions]
    m.check_accounting()


def test_without_the_api_a_compressing_policy_still_gets_its_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_PORT_ENV, raising=False)
    off = _manager(Policy(enabled=False))
    assert LiveControl.from_env(off, off.px.policy, "initial") is None  # nothing of live.py runs
    m = _manager(load_policy(HERE / "force-int4.yaml"))
    live = LiveControl.from_env(m, m.px.policy, "initial")
    assert live is not None
    try:
        assert live._server is None and live.controller.webhook._thread is not None  # no HTTP, alerts delivered
        _prefilled(m, "a", 3 * B)
        assert _step(live, m, ["a"]) > 0 and live.controller.metrics.steps._value.get() == 1
    finally:
        live.stop()
