import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxima.formats import Format
from proxima.policy.packing import PackedPool, PoolExhausted

F = Format.parse


def test_in_place_then_packing_frees_whole_blocks() -> None:
    pool = PackedPool(8)
    for _ in range(5):
        pool.append_hot("a")
    assert pool.free_blocks == 3
    moves = [pool.compress("a", i, F("int4")) for i in range(4)]
    # First move is in place (frees nothing), the next three share its block and free theirs.
    assert moves[0].freed == () and moves[0].dst.phys == moves[0].src.phys
    assert [len(m.freed) for m in moves[1:]] == [1, 1, 1]
    assert {m.dst.phys for m in moves} == {moves[0].src.phys}
    assert [m.dst.slot for m in moves] == [0, 1, 2, 3]
    assert pool.free_blocks == 6 and pool.fragmentation_blocks() == 0  # the int4 block is full
    pool.check()
    kept = {moves[0].dst.phys, pool.blocks("a")[4].phys}
    assert sorted(pool.free_request("a")) == sorted(kept)
    assert pool.free_blocks == 8
    pool.check()


def test_recompression_vacates_old_destination() -> None:
    pool = PackedPool(6)
    for _ in range(4):
        pool.append_hot("a")
    pool.compress("a", 0, F("int8"))
    pool.compress("a", 1, F("int8"))  # int8 block holds slots 0, 1 -> full
    assert pool.free_blocks == 3
    m = pool.compress("a", 0, F("int4"))  # needs a new int4 block: slot 0's block still holds slot 1
    assert m.freed == () and m.dst.phys != m.src.phys
    assert pool.free_blocks == 2
    m = pool.compress("a", 1, F("int4"))  # the int8 block empties and is freed
    assert m.freed == (m.src.phys,)
    assert pool.free_blocks == 3
    pool.check()


def test_compress_needs_a_block_when_source_is_shared_physically() -> None:
    pool = PackedPool(2)
    pool.append_hot("a")
    pool.append_hot("a")
    pool.compress("a", 0, F("int8"))
    pool.compress("a", 1, F("int8"))  # both in one block; one block free
    pool.append_hot("a")  # pool full now
    with pytest.raises(PoolExhausted):
        pool.compress("a", 0, F("int4"))
    pool.check()  # a failed compression changes nothing


def test_rejects_non_shrinking_move() -> None:
    pool = PackedPool(2)
    pool.append_hot("a")
    pool.compress("a", 0, F("int4"))
    with pytest.raises(ValueError, match="does not shrink"):
        pool.compress("a", 0, F("int8"))


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["append", "compress", "free"]),
            st.integers(0, 3),
            st.integers(0, 40),
            st.sampled_from(["int8", "int4", "int2", "sparse(2)+int8"]),
        ),
        max_size=120,
    )
)
def test_accounting_holds_under_any_sequence(ops: list) -> None:
    pool = PackedPool(24)
    for op, r, idx, fmt in ops:
        rid = f"r{r}"
        try:
            if op == "append":
                pool.append_hot(rid)
            elif op == "free":
                pool.free_request(rid)
            elif pool.num_logical(rid):
                i = idx % pool.num_logical(rid)
                if pool.blocks(rid)[i].fmt.pack_ratio < F(fmt).pack_ratio:
                    pool.compress(rid, i, F(fmt))
        except PoolExhausted:
            pass
        pool.check()
    for rid in pool.requests():
        pool.free_request(rid)
    pool.check()
    assert pool.free_blocks == 24
