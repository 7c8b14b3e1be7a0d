"""The canary runner's schedule against a real runtime API (a `LiveControl` serving a real KV
manager over HTTP, through the product's `RuntimeApi`), with a transport that answers from
prompt log-probs given here; the runner over real engines runs in `test_serve_e2e.py` (HTTP) and
`test_fallback_e2e.py` (an engine the bench steps). Also `proxima serve`'s own decisions: the
server address from vLLM's arguments, priority scheduling, a blank token refused before vLLM starts.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxima.integration.vllm.scheduler.canary import CANARY_PREFIX, REFERENCE_PREFIX, prefill_chunk_tokens
from proxima.integration.vllm.scheduler.live import LiveControl
from proxima.integration.vllm.serve import supervisor as serve
from proxima.integration.vllm.serve.canary_runner import CanaryRunner, RuntimeApi, canary_prompts
from proxima.policy.loader import load_policy
from tests.integration.vllm.scheduler.test_live_control import TOKEN, _free_port, _manager, _prefilled, _served

HERE = Path(__file__).parents[1]
PROXIMA = Path(sys.executable).with_name("proxima")


def _rows(p_top: float) -> list[dict[int, dict[str, float]]]:
    """Prompt log-probs as the completions endpoint returns them (token id strings)."""
    row = {"5": {"logprob": math.log(p_top), "rank": 1}, "6": {"logprob": math.log((1 - p_top) / 2), "rank": 2}}
    return [None, *[row] * 8]  # type: ignore[list-item]


class Answers:
    """A transport whose requests finish at the next poll with fixed rows (references: confident;
    live runs: `live`), or raise `error`."""

    def __init__(self) -> None:
        self.live: Sequence[Mapping[Any, Any] | None] = _rows(0.9)
        self.submitted: list[str] = []
        self.error: Exception | None = None

    def submit(self, request_id: str, prompt: str) -> None:
        self.submitted.append(request_id)

    def poll(self, request_id: str) -> Sequence[Mapping[Any, Any] | None] | None:
        if self.error is not None:
            raise self.error
        return _rows(0.9) if request_id.startswith(REFERENCE_PREFIX) else self.live


def _policy_with_canary() -> Any:
    p = load_policy(HERE / "force-int4.yaml")
    canary = p.probes.canary.model_copy(update={"enabled": True, "interval_s": 0.5})
    fallback = p.fallback.model_copy(update={"failures_to_step_down": 2})
    return p.model_copy(update={"probes": p.probes.model_copy(update={"canary": canary}), "fallback": fallback})


def test_the_runner_schedules_rounds_and_its_verdicts_move_the_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROXIMA_API_TOKEN", TOKEN)
    now = [0.0]
    with _served(_manager(_policy_with_canary())) as (live, api):
        t = Answers()
        runner = CanaryRunner(["a", "b"], t, RuntimeApi(str(api.base_url), TOKEN), clock=lambda: now[0])
        runner.tick()  # references for the live version first
        assert t.submitted == [f"{REFERENCE_PREFIX}1-0", f"{REFERENCE_PREFIX}1-1"]
        assert runner.tick() is None and runner.references is not None  # collected; no verdict from references
        runner.tick()  # the live round at once
        assert t.submitted[2:] == [f"{CANARY_PREFIX}2-0", f"{CANARY_PREFIX}2-1"]
        ok = runner.tick()
        assert ok is not None and ok.passed and ok.values["kl"] == pytest.approx(0.0, abs=1e-9)
        stats = api.get("/v1/stats").json()["probes"]["canary"]
        assert stats["passed"] and stats["values"]["policy_version"] == 1.0
        runner.tick()
        assert len(t.submitted) == 4, "the next live round waits for the interval"
        # A damaged live run: the top token loses its lead; two failures step the ladder down.
        t.live = [None, *[{"5": {"logprob": math.log(0.2), "rank": 2}, "6": {"logprob": math.log(0.7), "rank": 1}}] * 8]
        for _ in range(2):
            now[0] += 1.0
            runner.tick()
            bad = runner.tick()
            assert bad is not None and not bad.passed and bad.values["top1"] == 0.0
        assert live.controller.fallback_state()["level"] == 1
        alerts = api.get("/v1/alerts").json()["alerts"]
        assert any(a["kind"] == "fallback_step_down" and a["details"]["probe"]["kind"] == "canary" for a in alerts)
        # A policy change: new references before the next live round.
        assert api.patch("/v1/policy", json={"budget": {"max_blocks_per_step": 9}},
                         headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        now[0] += 1.0
        n = len(t.submitted)
        runner.tick()
        assert t.submitted[n:] and all(r.startswith(REFERENCE_PREFIX) for r in t.submitted[n:])
        runner.tick()
        runner.tick()
        r = runner.tick()
        assert r is not None and r.values["policy_version"] == 2.0


def test_a_round_straddling_a_policy_change_is_dropped_and_errors_are_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PROXIMA_API_TOKEN", TOKEN)
    now = [0.0]
    with _served(_manager(_policy_with_canary())) as (live, api):
        t = Answers()
        runner = CanaryRunner(["a"], t, RuntimeApi(str(api.base_url), TOKEN), clock=lambda: now[0])
        runner.tick()
        runner.tick()
        runner.tick()  # live round of v1 in flight
        api.patch("/v1/policy", json={"budget": {"max_blocks_per_step": 9}},
                  headers={"Authorization": f"Bearer {TOKEN}"})
        assert runner.tick() is None and not runner.verdicts  # measured v1, the policy is v2: dropped
        runner.tick()
        assert t.submitted[-1].startswith(REFERENCE_PREFIX)
        t.error = RuntimeError("server gone")
        assert runner.tick() is None and runner.last_error == "RuntimeError: server gone" and runner.round is None
        t.error = None
        runner.tick()
        assert runner.round is None, "waits RETRY_S before the next try"
        assert live.controller.probes()["probes"]["canary"]["passes"] == 0


@pytest.mark.parametrize("chunk_tokens", [512, 128])
def test_a_canary_prefilled_in_one_step_is_said_to_measure_nothing_and_not_scored(
    monkeypatch: pytest.MonkeyPatch, chunk_tokens: int,
) -> None:
    """vLLM's default step budget prefills a 320-token canary at once: none of its blocks can be
    compressed before its log-probs exist, so its verdict would pass for nothing."""
    monkeypatch.setenv("PROXIMA_API_TOKEN", TOKEN)
    now = [0.0]
    m = _manager(_policy_with_canary(), blocks=40)
    live = LiveControl(m, m.px.policy, "127.0.0.1", _free_port(), canary_chunk_tokens=chunk_tokens)
    live.start()
    try:
        with httpx.Client(base_url=f"http://{live.host}:{live.port}", timeout=10) as api:
            assert api.get("/v1/stats").json()["probe_progress"]["canary"] == {"chunk_tokens": chunk_tokens}
            t = Answers()
            runner = CanaryRunner(["a"], t, RuntimeApi(str(api.base_url), TOKEN), clock=lambda: now[0])
            runner.tick()
            runner.tick()  # references collected
            runner.tick()  # the live round: the engine admits its request
            live.before_plan()
            _prefilled(m, t.submitted[-1], 320)
            m.build_plan([t.submitted[-1]])
            live.after_plan()
            canary = api.get("/v1/stats").json()["probe_progress"]["canary"]
            measurable = chunk_tokens < 320
            assert canary["prompt_tokens"] == 320 and canary["measurable"] is measurable
            got = runner.tick()
            if measurable:
                assert canary["problem"] is None and got is not None and runner.cannot_measure is None
            else:
                assert "--max-num-batched-tokens" in canary["problem"] and "320 tokens" in canary["problem"]
                assert got is None and not runner.verdicts and runner.status()["cannot_measure"] == canary["problem"]
                assert live.controller.probes()["probes"]["canary"]["passes"] == 0
    finally:
        live.stop()


def test_the_chunk_size_is_vllms_step_budget_or_its_long_prefill_threshold() -> None:
    def config(budget: int, threshold: int = 0, chunked: bool = True) -> Any:
        sc = type("S", (), {"max_num_batched_tokens": budget, "long_prefill_token_threshold": threshold,
                            "enable_chunked_prefill": chunked})()
        return type("C", (), {"scheduler_config": sc, "model_config": type("M", (), {"max_model_len": 4096})()})()

    assert prefill_chunk_tokens(config(2048)) == 2048
    assert prefill_chunk_tokens(config(2048, 256)) == 256
    assert prefill_chunk_tokens(config(128, 256)) == 128
    assert prefill_chunk_tokens(config(128, chunked=False)) == 4096


def test_canary_prompts_come_from_the_bundled_corpus() -> None:
    prompts = canary_prompts()
    assert len(prompts) == 2 and len(set(prompts)) == 2
    assert all(1200 <= len(p) <= 1400 and not p.endswith(" ") for p in prompts)


def test_server_address_and_priority_scheduling_from_vllms_arguments() -> None:
    srv = serve.server_args(["--host", "0.0.0.0", "--port=9001", "--api-key", "k"], {})
    assert srv == serve.ServerArgs("http://127.0.0.1:9001", "k", False)
    assert serve.server_args([], {"VLLM_API_KEY": "e"}) == serve.ServerArgs("http://127.0.0.1:8000", "e", False)
    args = serve.with_priority_scheduling(["--port", "9001"])
    assert args == ["--port", "9001", "--scheduling-policy", "priority"]
    assert serve.server_args(args, {}).priority_scheduling
    assert serve.with_priority_scheduling(["--scheduling-policy=fcfs"]) == ["--scheduling-policy=fcfs"]


def test_serve_refuses_a_blank_token_before_starting_vllm() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")} | {"PROXIMA_API_TOKEN": "  ",
                                                                                    "COLUMNS": "400"}
    r = subprocess.run([str(PROXIMA), "serve", "--model", "/m", "--api-port", "9123"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert "PROXIMA_API_TOKEN is set but empty or only whitespace" in r.stderr and "Traceback" not in r.stderr
    assert "vllm_main" not in r.stderr and "serve /m" not in r.stderr  # vLLM was never started


def test_a_refused_verdict_keeps_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """A verdict the API refuses (here: a wrong token, 403) is logged and lost; the next round still
    waits for the policy's interval, not for the short retry delay (which would replay canaries
    every few seconds for as long as the token is wrong)."""
    monkeypatch.setenv("PROXIMA_API_TOKEN", TOKEN)
    now = [0.0]
    policy = _policy_with_canary()
    policy = policy.model_copy(update={"probes": policy.probes.model_copy(
        update={"canary": policy.probes.canary.model_copy(update={"interval_s": 600.0})})})
    with _served(_manager(policy)) as (_live, api):
        t = Answers()
        runner = CanaryRunner(["a"], t, RuntimeApi(str(api.base_url), "not-the-token"), clock=lambda: now[0])
        for _ in range(4):  # references, collected, live round, its verdict refused
            runner.tick()
        assert runner.last_error is not None and not runner.verdicts
        n = len(t.submitted)
        now[0] += 60.0  # well past the retry delay, well before the interval
        runner.tick()
        assert len(t.submitted) == n, "a refused POST must not shorten the interval"
        now[0] += 600.0
        runner.tick()
        assert len(t.submitted) > n
