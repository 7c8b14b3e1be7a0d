"""The canary runner: the requests of `canary.py`, submitted on a schedule, their verdict sent on.

One runner, used by `proxima serve` and by `bench/fallback.py` alike; only the way requests reach
an engine differs (a *transport*):

* `HttpTransport`: a running OpenAI-compatible vLLM server (`/v1/completions`, `max_tokens=1`,
  `prompt_logprobs`, the canary id as `request_id`, a low `priority` when the server schedules by
  priority). `proxima serve` runs the runner in a thread of its own process, next to vLLM's.
* `EngineTransport`: an in-process `LLMEngine` that the caller steps (bench, tests); the caller
  hands each step's outputs to `offer`.

The policy and the verdicts go through the runtime API (`RuntimeApi`: `GET /v1/policy`,
`POST /v1/probes`, where a verdict meets the ladder exactly as the engine's own probes do).

The schedule (`tick`, never blocking): with the canary enabled in the live policy (and the policy
on), a *reference* round for the live policy version (compression off: the engine never
compresses a reference), then a *live* round at once and every `probes.canary.interval_s` after
(compressed at the current ladder level regardless of pressure). A new policy version gets new
references before its next live round; a live round that straddles a version change measured
neither policy and is dropped, and so is every live round while the engine says its canaries
measure nothing (`Control.canary_problem`: prompts no longer than what vLLM prefills in one
step; logged, and in `status()`). One round is in flight at a time, so the canaries' share of the
engine is at most `len(prompts)` single-token requests per interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from proxima.integration.vllm.scheduler.canary import CANARY_PREFIX, REFERENCE_PREFIX, TOP_K, evaluate
from proxima.policy.probes import ProbeResult
from proxima.policy.schema import CanaryProbe

logger = logging.getLogger("proxima.canary")

PROMPTS = 2
PROMPT_CHARS = 1400
"""Canary prompts: the last `PROMPTS` articles of the bundled news corpus (gensim's Lee corpus,
`quality.datasets.lee_articles`) of at least this many characters, cut at a word before it
(about 300 SmolLM2 tokens: several compressible blocks between the protected sink and recent
ones, and more than one prefill chunk at `max_num_batched_tokens` 256)."""
CANARY_PRIORITY = 10
"""vLLM priority of a canary when the server schedules by priority (lower runs first; user
requests have 0)."""
RETRY_S = 5.0
"""After a failed round (server or API unreachable, an error answer), wait this long."""

Rows = Sequence[Mapping[Any, Any] | None]
"""One request's prompt log-probs, position by position (`canary.evaluate`'s input)."""


def canary_prompts(count: int = PROMPTS, chars: int = PROMPT_CHARS) -> list[str]:
    from proxima.quality.datasets import lee_articles

    long = [a for a in lee_articles() if len(a) >= chars][-count:]
    if len(long) < count:
        raise ValueError(f"canary: the corpus has {len(long)} articles of {chars}+ characters, {count} needed")
    return [a[:chars].rsplit(" ", 1)[0] for a in long]


class Transport(Protocol):
    def submit(self, request_id: str, prompt: str) -> None:
        """Start one canary request (`max_tokens=1`, `prompt_logprobs=TOP_K`); never blocks."""
        ...

    def poll(self, request_id: str) -> Rows | None:
        """Its prompt log-probs once it finished (then forgotten), else None; raises if it failed."""
        ...


class Control(Protocol):
    def canary_policy(self) -> tuple[int, bool, CanaryProbe]:
        """(live policy version, canary on (and the policy on), the canary settings)."""
        ...

    def report(self, result: ProbeResult) -> None: ...

    def canary_problem(self) -> str | None:
        """Why the engine's live canaries measure nothing (its prompts are prefilled in one step:
        `probe_progress.canary.problem`, `canary.chunking_problem`), or None."""
        ...


@dataclass
class _Round:
    tag: str
    version: int
    reference: bool
    started: float
    ids: list[str]
    rows: dict[str, Rows]


class CanaryRunner:
    def __init__(self, prompts: Sequence[str], transport: Transport, control: Control,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not prompts:
            raise ValueError("canary: no prompts")
        self.prompts = list(prompts)
        self.transport, self.control, self.clock = transport, control, clock
        self.references: tuple[int, list[Rows]] | None = None
        """(policy version, rows per prompt) of the last reference round."""
        self.round: _Round | None = None
        self.rounds = 0
        self.next_at = 0.0
        self.verdicts: list[dict[str, Any]] = []
        self.last_error: str | None = None
        self.cannot_measure: str | None = None
        """Why the last live round was not scored (the engine prefills canaries in one step)."""
        self._cfg = CanaryProbe()

    # -- one step of the schedule ------------------------------------------------------------------
    def tick(self) -> ProbeResult | None:
        """Advance the schedule; returns the verdict posted by this call, if any."""
        now = self.clock()
        try:
            if self.round is not None:
                return self._collect(now)
            if now >= self.next_at:
                self._start(now)
        except Exception as exc:  # a canary never takes the server down: log, wait, try again
            # max: a round that failed only at its verdict's POST keeps the interval it set (else a
            # refused POST, e.g. a missing token, would run a canary round every RETRY_S)
            self.round, self.next_at = None, max(self.next_at, now + RETRY_S)
            self.last_error = f"{type(exc).__name__}: {exc}"
            logger.warning("proxima: canary round failed (%s); next try in %.0f s", self.last_error, RETRY_S)
        return None

    def _start(self, now: float) -> None:
        version, enabled, cfg = self.control.canary_policy()
        self._cfg = cfg
        if not enabled:
            self.next_at = now + min(cfg.interval_s, RETRY_S)
            return
        reference = self.references is None or self.references[0] != version
        self.rounds += 1
        prefix = REFERENCE_PREFIX if reference else CANARY_PREFIX
        tag = f"{prefix}{self.rounds}-"
        ids = [f"{tag}{i}" for i in range(len(self.prompts))]
        self.round = _Round(tag, version, reference, now, ids, {})
        for rid, prompt in zip(ids, self.prompts, strict=True):
            self.transport.submit(rid, prompt)

    def _collect(self, now: float) -> ProbeResult | None:
        rnd = self.round
        assert rnd is not None
        for rid in rnd.ids:
            if rid not in rnd.rows and (got := self.transport.poll(rid)) is not None:
                rnd.rows[rid] = got
        if len(rnd.rows) < len(rnd.ids):
            return None
        self.round = None
        rows = [rnd.rows[rid] for rid in rnd.ids]
        if rnd.reference:
            self.references = (rnd.version, rows)
            return None  # the live round starts at the next tick
        self.next_at = now + self._cfg.interval_s
        version, _, cfg = self.control.canary_policy()
        assert self.references is not None
        if version != rnd.version or self.references[0] != rnd.version:
            logger.info("proxima: canary round of policy v%d dropped: the policy is at v%d now", rnd.version, version)
            self.next_at = now  # new references, then a live round of the new policy
            return None
        problem = self.control.canary_problem()
        if problem is not None:  # a verdict of a canary that measured nothing would pass for nothing
            if problem != self.cannot_measure:
                logger.warning("proxima: canary round of policy v%d not scored: %s", rnd.version, problem)
            self.cannot_measure = problem
            return None
        self.cannot_measure = None
        verdict = evaluate(self.references[1], rows, cfg)
        result = ProbeResult(verdict.kind, verdict.passed,
                             {**verdict.values, "policy_version": float(version), "round_s": now - rnd.started},
                             verdict.detail)
        self.control.report(result)
        self.last_error = None
        self.verdicts.append({"passed": result.passed, "values": result.values, "detail": result.detail})
        return result

    def status(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "in_flight": self.round is not None, "verdicts": len(self.verdicts),
                "reference_version": None if self.references is None else self.references[0],
                "last_error": self.last_error, "cannot_measure": self.cannot_measure}

    def run(self, stop: Callable[[], bool], period_s: float = 0.25) -> None:
        """Tick until `stop()` (a server's runner thread)."""
        while not stop():
            self.tick()
            time.sleep(period_s)


# -- the runtime API ------------------------------------------------------------------------------


class RuntimeApi:
    """`Control` over the runtime API's HTTP endpoints."""

    def __init__(self, base_url: str, token: str | None, timeout_s: float = 30.0) -> None:
        import httpx

        self.client = httpx.Client(base_url=base_url, timeout=timeout_s)
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}

    def canary_policy(self) -> tuple[int, bool, CanaryProbe]:
        r = self.client.get("/v1/policy")
        r.raise_for_status()
        doc = r.json()
        cfg = CanaryProbe.model_validate(doc["policy"]["probes"]["canary"])
        return int(doc["version"]), bool(cfg.enabled and doc["policy"]["enabled"]), cfg

    def canary_problem(self) -> str | None:
        r = self.client.get("/v1/stats")
        r.raise_for_status()
        problem = (r.json().get("probe_progress") or {}).get("canary", {}).get("problem")
        return None if problem is None else str(problem)

    def report(self, result: ProbeResult) -> None:
        body = {"kind": result.kind, "passed": result.passed, "values": result.values, "detail": result.detail}
        r = self.client.post("/v1/probes", json=body, headers=self.auth)
        if r.status_code in (401, 403):
            raise PermissionError(f"the runtime API refused the canary verdict ({r.status_code}): set its token")
        r.raise_for_status()


# -- transports -----------------------------------------------------------------------------------


class HttpTransport:
    """Canary requests through an OpenAI-compatible vLLM server's `/v1/completions`."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 priority: int = 0, timeout_s: float = 600.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url, timeout=timeout_s, headers=headers)
        self.model, self.priority = model, priority
        self.pool = ThreadPoolExecutor(max_workers=PROMPTS, thread_name_prefix="proxima-canary")
        self.futures: dict[str, Future[Rows]] = {}

    def submit(self, request_id: str, prompt: str) -> None:
        self.futures[request_id] = self.pool.submit(self._complete, request_id, prompt)

    def poll(self, request_id: str) -> Rows | None:
        fut = self.futures[request_id]
        if not fut.done():
            return None
        del self.futures[request_id]
        return fut.result()  # raises what the request raised

    def _complete(self, request_id: str, prompt: str) -> Rows:
        if self.model is None:
            r = self.client.get("/v1/models")
            r.raise_for_status()
            self.model = str(r.json()["data"][0]["id"])
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                "prompt_logprobs": TOP_K, "request_id": request_id}
        if self.priority:
            body["priority"] = self.priority
        r = self.client.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.text[:300]}")
        rows: Rows = r.json()["choices"][0]["prompt_logprobs"]
        return rows

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


class EngineTransport:
    """Canary requests into an in-process `LLMEngine` the caller steps (`offer` its outputs)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.done: dict[str, Rows] = {}

    def submit(self, request_id: str, prompt: str) -> None:
        from vllm import SamplingParams

        self.engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1,
                                                                   prompt_logprobs=TOP_K))

    def offer(self, outputs: Iterable[Any]) -> None:
        for r in outputs:
            if r.finished and r.request_id.startswith(CANARY_PREFIX):
                self.done[r.request_id] = r.prompt_logprobs

    def poll(self, request_id: str) -> Rows | None:
        return self.done.pop(request_id, None)


__all__ = [
    "CANARY_PRIORITY",
    "PROMPTS",
    "PROMPT_CHARS",
    "CanaryRunner",
    "Control",
    "EngineTransport",
    "HttpTransport",
    "RuntimeApi",
    "Transport",
    "canary_prompts",
]
