"""The fallback ladder: a pure state machine that turns probe results into a restriction level.

Level 0 is the policy as written; each higher level (``policy.fallback.levels``) allows less.
`failures_to_step_down` consecutive failures step one level down (and start a cooldown);
after the cooldown, `passes_to_step_up` consecutive passes step one level back up. An operator
may pin a level (`force`), which holds until released.

Time is passed in (`now`, seconds), never read: tests drive it with a fake clock, and the same
inputs give the same transitions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from proxima.policy.schema import Fallback

EventKind = Literal["step_down", "step_up", "forced", "released"]


@dataclass(frozen=True)
class LadderEvent:
    """A level change, for alerts and logs."""

    kind: EventKind
    level_from: int
    level_to: int
    level_name: str
    at: float
    reason: str


@dataclass(frozen=True)
class LadderState:
    level: int = 0
    consecutive_failures: int = 0
    consecutive_passes: int = 0
    cooldown_until: float = float("-inf")
    forced: int | None = None
    """A level pinned by an operator; probes still count but do not move the level."""

    @property
    def effective_level(self) -> int:
        return self.forced if self.forced is not None else self.level


def _clamp(level: int, cfg: Fallback) -> int:
    return max(0, min(level, len(cfg.levels) - 1))


def observe(
    state: LadderState, passed: bool, now: float, cfg: Fallback, source: str = "probe"
) -> tuple[LadderState, LadderEvent | None]:
    """Feed one probe result. Returns the next state and the event it caused, if any."""
    if not passed:
        fails = state.consecutive_failures + 1
        st = replace(state, consecutive_failures=fails, consecutive_passes=0)
        bottom = len(cfg.levels) - 1
        if fails >= cfg.failures_to_step_down and st.level < bottom and st.forced is None:
            new = st.level + 1
            st = replace(st, level=new, consecutive_failures=0, cooldown_until=now + cfg.cooldown_s)
            return st, LadderEvent(
                "step_down", state.level, new, cfg.levels[new].name, now, f"{fails} consecutive {source} failures"
            )
        return st, None

    passes = state.consecutive_passes + 1
    st = replace(state, consecutive_passes=passes, consecutive_failures=0)
    if st.level > 0 and st.forced is None and now >= st.cooldown_until and passes >= cfg.passes_to_step_up:
        new = st.level - 1
        st = replace(st, level=new, consecutive_passes=0)
        return st, LadderEvent(
            "step_up", state.level, new, cfg.levels[new].name, now, f"{passes} consecutive {source} passes"
        )
    return st, None


def force(state: LadderState, level: int | None, now: float, cfg: Fallback) -> tuple[LadderState, LadderEvent]:
    """Pin the ladder at `level` (an operator's override), or release the pin with None."""
    if level is None:
        st = replace(state, forced=None, consecutive_passes=0, consecutive_failures=0)
        lv = st.level
        return st, LadderEvent("released", state.effective_level, lv, cfg.levels[lv].name, now, "operator release")
    if not 0 <= level < len(cfg.levels):
        raise ValueError(f"fallback level must be in [0, {len(cfg.levels) - 1}], got {level}")
    st = replace(state, forced=level)
    return st, LadderEvent("forced", state.effective_level, level, cfg.levels[level].name, now, "operator override")


def rebase(state: LadderState, cfg: Fallback) -> LadderState:
    """Keep a ladder state valid after a policy swap that changed the number of levels."""
    forced = None if state.forced is None else _clamp(state.forced, cfg)
    return replace(state, level=_clamp(state.level, cfg), forced=forced)
