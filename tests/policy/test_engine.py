import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxima.formats import HOT, Format
from proxima.policy.engine import EngineState, decide, select_band
from proxima.policy.loader import parse_policy
from proxima.policy.schema import Policy
from proxima.policy.snapshot import RequestBlocks, Snapshot, pool_pressure

F = Format.parse
B = 16

POLICY = parse_policy(
    """
name: t
bands:
  - {name: low, enter: 0.7, exit: 0.6, target_free: 0.35, ladder: [int8, int4]}
  - {name: high, enter: 0.85, exit: 0.75, target_free: 0.5, ladder: [int4, "cluster(2)+int4", int2]}
protect: {sink_tokens: 16, recent_tokens: 32}
budget: {max_blocks_per_step: 40}
"""
)


def _policy(**overrides: object) -> Policy:
    data = POLICY.model_dump(mode="json")
    for key, value in overrides.items():
        node = data
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return Policy.model_validate(data)


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    n_req = draw(st.integers(1, 6))
    fmts = [HOT, F("int8"), F("int4")]
    reqs = []
    used = 0
    for r in range(n_req):
        n = draw(st.integers(1, 20))
        tail = draw(st.integers(1, B))
        tokens = [B] * (n - 1) + [tail]
        imp = draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
        f = draw(st.lists(st.sampled_from(fmts), min_size=n, max_size=n))
        shared = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        reqs.append(RequestBlocks(f"r{r}", imp, f, tokens, shared=shared, in_prefill=draw(st.booleans())))
        used += n
    total = used + draw(st.integers(0, 40))
    free = total - used
    return Snapshot.build(
        total_blocks=total,
        free_blocks=free,
        block_size=B,
        requests=reqs,
        pending_blocks=draw(st.integers(0, 10)),
    )


def _protected(snap: Snapshot, row: int, policy: Policy) -> bool:
    r = int(snap.block_request[row])
    i = int(snap.block_index[row])
    start, end = i * B, i * B + int(snap.block_tokens[row])
    return (
        (bool(snap.request_prefill[r]) and policy.protect.prefilling)
        or bool(snap.block_shared[row])
        or i == int(snap.request_blocks[r]) - 1
        or start < policy.protect.sink_tokens
        or end > int(snap.request_tokens[r]) - policy.protect.recent_tokens
    )


@settings(max_examples=150, deadline=None)
@given(snap=snapshots(), band=st.sampled_from([None, 0, 1]), level=st.integers(0, 3), prefilling=st.booleans())
def test_engine_invariants(snap: Snapshot, band: int | None, level: int, prefilling: bool) -> None:
    state = EngineState(active_band=band, fallback_level=level)
    policy = _policy(**{"protect.prefilling": prefilling})
    d = decide(snap, policy, state)
    again = decide(snap, policy, state)
    # Deterministic.
    assert np.array_equal(d.rows, again.rows) and d.targets == again.targets and d.state == again.state
    # Budget.
    assert len(d) <= POLICY.budget.max_blocks_per_step
    assert len(set(d.rows.tolist())) == len(d.rows)
    lvl = POLICY.fallback.levels[level]
    ladder = POLICY.bands[d.state.active_band].ladder if d.state.active_band is not None else []
    for row, fmt in zip(d.rows, d.targets, strict=True):
        # Never a protected, tail, shared or (unless allowed) prefill block.
        assert not _protected(snap, int(row), policy)
        # Only allowed formats, and each action shrinks the block.
        assert fmt in ladder and lvl.permits(fmt)
        assert fmt.pack_ratio > snap.formats[int(snap.block_format[row])].pack_ratio


@settings(max_examples=150, deadline=None)
@given(snap=snapshots())
def test_reaches_target_when_possible(snap: Snapshot) -> None:
    policy = _policy(**{"budget.max_blocks_per_step": 10_000})
    d = decide(snap, policy, EngineState())
    if d.band is None or d.need_blocks == 0:
        assert len(d) == 0  # nothing to do: no action
        return
    ladder = policy.bands[d.state.active_band].ladder
    best = 1 / max(f.pack_ratio for f in ladder)
    possible = sum(
        max(0.0, 1 / snap.formats[int(snap.block_format[row])].pack_ratio - best)
        for row in range(snap.num_blocks)
        if not _protected(snap, row, policy)
    )
    if possible >= d.need_blocks:
        assert d.expected_freed >= d.need_blocks - 1e-9
    else:
        assert d.expected_freed == pytest.approx(possible)


def _simple(n_blocks: int, importance: list[float], free: int, total: int, **kw: object) -> Snapshot:
    req = RequestBlocks("a", importance, [HOT] * n_blocks, [B] * n_blocks, **kw)  # type: ignore[arg-type]
    return Snapshot.build(total_blocks=total, free_blocks=free, block_size=B, requests=[req])


def test_least_important_blocks_compressed_first() -> None:
    imp = [1.0, 0.9, 0.01, 0.5, 0.02, 0.8, 0.03, 0.7, 0.6, 0.9, 1.0, 1.0]
    snap = _simple(12, imp, free=8, total=20)  # pressure 0.6: below every band
    assert decide(snap, POLICY, EngineState()).band is None
    snap = _simple(12, imp, free=4, total=16)  # pressure 0.75 -> low, need ceil(0.35*16)-4 = 2; int8 frees 0.5
    d = decide(snap, POLICY, EngineState())
    assert d.band == "low" and d.need_blocks == 2
    chosen = sorted(a.block_index for a in d.actions)
    assert chosen == [2, 3, 4, 6]  # the four least important eligible blocks (0 is a sink; 10, 11 recent)
    # The price of this step's need (`engine.settled_price`) writes the coldest block at int4 at
    # once; the others take int8. A less important block never gets the milder format.
    got = {a.block_index: a.to_format.name for a in d.actions}
    assert got == {2: "int4", 4: "int8", 6: "int8", 3: "int8"}


def test_a_prefilling_request_is_compressible_only_when_the_policy_allows() -> None:
    # 12 blocks computed of a longer prompt (chunked prefill), pressure 0.75 -> band low.
    kw = {"free": 4, "total": 16, "in_prefill": True}
    assert len(decide(_simple(12, [0.1] * 12, **kw), POLICY, EngineState())) == 0  # type: ignore[arg-type]
    d = decide(_simple(12, [0.1] * 12, **kw), _policy(**{"protect.prefilling": False}), EngineState())  # type: ignore[arg-type]
    chosen = sorted(a.block_index for a in d.actions)
    assert chosen and min(chosen) >= 1 and max(chosen) <= 9  # not the sink (0), nor the recent 32 tokens (10, 11)


def test_budget_forces_upgrade_to_harsher_format() -> None:
    policy = _policy(**{"budget.max_blocks_per_step": 2})
    snap = _simple(12, [0.1] * 12, free=4, total=16)  # need 2 blocks with 2 actions: int8 gives 1
    d = decide(snap, policy, EngineState())
    assert len(d) == 2 and d.expected_freed == pytest.approx(1.5)  # both int4: the best 2 actions can do
    assert {a.to_format.name for a in d.actions} == {"int4"}


def test_fallback_level_restricts_formats() -> None:
    snap = _simple(12, [0.1] * 12, free=0, total=13)
    d = decide(snap, POLICY, EngineState(fallback_level=2))  # int8-only
    assert d.band == "high" and len(d) == 0 and "allows none" in d.reason
    d = decide(snap, POLICY, EngineState(fallback_level=1))  # quantize-only
    assert {a.to_format.name for a in d.actions} <= {"int4"}
    d = decide(snap, POLICY, EngineState(fallback_level=3))
    assert len(d) == 0


def test_failing_probes_hold() -> None:
    snap = _simple(12, [0.1] * 12, free=0, total=13)
    snap = Snapshot(**{**snap.__dict__, "probe_status": "failing"})
    d = decide(snap, POLICY, EngineState())
    assert len(d) == 0 and "probes failing" in d.reason


def test_policy_off_does_nothing() -> None:
    snap = _simple(12, [0.1] * 12, free=0, total=13)
    off = Policy(name="off", enabled=False)
    assert len(decide(snap, off, EngineState())) == 0


def test_pending_allocations_raise_pressure() -> None:
    snap = _simple(12, [0.1] * 12, free=8, total=20)
    assert snap.pressure == pytest.approx(0.6)
    pending = Snapshot(**{**snap.__dict__, "pending_blocks": 8})
    assert pending.pressure == 1.0
    d = decide(pending, POLICY, EngineState())
    assert d.band == "high" and d.need_blocks == 10
    assert d.expected_freed == pytest.approx(9 * (1 - 1 / 8))  # every eligible block (1..9) to an 8x format


def test_pool_pressure_counts_waiting_blocks_within_zero_and_one() -> None:
    """The one pressure: used fraction with the waiting blocks counted as used, clamped to [0, 1]."""
    assert pool_pressure(8, 0, 20) == pytest.approx(0.6)
    assert pool_pressure(8, 4, 20) == pytest.approx(0.8)
    assert pool_pressure(8, 30, 20) == 1.0  # more waiting than the pool holds
    assert pool_pressure(20, 0, 20) == 0.0 and pool_pressure(20, -5, 20) == 0.0  # never below 0
    assert pool_pressure(0, 0, 0) == 0.0  # an empty pool is under no pressure
    assert pool_pressure(2.5, 0, 10) == pytest.approx(0.75)  # a virtual pool's fractional free blocks


def test_hysteresis() -> None:
    bands = POLICY.bands  # low: enter .7 exit .6 ; high: enter .85 exit .75
    assert select_band(bands, 0.65, None) is None
    assert select_band(bands, 0.7, None) == 0
    assert select_band(bands, 0.65, 0) == 0  # holds above exit
    assert select_band(bands, 0.59, 0) is None
    assert select_band(bands, 0.85, 0) == 1
    assert select_band(bands, 0.8, 1) == 1  # holds
    assert select_band(bands, 0.7, 1) == 0  # falls one band
    assert select_band(bands, 0.3, 1) is None  # falls through both
    assert select_band(bands, 0.9, 5) == 1  # stale index after a swap is clamped


def test_snapshot_rejects_mismatched_columns() -> None:
    with pytest.raises(ValueError, match="one entry per block"):
        Snapshot.build(
            total_blocks=4, free_blocks=0, block_size=B, requests=[RequestBlocks("a", [1.0, 1.0], [HOT], [B, B])]
        )
    with pytest.raises(ValueError, match="free_blocks"):
        Snapshot.build(total_blocks=4, free_blocks=5, block_size=B, requests=[])


@settings(max_examples=100, deadline=None)
@given(snap=snapshots(), band=st.sampled_from([None, 0, 1]), level=st.integers(0, 3), mild=st.integers(0, 6 * B))
def test_recent_mild_window_takes_only_the_mildest_rung(snap: Snapshot, band: int | None, level: int,
                                                        mild: int) -> None:
    policy = _policy(**{"protect.recent_mild_tokens": mild, "budget.max_blocks_per_step": 10_000})
    d = decide(snap, policy, EngineState(active_band=band, fallback_level=level))
    if d.state.active_band is None:
        return
    lvl = policy.fallback.levels[level]
    mildest = [f for f in policy.bands[d.state.active_band].ladder if lvl.permits(f)][:1]
    for row, fmt in zip(d.rows, d.targets, strict=True):
        r = int(snap.block_request[row])
        if (int(snap.block_index[row]) + 1) * B > int(snap.request_tokens[r]) - mild:
            assert [fmt] == mildest


def test_recent_mild_window_keeps_the_newest_blocks_unmerged() -> None:
    """Band high under heavy pressure: without the window the engine merges blocks near the end
    too; with a 64-token window the blocks holding the last 64 tokens (before the hot recent 32)
    are int4, and the need is met by merging older blocks harder."""
    snap = _simple(40, [1.0 - i / 40 for i in range(40)], free=0, total=41)  # the newest matter least
    policy = _policy(**{"budget.max_blocks_per_step": 24})  # 24 blocks must free 21: harsher than int4
    plain = decide(snap, policy, EngineState())
    assert plain.band == "high"
    newest = {a.block_index: a.to_format.name for a in plain.actions if a.block_index >= 34}
    assert set(newest.values()) - {"int4"}  # something near the end is merged or int2 without the window
    d = decide(snap, policy.model_copy(update={"protect": policy.protect.model_copy(
        update={"recent_mild_tokens": 64})}), EngineState())
    fmts = {a.block_index: a.to_format.name for a in d.actions}
    assert all(fmts[i] == "int4" for i in fmts if (i + 1) * B > 40 * B - 64)
    assert any(fmts[i] == "int4" for i in fmts if (i + 1) * B > 40 * B - 64)
    assert any(f != "int4" for i, f in fmts.items() if (i + 1) * B <= 40 * B - 64)  # older ones merge
