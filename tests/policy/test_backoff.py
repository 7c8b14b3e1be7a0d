"""The per-format compression backoff: a pure state machine, driven here step by step."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxima.formats import Format
from proxima.policy.backoff import BackoffSchedule, FormatBackoff
from proxima.policy.engine import EngineState, decide
from proxima.policy.loader import parse_policy
from proxima.policy.snapshot import RequestBlocks, Snapshot

POLICY = parse_policy(
    """
name: t
bands:
  - {name: low, enter: 0.5, exit: 0.4, target_free: 0.9, ladder: [int8, int4]}
  - {name: high, enter: 0.8, exit: 0.7, target_free: 0.9, ladder: [int4]}
protect: {sink_tokens: 0, recent_tokens: 0}
"""
)
ALL = {"int8", "int4"}


def _run_fault(bo: FormatBackoff, fmt: str, steps: range) -> list[int]:
    """Every step at which `fmt` may be planned is planned, and its batch fails: returns those steps."""
    tried = []
    for s in steps:
        if fmt not in bo.paused(s):
            tried.append(s)
            bo.observe(s, [], [fmt], "RuntimeError: boom", ALL)
    return tried


def test_schedule_doubles_and_caps() -> None:
    sch = BackoffSchedule(first_pause_steps=4, max_pause_steps=40)
    assert [sch.pause(n) for n in range(1, 7)] == [4, 8, 16, 32, 40, 40]
    assert sch.pause(10**9) == 40  # no huge integers after a very long fault
    with pytest.raises(ValueError, match="first_pause_steps"):
        BackoffSchedule(first_pause_steps=8, max_pause_steps=4)
    with pytest.raises(ValueError, match="first_pause_steps"):
        BackoffSchedule(first_pause_steps=0)


def test_failing_format_is_retried_at_growing_intervals() -> None:
    bo = FormatBackoff(BackoffSchedule(first_pause_steps=2, max_pause_steps=16))
    tried = _run_fault(bo, "int8", range(100))
    # Pauses of 2, 4, 8, 16, 16, ... steps between attempts (a pause of p skips p plans).
    assert tried[:6] == [0, 3, 8, 17, 34, 51]
    gaps = [b - a - 1 for a, b in itertools.pairwise(tried)]
    assert gaps == sorted(gaps) and max(gaps) == 16
    assert len(tried) == 8  # instead of 100 doomed batches
    assert bo.pauses == 8 and bo.episodes == 1


def test_one_episode_per_incident_and_recovery_on_commit() -> None:
    bo = FormatBackoff(BackoffSchedule(first_pause_steps=2, max_pause_steps=8))
    events = []
    for s in range(40):  # int8 and int4 both fail whenever they are tried
        failing = sorted(ALL - bo.paused(s))
        events += bo.observe(s, [], failing, "InjectedFault", ALL)
    assert [e.episode_start for e in events].count(True) == 1 and events[0].episode_start
    assert {e.kind for e in events} == {"paused"} and bo.backing_off() == ALL
    assert events[-1].backing_off == 2 and "paused for" in events[-1].message
    # The fault stops. A format is only probed once its pause is over; its commit resumes it.
    s = 40
    while "int8" in bo.paused(s):
        s += 1
    assert s - 40 <= 8
    (ev,) = bo.observe(s, ["int8"], [], "", ALL)
    assert ev.kind == "resumed" and ev.reason == "committed" and not ev.episode_end and ev.backing_off == 1
    (ev,) = bo.observe(s + 1, ["int4"], [], "", ALL)
    assert ev.episode_end and ev.backing_off == 0 and bo.backing_off() == frozenset()
    # A new fault later is a new incident: a new episode (and a new alert), starting short again.
    (ev,) = bo.observe(s + 50, [], ["int4"], "again", ALL)
    assert ev.episode_start and ev.pause_steps == 2 and bo.episodes == 2


def test_a_failure_wins_over_a_commit_of_the_same_format_in_one_report() -> None:
    bo = FormatBackoff()
    (ev,) = bo.observe(3, ["int4"], ["int4"], "recompression failed", ALL)
    assert ev.kind == "paused" and "int4" in bo.paused(4)


def test_a_format_that_left_the_policy_is_forgotten() -> None:
    bo = FormatBackoff()
    bo.observe(0, [], ["int8"], "x", ALL)
    (ev,) = bo.observe(1, [], [], "", {"int4"})  # a live policy change dropped int8
    assert ev.kind == "resumed" and ev.reason == "left the policy" and ev.episode_end
    assert bo.backing_off() == frozenset()


def test_a_format_that_commits_as_it_leaves_the_policy_resumes_once() -> None:
    """A block planned under the old policy commits in the report that follows a live change
    dropping its format: one resume, not two (the H100 soak of 2026-12-07 died on a KeyError here)."""
    bo = FormatBackoff()
    bo.observe(0, [], ["int4"], "x", ALL)
    (ev,) = bo.observe(1, ["int4"], [], "", {"int8"})
    assert ev.kind == "resumed" and ev.reason == "committed" and ev.episode_end
    assert bo.backing_off() == frozenset()


def test_events_are_queued_for_a_consumer_and_bounded() -> None:
    bo = FormatBackoff(max_queued=3)
    for s in range(5):
        bo.observe(s * 1000, [], ["int8"], "x", ALL)
    taken = bo.take_events()
    assert [e.step for e in taken] == [2000, 3000, 4000] and bo.take_events() == []


def test_summary_reports_pause_left() -> None:
    bo = FormatBackoff(BackoffSchedule(first_pause_steps=4, max_pause_steps=8))
    bo.observe(10, [], ["int8"], "boom", ALL)
    assert bo.summary(10)["formats"] == {"int8": {"failures": 1, "paused_steps_left": 4, "error": "boom"}}
    assert bo.summary(14)["formats"]["int8"]["paused_steps_left"] == 0 and "int8" not in bo.paused(15)


def _snapshot(free: int) -> Snapshot:
    reqs = [RequestBlocks(request_id=f"r{i}", importance=[0.1] * 6, formats=[Format.parse("bf16")] * 6,
                          tokens=[16] * 6, shared=[False] * 6) for i in range(2)]
    return Snapshot.build(total_blocks=14, free_blocks=free, block_size=16, requests=reqs)


def test_restricted_policy_plans_around_a_paused_format() -> None:
    bo = FormatBackoff()
    high, low = _snapshot(free=2), _snapshot(free=5)  # pressure 0.86 (band high), 0.64 (band low)
    assert decide(high, bo.restrict(POLICY, 0), EngineState()).counts_by_format().keys() == {"int4"}
    bo.observe(0, [], ["int4"], "x", ALL)
    p = bo.restrict(POLICY, 1)
    assert p is bo.restrict(POLICY, 2)  # cached while the paused set and the policy are the same
    assert [[f.name for f in b.ladder] for b in p.bands] == [["int8"], []]
    assert [[f.name for f in b.ladder] for b in POLICY.bands] == [["int8", "int4"], ["int4"]]  # untouched
    assert len(decide(high, p, EngineState())) == 0  # the high band's only rung is paused: nothing planned
    d = decide(low, p, EngineState())
    assert d.counts_by_format().keys() == {"int8"}  # the low band goes on with what works
    assert bo.restrict(POLICY, 100) is POLICY  # the pause is over


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sets(st.sampled_from(sorted(ALL))), st.sets(st.sampled_from(sorted(ALL))),
                          st.sets(st.sampled_from(sorted(ALL)), min_size=1)), max_size=60))
def test_invariants_under_any_report_sequence(reports: list[tuple[set[str], set[str], set[str]]]) -> None:
    """Any reports, under a live policy whose formats (`active`) change at every step."""
    sch = BackoffSchedule(first_pause_steps=1, max_pause_steps=8)
    bo = FormatBackoff(sch)
    starts = ends = 0
    for s, (ok, failed, active) in enumerate(reports):
        events = bo.observe(s, sorted(ok), sorted(failed), "e", active)
        for ev in events:
            starts += ev.episode_start
            ends += ev.episode_end
            assert ev.pause_steps <= sch.max_pause_steps
        assert not events or events[-1].backing_off == len(bo.backing_off())  # what a gauge would show
        assert bo.paused(s) <= bo.backing_off()
        assert all(fmt not in bo.backing_off() for fmt in ok - failed)  # a clean commit always resumes
        assert all(fmt in bo.paused(s) for fmt in failed & active)  # (one that left is forgotten at once)
        assert bo.backing_off() <= active
        assert not any(bo.paused(s + sch.max_pause_steps + 1))  # no pause outlasts the cap
    # Episodes alternate: every end follows a start, and one is open exactly when a format backs off.
    assert starts - ends == (1 if bo.backing_off() else 0) and starts == bo.episodes


def test_probation_limits_untested_and_recovering_formats_to_small_batches() -> None:
    bo = FormatBackoff(BackoffSchedule(first_pause_steps=2, max_pause_steps=8, probe_actions=2))
    q = bo.quota(0)
    assert all(q.take("int8") for _ in range(100))  # healthy: no limit
    bo.observe(0, [], ["int8"], "x", ALL)  # an incident begins
    q = bo.quota(1)
    assert not q.take("int8")  # paused
    assert [q.take("int4") for _ in range(3)] == [True, True, False]  # not proven in this incident: a probe
    bo.observe(1, ["int4"], [], "", ALL)  # int4 works: trusted for the rest of the incident
    q = bo.quota(2)
    assert all(q.take("int4") for _ in range(100)) and not q.take("int8")
    q = bo.quota(3)  # int8's pause is over: it is probed with a small batch
    assert [q.take("int8") for _ in range(3)] == [True, True, False]
    bo.observe(3, ["int8"], [], "", ALL)  # the incident is over
    assert all(bo.quota(4).take(f) for f in ("int8", "int4") for _ in range(100))
    bo.observe(10, [], ["int4"], "y", ALL)  # a new incident: nothing is trusted from the last one
    assert [bo.quota(20).take("int8") for _ in range(3)] == [True, True, True]  # (a fresh quota per plan)
    q = bo.quota(20)
    assert [q.take("int8") for _ in range(3)] == [True, True, False]
    with pytest.raises(ValueError, match="probe_actions"):
        BackoffSchedule(probe_actions=0)
