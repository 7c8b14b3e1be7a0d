"""The engine-side controller: one object that owns everything the operator can see or change.

It holds the `PolicyStore` (the live policy and its versions), the fallback ladder state, a
`Backend` (the simulator now, vLLM's KV manager later), the probe aggregation, the metrics and
the alerts. The HTTP layer (`proxima.api.app`) is a thin skin over its methods, and the engine
talks to it through three hooks:

- `policy_for_step()` at the start of every engine step: the live policy and fallback level,
  read once, so a step never sees half of a change;
- `on_step(report)` after the step: decisions, errors, kernel time;
- `on_probe(result)` whenever a probe produces a verdict: feeds the ladder, may fire an alert.

Locking: `_ladder_lock` guards the ladder state and never takes the store's lock, so the store's
swap listener (called under the store lock) may take it without any risk of deadlock.
`_write_lock` serialises API writes that check a version precondition (If-Match) before writing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxima.api.alerts import AlertLog, WebhookSink
from proxima.api.backend import Backend, BackendStats, StepReport
from proxima.api.metrics import Metrics
from proxima.policy import fallback as ladder
from proxima.policy.loader import PolicyError
from proxima.policy.probes import ProbeKind, ProbeResult
from proxima.policy.snapshot import ProbeStatus
from proxima.policy.store import Change, PolicyStore, PolicyVersion, diff

log = logging.getLogger("proxima.api.changes")


class VersionConflict(RuntimeError):
    """The caller's expected version (If-Match) is not the live one."""

    def __init__(self, expected: int, live: int) -> None:
        super().__init__(f"policy is at version {live}, not {expected}; re-read it and retry")
        self.expected = expected
        self.live = live


@dataclass(frozen=True)
class ProbeRecord:
    result: ProbeResult
    at: float


def _origin(source: str) -> str:
    """Bounded label for a version's source ('api:PATCH' -> 'api', '/etc/p.yaml' -> 'file')."""
    head = source.split(":", 1)[0]
    return head if head in {"api", "rollback", "initial", "cli"} else "file"


class Controller:
    def __init__(
        self,
        store: PolicyStore,
        backend: Backend,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        webhook: WebhookSink | None = None,
    ) -> None:
        self.store = store
        self.backend = backend
        self.metrics = metrics if metrics is not None else Metrics()
        self.clock = clock
        self.webhook = (
            webhook
            if webhook is not None
            else WebhookSink(
                lambda: self.store.policy.alerts.webhook,
                on_failure=lambda a, e: self.metrics.webhook_failures.inc(),
                on_drop=lambda a: self.metrics.webhook_dropped.inc(),
            )
        )
        self.alerts = AlertLog(
            lambda: self.store.policy.alerts,
            webhook=self.webhook,
            on_fire=lambda a: self.metrics.alerts.labels(kind=a.kind, severity=a.severity).inc(),
        )
        self._ladder = ladder.LadderState()
        self._ladder_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._probes: dict[ProbeKind, ProbeRecord] = {}
        self._probe_counts: dict[tuple[str, bool], int] = {}
        self._progress: dict[str, dict[str, Any]] = {}
        """Per probe, how far its current measurement is (e.g. the drift windows' fill); replaced
        whole by the engine thread, read by API threads."""
        store.subscribe(self._on_swap)
        self.metrics.policy_version.set(store.current.version)
        self.metrics.fallback_level.set(0)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.webhook.start()

    def stop(self) -> None:
        self.webhook.stop()

    # -- engine hooks ------------------------------------------------------------------------------
    def policy_for_step(self) -> tuple[PolicyVersion, int]:
        """The live policy version and the effective fallback level, for one engine step."""
        version = self.store.current
        with self._ladder_lock:
            level = self._ladder.effective_level
        return version, min(level, len(version.policy.fallback.levels) - 1)

    def on_step(self, report: StepReport) -> None:
        m = self.metrics
        m.steps.inc()
        for fmt, n in report.decisions_by_format.items():
            m.decisions.labels(action="compress", format=fmt).inc(n)
        for reason, n in report.errors_by_reason.items():
            m.compression_errors.labels(reason=reason).inc(n)
        if report.rejected_by_probe:
            m.compression_rejected.inc(report.rejected_by_probe)
        if report.kernel_seconds is not None:
            m.kernel_seconds.observe(report.kernel_seconds)
        for fmt, err in report.probe_errors:
            m.probe_error.labels(format=fmt).observe(err)
        if report.probe_seconds is not None:
            m.probe_seconds.observe(report.probe_seconds)
        for ev in report.backoff:
            if ev.kind == "paused":
                m.compression_backoffs.labels(format=ev.fmt).inc()
            m.compression_backoff_formats.set(ev.backing_off)
            if ev.episode_start:  # one alert per incident; later pauses and the recovery are counted and logged
                self.alerts.fire(self.clock(), "compression_backoff", "warning", ev.message, **ev.details())

    def on_probe(self, result: ProbeResult) -> None:
        """Record a probe verdict and feed it to the fallback ladder (may step down or up)."""
        now = self.clock()
        m = self.metrics
        m.probe_runs.labels(probe=result.kind, result="pass" if result.passed else "fail").inc()
        for stat, value in result.values.items():
            m.probe_value.labels(probe=result.kind, stat=stat).set(value)
        cfg = self.store.policy.fallback
        with self._ladder_lock:
            self._probes[result.kind] = ProbeRecord(result, now)
            key = (result.kind, result.passed)
            self._probe_counts[key] = self._probe_counts.get(key, 0) + 1
            # Every probe moves the ladder. The compression-time probe refuses a lossy block by
            # itself; its per-step verdict (`probes.compression_step`) fails only when a large
            # share of the engine's choices were refused, which is the policy's fault.
            self._ladder, event = ladder.observe(self._ladder, result.passed, now, cfg, source=result.kind)
            level = self._ladder.effective_level
        m.fallback_level.set(level)
        if event is not None:
            self._ladder_alert(event, result)

    def set_progress(self, kind: ProbeKind, progress: dict[str, Any]) -> None:
        """A probe's progress towards its next verdict (shown by `/v1/stats` and `/v1/probes`)."""
        self._progress = {**self._progress, kind: progress}

    # -- read side ---------------------------------------------------------------------------------
    def probe_status(self) -> ProbeStatus:
        """`Snapshot.probe_status`: "failing" while the last whole-model verdict (canary or drift)
        failed and the ladder is counting towards a step down: the engine holds new compressions
        until a probe passes or the ladder steps down. (The compression-time probe refuses its
        blocks itself; holding on its verdict would stop the very measurements that could clear it.)"""
        with self._ladder_lock:
            last = [rec for kind, rec in self._probes.items() if kind != "compression"]
            counting = self._ladder.consecutive_failures > 0  # a step down resets it: then compress again
        latest = max(last, key=lambda rec: rec.at, default=None)
        return "failing" if latest is not None and not latest.result.passed and counting else "ok"

    def last_verdicts(self) -> dict[str, Any]:
        """Each probe's last verdict in brief (None: none yet), for `/v1/stats`."""
        with self._ladder_lock:
            last = dict(self._probes)
        return {kind: None if (rec := last.get(kind)) is None  # type: ignore[call-overload]
                else {"passed": rec.result.passed, "at": rec.at, "detail": rec.result.detail,
                      "values": rec.result.values}
                for kind in ("compression", "canary", "drift")}

    def progress(self) -> dict[str, dict[str, Any]]:
        """Each probe's progress towards its next verdict (`set_progress`), where it reports one."""
        return dict(self._progress)

    def stats(self) -> BackendStats:
        stats = self.backend.stats()
        self.metrics.set_stats(stats)
        return stats

    def fallback_state(self) -> dict[str, Any]:
        levels = self.store.policy.fallback.levels
        with self._ladder_lock:
            st = self._ladder
        eff = min(st.effective_level, len(levels) - 1)
        return {
            "level": eff,
            "level_name": levels[eff].name,
            "automatic_level": st.level,
            "forced": st.forced,
            "consecutive_failures": st.consecutive_failures,
            "consecutive_passes": st.consecutive_passes,
            "cooldown_until": st.cooldown_until if st.cooldown_until != float("-inf") else None,
            "levels": [lv.model_dump(mode="json") for lv in levels],
        }

    def probes(self) -> dict[str, Any]:
        with self._ladder_lock:
            last = dict(self._probes)
            counts = dict(self._probe_counts)
        cfg = self.store.policy.probes
        out: dict[str, Any] = {}
        for kind in ("compression", "canary", "drift"):
            rec = last.get(kind)  # type: ignore[call-overload]
            out[kind] = {
                "enabled": getattr(cfg, kind).enabled,
                "progress": self._progress.get(kind),
                "passes": counts.get((kind, True), 0),
                "failures": counts.get((kind, False), 0),
                "last": None
                if rec is None
                else {
                    "at": rec.at,
                    "passed": rec.result.passed,
                    "values": rec.result.values,
                    "detail": rec.result.detail,
                },
            }
        return {"probes": out, "fallback": self.fallback_state()}

    # -- write side (the API calls these; each returns the new version and its diff) ---------------
    def _guard(self, expected: int | None) -> None:
        live = self.store.current.version
        if expected is not None and expected != live:
            raise VersionConflict(expected, live)

    def put_policy(
        self,
        data: Any,
        source: str,
        comment: str = "",
        expected: int | None = None,
        text: str | bytes | None = None,
    ) -> tuple[PolicyVersion, list[Change]]:
        with self._write_lock:
            self._guard(expected)
            if text is not None:
                return self.store.apply_text(text, source, comment)
            return self.store.apply_data(data, source, comment)

    def patch_policy(
        self, patch: dict[str, Any], source: str, comment: str = "", expected: int | None = None
    ) -> tuple[PolicyVersion, list[Change]]:
        with self._write_lock:
            self._guard(expected)
            return self.store.patch(patch, source, comment)

    def rollback(self, version: int, comment: str = "") -> tuple[PolicyVersion, list[Change]]:
        with self._write_lock:
            return self.store.rollback(version, comment)

    def force_fallback(self, level: int | None) -> dict[str, Any]:
        """Pin the ladder at `level`, or release the pin (None). Raises ValueError if out of range."""
        now = self.clock()
        cfg = self.store.policy.fallback
        with self._ladder_lock:
            self._ladder, event = ladder.force(self._ladder, level, now, cfg)
            eff = self._ladder.effective_level
        self.metrics.fallback_level.set(eff)
        self._ladder_alert(event, None)
        return self.fallback_state()

    def policy_file_refused(self, error: PolicyError) -> None:
        """A watched policy file was refused (the live policy stays): raise a warning alert."""
        first = error.problems[0] if error.problems else None
        where = first.source if first is not None else "policy file"
        self.alerts.fire(
            self.clock(),
            "policy_reload_refused",
            "warning",
            f"{where} refused, the live policy stays at version {self.store.current.version}: "
            f"{first.message if first is not None else error}",
            reason=error.reason,
            problems=[str(p) for p in error.problems[:20]],
        )

    # -- internals ---------------------------------------------------------------------------------
    def _ladder_alert(self, event: ladder.LadderEvent, cause: ProbeResult | None) -> None:
        self.metrics.fallback_transitions.labels(kind=event.kind).inc()
        severity = {"step_down": "critical", "step_up": "info", "forced": "warning", "released": "info"}[event.kind]
        message = (
            f"fallback {event.kind.replace('_', ' ')}: level {event.level_from} -> {event.level_to} "
            f"({event.level_name}): {event.reason}"
        )
        details: dict[str, Any] = {
            "level_from": event.level_from,
            "level_to": event.level_to,
            "level_name": event.level_name,
            "reason": event.reason,
        }
        if cause is not None:
            details["probe"] = {"kind": cause.kind, "values": cause.values, "detail": cause.detail}
        self.alerts.fire(event.at, f"fallback_{event.kind}", severity, message, **details)  # type: ignore[arg-type]

    def _on_swap(self, old: PolicyVersion, new: PolicyVersion) -> None:
        # Called by the store under its lock: keep it short, and never call back into the store.
        changes = diff(old.policy, new.policy)
        log.info(
            "policy v%d -> v%d at %s from %s%s: %s",
            old.version,
            new.version,
            time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(new.created_at)),
            new.source,
            f" ({new.comment})" if new.comment else "",
            "; ".join(f"{c.path}: {c.old!r} -> {c.new!r}" for c in changes) or "no field changed",
        )
        self.metrics.policy_version.set(new.version)
        self.metrics.policy_changes.labels(origin=_origin(new.source)).inc()
        with self._ladder_lock:
            self._ladder = ladder.rebase(self._ladder, new.policy.fallback)


def policy_summary(version: PolicyVersion) -> dict[str, Any]:
    return {
        "version": version.version,
        "source": version.source,
        "created_at": version.created_at,
        "comment": version.comment,
    }


def changes_json(changes: list[Change]) -> list[dict[str, Any]]:
    return [{"path": c.path, "old": c.old, "new": c.new} for c in changes]


__all__ = ["Controller", "ProbeRecord", "VersionConflict", "changes_json", "policy_summary"]
