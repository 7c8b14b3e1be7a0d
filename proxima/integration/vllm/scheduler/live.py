"""The runtime tuning API inside a live vLLM engine.

Everything here runs in the EngineCore process, next to the scheduler-side KV manager, and only
when the API is enabled (`api.enabled` in the policy, or `PROXIMA_API_PORT`): otherwise the
connector never builds a `LiveControl` and no line of this module runs.

Two threads meet here. The engine thread steps and calls the hooks (`before_plan`, `after_plan`,
`commit`); the API threads (uvicorn) read `ManagerBackend.stats()` and write the `PolicyStore`.
They share no mutable state: the engine publishes an immutable `BackendStats` at the end of each
step (one reference assignment), and the store hands out immutable policy versions.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from proxima.api.backend import BackendStats, StepReport
from proxima.api.controller import Controller
from proxima.api.metrics import Metrics
from proxima.integration.vllm.scheduler.canary import chunking_problem, is_special
from proxima.integration.vllm.scheduler.drift import DriftWindows, classify
from proxima.integration.vllm.scheduler.pool_usage import total_blocks
from proxima.policy.loader import Problem
from proxima.policy.probes import compression_step
from proxima.policy.schema import Policy
from proxima.policy.snapshot import pool_pressure
from proxima.policy.store import PolicyStore

if TYPE_CHECKING:
    import threading

    import uvicorn

    from proxima.integration.vllm.plan import ProximaReport
    from proxima.integration.vllm.scheduler.manager import ProximaKVCacheManager

logger = logging.getLogger("proxima.vllm")
API_PORT_ENV = "PROXIMA_API_PORT"
"""Serve the API on this port (enables it even when the policy's `api.enabled` is false)."""
API_HOST_ENV = "PROXIMA_API_HOST"
"""Bind address; defaults to the policy's `api.host` (127.0.0.1)."""
STARTUP_TIMEOUT_S = 10.0
NO_DRIFT_OBSERVER = ("this engine runs without the drift probe's observer (a vLLM logits processor, which vLLM "
                     "refuses with speculative decoding, and of the V1 interface, which Model Runner V2, vLLM 0.32's "
                     "CUDA default, does not take: VLLM_USE_V2_MODEL_RUNNER=0 runs it): "
                     "the drift probe cannot run here")


def api_address(policy: Policy, environ: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
    """Where to serve the API, or None when it is not enabled."""
    port_text = environ.get(API_PORT_ENV, "").strip()
    if not port_text and not policy.api.enabled:
        return None
    host = environ.get(API_HOST_ENV, "").strip() or policy.api.host
    if not port_text:
        return host, policy.api.port
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(f"{API_PORT_ENV}={port_text!r} is not a TCP port (1-65535)")
    return host, port


class ManagerBackend:
    """`proxima.api.backend.Backend` over the scheduler-side KV manager.

    `stats()` is called from API threads while the engine thread mutates the manager, so it never
    reads the manager: it returns the snapshot the engine thread last published (`publish`).
    """

    def __init__(self, manager: ProximaKVCacheManager) -> None:
        self.manager = manager
        self.block_bytes = int(manager.summary()["block_bytes"])  # type: ignore[call-overload]
        self._latest = self.measure()

    def stats(self) -> BackendStats:
        return self._latest

    def publish(self, pending_blocks: int = 0, applied_policy_version: int | None = None) -> None:
        """Engine thread: measure the pool now and make it what `stats()` returns."""
        self._latest = self.measure(pending_blocks, applied_policy_version)

    def measure(self, pending_blocks: int = 0, applied_policy_version: int | None = None) -> BackendStats:
        """A consistent view of the pool; engine thread only (it walks the manager's live state)."""
        m = self.manager
        total = total_blocks(m.block_pool)
        free = m.block_pool.get_num_free_blocks()
        return BackendStats(
            pressure=pool_pressure(free, pending_blocks, total),
            total_blocks=total,
            free_blocks=free,
            # The accounting invariant: free + owned + side-held == total. The blocks held back for
            # the side tables are their bytes (meta_bytes), not KV: counting them here too would
            # charge the metadata twice in held_bytes.
            owned_blocks=total - free - len(m.px.charge.held),
            blocks_by_format=m.blocks_by_format(),
            block_bytes=self.block_bytes,
            fragmentation_blocks=m.px.packer.fragmentation_blocks(),
            step=m.px.stats.steps,
            applied_policy_version=applied_policy_version,
            meta_bytes=m.px.meta.side_table_bytes(m.px.ledger),
        )


class LiveControl:
    """The controller and HTTP server of one engine, and the per-step hooks the connector calls.

    Per engine step, on the engine thread:
    `before_plan()` (adopt a changed policy and the fallback level) -> `manager.build_plan` ->
    `after_plan()` (publish stats) -> worker runs -> `commit(report)` (apply the report, tell the
    controller what the step did). A step whose worker reported nothing is told to the controller
    at the start of the next step, so every step is reported exactly once.
    """

    def __init__(
        self,
        manager: ProximaKVCacheManager,
        policy: Policy,
        host: str,
        port: int,
        source: str = "initial",
        metrics: Metrics | None = None,
        drift_observer: bool = True,
        canary_chunk_tokens: int | None = None,
    ) -> None:
        self.manager = manager
        self.host, self.port = host, port
        self.backend = ManagerBackend(manager)
        self.controller = Controller(PolicyStore(policy, source=source), self.backend, metrics)
        self.applied_version = self.controller.store.current.version  # the manager already holds it
        self._pending_blocks = 0
        self._step_unreported = False
        self._committed: Counter[str] = Counter()  # since the last report, by format
        self._failed = 0
        self._revoke_mismatches = 0  # (a broken worker invariant: `WorkerStore.revoke`)
        self._kernel_seconds = 0.0
        self._probe_errors: list[tuple[str, float]] = []
        self._probe_measured = 0
        self._probe_refused = 0
        self._probe_seconds = 0.0
        self._window: list[float] = []  # errors of the verdict window (`probes.compression.window_blocks`)
        self._window_measured = 0
        self._window_refused = 0
        self.drift = DriftWindows()
        self._drift_seconds = 0.0  # the observer's work, all told (its cost)
        self._compressed_then: deque[frozenset[str]] = deque(maxlen=2)
        """Requests holding committed compressed blocks after each of the last two commits: a
        report's drift samples are of the forward two engine steps back (`drift.py`)."""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.canary_chunk_tokens = canary_chunk_tokens
        """The most prompt tokens vLLM prefills for a request in one step (`canary.prefill_chunk_tokens`;
        None: not known). A live canary no longer than that measures nothing: said in the log and
        in `probe_progress.canary` (the canary runner then posts no verdict)."""
        self._canary_prompt_tokens: int | None = None
        if canary_chunk_tokens is not None:
            self.controller.set_progress("canary", {"chunk_tokens": canary_chunk_tokens})
        self.drift_observer = drift_observer
        """Whether the worker observes tokens (`drift_observer.py`). Without it, a policy enabling
        the drift probe is refused by the API, and the startup one's probe is reported unavailable
        (the manager then holds no request out: `ProbeState.drift_observer`)."""
        if not drift_observer:
            self.controller.store.requirements = _needs_no_drift
            self.controller.set_progress("drift", {"unavailable": NO_DRIFT_OBSERVER})
            if policy.probes.drift.enabled:
                logger.warning("proxima: probes.drift.enabled, but %s", NO_DRIFT_OBSERVER)

    @classmethod
    def from_env(cls, manager: ProximaKVCacheManager, policy: Policy, source: str,
                 drift_observer: bool = True, canary_chunk_tokens: int | None = None) -> LiveControl | None:
        """A started LiveControl when the API is enabled; without the API, one with no server when
        the policy compresses (its probes move the fallback ladder, its alerts reach the log and
        the webhook); else None (nothing of this module runs)."""
        address = api_address(policy)
        if address is None:
            if policy.is_off:
                return None
            live = cls(manager, policy, "", 0, source=source, drift_observer=drift_observer,
                       canary_chunk_tokens=canary_chunk_tokens)
            live.controller.start()
            return live
        live = cls(manager, policy, *address, source=source, drift_observer=drift_observer,
                   canary_chunk_tokens=canary_chunk_tokens)
        live.start()
        return live

    # -- server ------------------------------------------------------------------------------------
    def start(self) -> None:
        from proxima.api.app import create_app
        from proxima.api.auth import TokenSource
        from proxima.api.server import serve_in_thread

        self.controller.start()  # the alert webhook's sender thread
        tokens = TokenSource.from_settings(self.controller.store.policy.api)
        self._server, self._thread = serve_in_thread(create_app(self.controller, tokens), self.host, self.port)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            # uvicorn reports a failed bind by exiting its thread; the operator asked for the API,
            # so an engine silently running without it would be worse than failing here.
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"proxima: the runtime API could not start on {self.host}:{self.port} (in use?)")
            time.sleep(0.02)
        auth = "" if tokens.read() else f"; no token in {tokens.describe()}: every change is refused"
        logger.warning("proxima: runtime API on http://%s:%d (pid %d)%s", self.host, self.port, os.getpid(), auth)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5.0)
        self.controller.stop()

    # -- engine hooks (engine thread) --------------------------------------------------------------
    def before_plan(self) -> None:
        """Start of a step's planning: the previous step's late report, then this step's policy."""
        if self._step_unreported:
            self._report()
        version, level = self.controller.policy_for_step()
        m = self.manager
        if version.version != self.applied_version:
            # Planned in this very step; blocks already compressed keep their format.
            m.set_policy(version.policy, version.version)  # and, with this step's plan, the worker's
            self.applied_version = version.version
        if m.px.engine.fallback_level != level:
            m.px.engine = replace(m.px.engine, fallback_level=level)
        m.px.probes.status = self.controller.probe_status()
        # build_plan consumes (resets) the waiting demand; it is part of the pressure we report.
        self._pending_blocks = m.px.waiting_need

    def after_plan(self) -> None:
        self._step_unreported = True
        prompt = self.manager.px.probes.canary_prompt_tokens
        if prompt != self._canary_prompt_tokens and prompt is not None and self.canary_chunk_tokens is not None:
            self._canary_prompt_tokens = prompt
            problem = chunking_problem(prompt, self.canary_chunk_tokens)
            self.controller.set_progress("canary", {"chunk_tokens": self.canary_chunk_tokens, "prompt_tokens": prompt,
                                                    "measurable": problem is None, "problem": problem})
            if problem is not None:
                logger.warning("proxima: %s", problem)
        self.backend.publish(self._pending_blocks, self.applied_version)

    def commit(self, report: ProximaReport) -> None:
        """Apply the worker's report to the manager and tell the controller what the step did."""
        in_flight = self.manager.px.in_flight
        self._committed.update(a.fmt.name for aid in report.ok if (a := in_flight.get(aid)) is not None)  # before apply
        self._failed += len(report.failed)
        self._revoke_mismatches += report.revoke_mismatches
        self._kernel_seconds += report.kernel_seconds
        self._probe_errors.extend((f.name, err) for f, err in report.probe_errors)  # (metric labels)
        self._probe_measured += report.probe_measured
        self._probe_refused += report.probe_refused
        self._probe_seconds += report.probe_seconds
        self._drift(report)
        self.manager.apply_report(report)
        # Only an open step is reported: with vLLM's async scheduling a report can arrive after the
        # next step was planned (and reported); its numbers then ride along with the next report.
        if self._step_unreported:
            self._report()
        self.backend.publish(self._pending_blocks, self.applied_version)

    def _drift(self, report: ProximaReport) -> None:
        """The drift probe's samples into their windows; a verdict when both sides have one."""
        px = self.manager.px
        cfg = self.controller.store.policy.probes.drift
        if not self.drift_observer or (not cfg.enabled and not self.drift.open):
            self._compressed_then.clear()
            return
        compressed = self._compressed_then[0] if len(self._compressed_then) == 2 else frozenset()
        self._drift_seconds += report.drift_seconds
        classify(report.drift, px.probes.holdout, compressed, self.drift)
        self.drift.close_absent(px.ledger)
        # (canaries are compressed whatever the pressure: they say nothing of the users' requests)
        self._compressed_then.append(frozenset(rid for rid, e in px.ledger.items()
                                               if e.compressed and not is_special(rid)))
        if cfg.enabled and (verdict := self.drift.verdict(cfg)) is not None:
            self.controller.on_probe(verdict)
        self.controller.set_progress("drift", {**self.drift.progress(), "observer_seconds": self._drift_seconds})

    def _report(self) -> None:
        self._step_unreported = False
        errors = {"kernel": self._failed} if self._failed else {}
        if self._revoke_mismatches:
            errors["revoke_mismatch"] = self._revoke_mismatches
        kernel = self._kernel_seconds if self._kernel_seconds > 0 else None
        measured = self._probe_measured > 0
        self.controller.on_step(StepReport(decisions_by_format=dict(self._committed), errors_by_reason=errors,
                                           rejected_by_probe=self._probe_refused, kernel_seconds=kernel,
                                           backoff=tuple(self.manager.px.backoff.take_events()),
                                           probe_errors=tuple(self._probe_errors),
                                           probe_seconds=self._probe_seconds if measured else None))
        # One verdict per `window_blocks` measured blocks: what the fallback ladder counts.
        self._window += [e for _, e in self._probe_errors]
        self._window_measured += self._probe_measured
        self._window_refused += self._probe_refused
        cfg = self.controller.store.policy.probes.compression
        if self._window_measured >= cfg.window_blocks:
            self.controller.on_probe(compression_step(self._window, self._window_measured, self._window_refused, cfg))
            self._window, self._window_measured, self._window_refused = [], 0, 0
        self._committed = Counter()
        self._failed = 0
        self._revoke_mismatches = 0
        self._kernel_seconds = 0.0
        self._probe_errors, self._probe_measured, self._probe_refused, self._probe_seconds = [], 0, 0, 0.0


def _needs_no_drift(policy: Policy, source: str) -> list[Problem]:
    """`PolicyStore.requirements` of an engine without the drift observer."""
    if policy.probes.drift.enabled:
        return [Problem(source, None, None, "probes.drift.enabled", NO_DRIFT_OBSERVER)]
    return []


__all__ = ["API_HOST_ENV", "API_PORT_ENV", "NO_DRIFT_OBSERVER", "LiveControl", "ManagerBackend", "api_address"]
