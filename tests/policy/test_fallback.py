import pytest

from proxima.policy.fallback import LadderState, force, observe, rebase
from proxima.policy.schema import Fallback, FallbackLevel

CFG = Fallback(failures_to_step_down=2, passes_to_step_up=3, cooldown_s=10.0)


def feed(state: LadderState, results: str, start: float, dt: float = 1.0):
    events = []
    now = start
    for ch in results:
        state, ev = observe(state, ch == "p", now, CFG)
        if ev:
            events.append(ev)
        now += dt
    return state, events, now


def test_steps_down_after_consecutive_failures_only() -> None:
    st, evs, _ = feed(LadderState(), "fpfpf", 0.0)
    assert st.level == 0 and evs == []  # never two failures in a row
    st, evs, _ = feed(LadderState(), "ff", 0.0)
    assert st.level == 1 and [e.kind for e in evs] == ["step_down"]
    assert evs[0].level_name == "quantize-only" and st.cooldown_until == 11.0


def test_cooldown_holds_then_sustained_passes_step_up() -> None:
    st, _, now = feed(LadderState(), "ff", 0.0)  # level 1 at t=1, cooldown until 11
    st, evs, now = feed(st, "ppppp", now)  # t = 2..6: passes during cooldown do not step up
    assert st.level == 1 and evs == []
    st, evs, _ = feed(st, "p", 11.0)  # cooldown over, and >= 3 consecutive passes
    assert st.level == 0 and [e.kind for e in evs] == ["step_up"]


def test_failure_resets_pass_streak() -> None:
    st, _, _ = feed(LadderState(), "ff", 0.0)
    st, evs, _ = feed(st, "ppfpp", 20.0)
    assert st.level == 1 and evs == []


def test_bottom_is_sticky_and_never_overflows() -> None:
    st, evs, _ = feed(LadderState(), "f" * 20, 0.0)
    assert st.level == len(CFG.levels) - 1
    assert [e.level_to for e in evs] == [1, 2, 3]


def test_force_pins_and_release_resumes() -> None:
    st, ev = force(LadderState(), 3, 0.0, CFG)
    assert st.effective_level == 3 and ev.kind == "forced"
    st, evs, _ = feed(st, "ffff", 1.0)
    assert st.effective_level == 3 and evs == []  # probes do not move a pinned ladder
    st, ev = force(st, None, 5.0, CFG)
    assert ev.kind == "released" and st.effective_level == st.level
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        force(st, 9, 0.0, CFG)


def test_rebase_after_policy_with_fewer_levels() -> None:
    st = LadderState(level=3, forced=2)
    small = Fallback(levels=[FallbackLevel(name="full"), FallbackLevel(name="off", max_pack_ratio=1)])
    st = rebase(st, small)
    assert st.level == 1 and st.forced == 1
