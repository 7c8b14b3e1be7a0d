"""The placement model over a counter pool: packing, give-back, and the invariants it states."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxima.formats import Format
from proxima.placement import BlockId, CounterPool, SlotIndex, SlotPacker, check_pool

F = Format.parse


class _Recorder(CounterPool):
    """A counter pool that records what came back through `give_back` (the one path)."""

    def __init__(self, total: int) -> None:
        super().__init__(total)
        self.given_back: list[BlockId] = []

    def give_back(self, blocks: list[BlockId], *, free_now: bool = True) -> None:
        self.given_back.extend(blocks)
        super().give_back(blocks, free_now=free_now)


def test_a_request_fills_one_destination_per_format_before_taking_another() -> None:
    pool = _Recorder(8)
    p = SlotPacker(pool)
    got = [p.reserve("a", F("int4")) for _ in range(5)]
    assert [s for _, s in got] == [0, 1, 2, 3, 0]  # 4 slots per int4 block, then a second block
    assert len({b for b, _ in got[:4]}) == 1 and got[4][0] != got[0][0]
    assert pool.num_free() == 6
    other = p.reserve("b", F("int4"))  # another request never shares a's open destination
    assert other is not None and other[0] not in {b for b, _ in got}
    live = {"a": got, "b": [other]}
    p.check(live)
    check_pool(8, pool.free_ids(), pool.num_free(), [], p)
    assert p.fragmentation_blocks() == pytest.approx(3 / 4 + 3 / 4)


def test_a_destination_goes_back_only_when_no_live_slot_remains() -> None:
    pool = _Recorder(4)
    p = SlotPacker(pool)
    slots = [p.reserve("a", F("int8")) for _ in range(2)]  # int8: 2 slots, the block is full
    block = slots[0][0]
    p.release("a", block, slots[0][1])  # recompressed elsewhere: one live slot left
    assert pool.given_back == [] and p.owned() == {block}
    p.release("a", block, slots[1][1])
    assert pool.given_back == [block] and p.owned() == set()


def test_failed_slots_are_taken_back_by_the_open_destination() -> None:
    pool = _Recorder(4)
    p = SlotPacker(pool)
    a = p.reserve("a", F("int4"))
    b = p.reserve("a", F("int4"))
    assert a is not None and b is not None
    p.release("a", b[0], b[1], undo=True)  # latest first: slot 1 is handed out again
    assert p.reserve("a", F("int4")) == b
    p.release("a", b[0], b[1], undo=True)
    p.release("a", a[0], a[1], undo=True)  # the destination is empty again: back to the pool
    assert pool.given_back == [a[0]] and pool.num_free() == 4


def test_released_request_returns_every_destination_once() -> None:
    pool = _Recorder(6)
    p = SlotPacker(pool)
    for fmt in ("int8", "int4", "int4", "int4", "int4", "int4"):
        assert p.reserve("a", F(fmt)) is not None
    held = p.owned()
    assert sorted(p.release_request("a")) == sorted(held) == sorted(pool.given_back)
    assert p.release_request("a") == [] and pool.num_free() == 6


def test_an_empty_source_refuses_a_new_destination() -> None:
    p = SlotPacker(CounterPool(1))
    assert p.reserve("a", F("int8")) is not None
    assert p.reserve("a", F("int4")) is None  # int8's block is open but of another format
    assert p.reserve("a", F("int8")) is not None  # its open destination still has a slot


def test_check_catches_a_slot_the_user_no_longer_holds() -> None:
    pool = CounterPool(4)
    p = SlotPacker(pool)
    blk, slot = p.reserve("a", F("int4")) or (BlockId(-1), SlotIndex(-1))
    p.check({"a": [(blk, slot)]})
    with pytest.raises(AssertionError, match="live slots nobody holds"):
        p.check({"a": []})
    with pytest.raises(AssertionError, match="owned 1 \\+ free 3 != total 5"):
        check_pool(5, pool.free_ids(), pool.num_free(), [], p)
    with pytest.raises(AssertionError, match="hot and destination"):
        check_pool(4, pool.free_ids(), pool.num_free(), [blk], p)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["reserve", "commit_release", "fail", "finish"]),
                              st.integers(0, 3), st.integers(0, 40),
                              st.sampled_from(["int8", "int4", "int2", "sparse(2)+int8"])), max_size=150))
def test_invariants_hold_under_any_sequence(ops: list[tuple[str, int, int, str]]) -> None:
    pool = CounterPool(12)
    p = SlotPacker(pool)
    live: dict[str, list[tuple[BlockId, SlotIndex]]] = {}
    for op, r, k, fmt in ops:
        rid = f"r{r}"
        mine = live.setdefault(rid, [])
        if op == "reserve":
            got = p.reserve(rid, F(fmt))
            if got is not None:
                mine.append(got)
        elif op == "finish":
            p.release_request(rid)
            mine.clear()
        elif mine:  # release one slot: a recompression's old slot, or a failure (latest first)
            i = len(mine) - 1 if op == "fail" else k % len(mine)
            blk, slot = mine.pop(i)
            p.release(rid, blk, slot, undo=op == "fail")
        p.check(live)
        check_pool(12, pool.free_ids(), pool.num_free(), [], p)
    for rid in list(live):
        p.release_request(rid)
    assert pool.num_free() == 12
