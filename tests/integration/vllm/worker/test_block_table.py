"""The device block table follows the worker's host map step by step, from the step's changes only."""

from __future__ import annotations

import random

import pytest
import torch

from proxima.formats import Format
from proxima.integration.vllm.plan import CompressAction
from proxima.integration.vllm.worker.block_table import (
    HOT_CODE,
    BlockTableFull,
    DeviceBlockTable,
    TooManyFormats,
    rows_of_batch,
    step_placements,
    table_for,
)
from proxima.integration.vllm.worker.layer_formats import LayerFormats, StoredFormat
from proxima.policy.schema import Policy

INT8, INT4, FP8 = Format.parse("int8"), Format.parse("int4"), Format.parse("fp8")
NBLK = 8
"""Logical blocks per request in these tests."""


def expected_entries(table: DeviceBlockTable, remap: dict[str, dict[int, tuple[Format, int, int]]]) -> torch.Tensor:
    """The table a full rebuild from the host map would give (what the updates must equal)."""
    out = torch.zeros_like(table.entries)
    for rid, blocks in remap.items():
        row = table.rows[rid]
        for j, (fmt, dst, slot) in blocks.items():
            out[row, j, 0] = table.coded()[fmt]
            out[row, j, 1] = dst * fmt.pack_ratio + slot
    return out


def expected_owner(table: DeviceBlockTable, key_blocks: dict[int, str]) -> torch.Tensor:
    out = torch.zeros_like(table.owner)
    for blk, rid in key_blocks.items():
        out[blk] = table.rows.get(rid, 0)
    return out


def test_placements_releases_and_drops_land_in_place() -> None:
    t = DeviceBlockTable(4, NBLK, 64, "cpu")
    placed = [("a", 0, (INT8, 10, 1)), ("a", 3, (INT4, 11, 2)), ("b", 1, (FP8, 12, 0))]
    t.update(placed, [], {20: "a", 21: "b", 22: "c"})
    ra, rb = t.rows["a"], t.rows["b"]
    assert ra != rb and 0 not in (ra, rb) and "c" not in t.rows  # c has no compressed block: no row
    assert t.entries[ra, 0].tolist() == [t.code_of(INT8), 10 * INT8.pack_ratio + 1]
    assert t.entries[ra, 3].tolist() == [t.code_of(INT4), 11 * INT4.pack_ratio + 2]
    assert t.entries[ra, [1, 2]].eq(0).all() and t.entries[0].eq(0).all()
    assert t.owner[20] == ra and t.owner[21] == rb and t.owner[22] == 0
    # a revocation puts block 3 back to hot; the key block of a moves from 20 to 23
    t.update([("a", 3, None)], [], {23: "a", 21: "b"})
    assert t.entries[ra, 3, 0] == HOT_CODE
    assert t.owner[20] == 0 and t.owner[23] == ra
    # b is dropped: its row is cleared and handed to the next request
    t.update([("d", 0, (INT8, 13, 0))], ["b"], {23: "a", 30: "d"})
    assert "b" not in t.rows and t.rows["d"] == rb
    assert t.entries[rb, 1].eq(0).all() and t.entries[rb, 0, 0] == t.code_of(INT8)
    assert t.owner[21] == 0 and t.owner[30] == rb


def test_a_step_without_changes_copies_nothing() -> None:
    t = DeviceBlockTable(4, NBLK, 64, "cpu")
    t.update([("a", 0, (INT8, 10, 0))], [], {5: "a"})
    assert t.updates == 1
    t.update([], [], {5: "a"})  # the same key blocks, no action: nothing to send
    assert t.updates == 1
    t.update([("a", 1, (INT8, 10, 1))], [], {5: "a"})
    assert t.updates == 2  # one host table per step, whatever it holds


def test_random_steps_equal_a_rebuild_from_the_host_map() -> None:
    """Many steps of placements, recompressions, revocations, drops and moving key blocks: after
    every step the table equals the one a full rebuild from the host map would give."""
    rng = random.Random(0)
    t = DeviceBlockTable(6, NBLK, 200, "cpu")
    fmts = [INT8, INT4, FP8, StoredFormat(None, 1, "int4", 1)]
    remap: dict[str, dict[int, tuple[Format, int, int]]] = {}
    live = [f"r{i}" for i in range(3)]
    nxt = 3
    for _ in range(60):
        # the plan's order, as `WorkerStore.apply` runs it: drops first, then the actions
        dropped = []
        if rng.random() < 0.3:
            gone = live.pop(rng.randrange(len(live)))
            remap.pop(gone, None)
            dropped.append(gone)
            live.append(f"r{nxt}")
            nxt += 1
        placed = []
        for _ in range(rng.randrange(4)):
            rid, j = rng.choice(live), rng.randrange(NBLK)
            if rng.random() < 0.2:
                remap.get(rid, {}).pop(j, None)
                placed.append((rid, j, None))
            else:
                f = rng.choice(fmts)
                place = (f, rng.randrange(100), rng.randrange(f.pack_ratio))
                remap.setdefault(rid, {})[j] = place
                placed.append((rid, j, place))
        key_blocks = {100 + rng.randrange(100): rid for rid in live}
        t.update(placed, dropped, key_blocks)
        assert set(t.rows) >= set(remap)
        assert torch.equal(t.entries, expected_entries(t, remap))
        assert torch.equal(t.owner, expected_owner(t, key_blocks))


def test_rows_of_batch_finds_each_rows_request_through_the_slot_mapping() -> None:
    b = 16
    t = DeviceBlockTable(4, NBLK, 64, "cpu")
    t.update([("a", 0, (INT8, 10, 0)), ("c", 0, (INT4, 11, 0))], [], {3: "a", 4: "b", 7: "c"})
    # rows: a (1 token in block 3), b (no compressed block), c (2 tokens from block 7), a padding row
    slot_mapping = torch.tensor([3 * b + 5, 4 * b, 7 * b + 14, 7 * b + 15, -1])
    qsl = torch.tensor([0, 1, 2, 4, 5], dtype=torch.int32)
    rows = rows_of_batch(t.owner, slot_mapping, qsl, b)
    assert rows.tolist() == [t.rows["a"], 0, t.rows["c"], 0]


def test_full_table_and_long_requests_are_clear_errors() -> None:
    t = DeviceBlockTable(1, NBLK, 64, "cpu")
    t.update([("a", 0, (INT8, 1, 0))], [], {})
    with pytest.raises(BlockTableFull, match="no row left for request 'b'"):
        t.update([("b", 0, (INT8, 2, 0))], [], {})
    with pytest.raises(BlockTableFull, match="block 8 is past"):
        t.update([("a", NBLK, (INT8, 2, 0))], [], {})
    with pytest.raises(ValueError, match="positive sizes"):
        DeviceBlockTable(0, NBLK, 64, "cpu")


def test_step_placements_read_where_the_host_map_left_each_block() -> None:
    remap = {"a": {0: (INT8, 3, 1)}}
    acts = [CompressAction(1, "a", 0, 5, 3, 1, INT8), CompressAction(2, "a", 2, 6, 4, 0, INT8)]  # 2 failed
    assert step_placements(acts, remap) == [("a", 0, (INT8, 3, 1)), ("a", 2, None)]


def test_table_for_sizes_from_the_engine() -> None:
    kv = torch.zeros(40, 2, 16, 64)
    t = table_for({"l0": kv}, max_requests=8, max_model_len=100)
    assert t is not None and t.entries.shape == (17, 7, 2) and t.owner.shape == (40,)
    t2 = table_for({"l0": kv}, max_requests=8, max_model_len=None)
    assert t2 is not None and t2.max_blocks == 40
    assert table_for({}, 8, 100) is None


def test_the_one_pass_switch_defaults_to_the_caches_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxima.integration.vllm.worker.block_table import ONE_PASS_ENV, one_pass_decode

    monkeypatch.delenv(ONE_PASS_ENV, raising=False)
    assert one_pass_decode(torch.device("cuda", 0)) and not one_pass_decode(torch.device("cpu"))
    assert one_pass_decode() == torch.cuda.is_available()
    monkeypatch.setenv(ONE_PASS_ENV, "0")
    assert not one_pass_decode(torch.device("cuda", 0))
    monkeypatch.setenv(ONE_PASS_ENV, "1")
    assert one_pass_decode(torch.device("cpu"))
    monkeypatch.setenv(ONE_PASS_ENV, "yes")
    with pytest.raises(ValueError, match=r"PROXIMA_ONE_PASS_DECODE='yes': use 1 .* or 0"):
        one_pass_decode(torch.device("cpu"))


def test_codes_go_back_when_no_entry_holds_them_and_serve_new_formats() -> None:
    """A long-lived engine meets more formats than the kernel has codes (each change of the
    layer overrides makes new ones: the H100 soak of 2026-12-06 met 16 and its decode graphs then
    read a table that had stopped following): a code no entry holds goes back and serves the next
    format, so only the formats in use at once are bounded; beyond that a format is refused."""
    t = DeviceBlockTable(4, NBLK, 64, "cpu", max_codes=2)
    epoch = [StoredFormat(None, 1, "int4", e) for e in range(1, 6)]
    t.update([("a", 0, (INT8, 10, 0)), ("a", 1, (epoch[0], 11, 0))], [], {5: "a"})
    assert set(t.coded()) == {INT8, epoch[0]}
    assert t.refusal(epoch[1]) is not None and epoch[1] not in t.coded()  # both codes hold blocks
    with pytest.raises(TooManyFormats, match="2 formats in use"):
        t.code_of(epoch[1])
    t.update([("a", 1, None)], [], {5: "a"})  # the epoch[0] block is hot again (a revocation)
    t.release_unused()
    assert set(t.coded()) == {INT8}
    prev: list[str] = []
    for i, e in enumerate(epoch[1:]):  # every later epoch in turn: each takes the code the previous one left
        t.update([], prev, {5: "a"})  # the request before is dropped: its code goes back
        t.release_unused()
        version = t.formats_version
        assert t.refusal(e) is None and t.formats_version == version + 1
        rid = f"r{i}"
        t.update([(rid, 0, (e, 12 + i, 0))], [], {5: "a", 6 + i: rid})
        t.release_unused()
        assert set(t.coded()) == {INT8, e}
        assert torch.equal(t.entries, expected_entries(t, {"a": {0: (INT8, 10, 0)}, rid: {0: (e, 12 + i, 0)}}))
        assert t.refusal(epoch[0]) is not None  # while it holds its code, nothing else gets one
        prev = [rid]
    t.update([], ["a", *prev], {})  # dropped requests release their rows' codes
    t.release_unused()
    assert t.coded() == {}


def test_a_code_given_before_the_write_is_kept_while_the_probe_judges_it() -> None:
    """The worker asks for a code before compressing (`refusal`); the probe places the block
    steps later: the code stays while the batch is in flight, and goes once it is not."""
    t = DeviceBlockTable(4, NBLK, 64, "cpu", max_codes=1)
    assert t.refusal(INT4) is None
    t.update([], [], {5: "a"})
    t.release_unused(in_flight=[INT4])
    assert set(t.coded()) == {INT4} and t.refusal(FP8) is not None
    t.release_unused()  # the probe refused the batch: nothing holds the code
    assert t.coded() == {} and t.refusal(FP8) is None


def test_switching_back_to_earlier_overrides_reuses_their_epoch() -> None:
    """A policy switched back and forth (rollback, canary) makes no new stored formats."""
    base = Policy(enabled=False)
    other = Policy.model_validate({"enabled": False,
                                   "layer_overrides": [{"layers": [0], "substitute": {"int8": "fp8"}}]})
    lf = LayerFormats(base)
    assert lf.adopt(other) and lf.epoch == 1
    assert lf.adopt(base) and lf.epoch == 0 and lf.current(INT4) == INT4
    assert lf.adopt(other) and lf.epoch == 1 and len(lf.tables) == 2
    assert not lf.adopt(other)
