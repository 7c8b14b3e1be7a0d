"""One side-table buffer for several stored formats (`compression/side_arena.py`): a block's
metadata costs the largest format's, every format's views stay inside their block's region, and
the fields and slots of one format never overlap."""

from __future__ import annotations

import pytest
import torch

from proxima.compression.layer_stack import LayerStack
from proxima.compression.side_arena import ALIGN, SideArena, block_bytes, field_offsets
from proxima.compression.spec import SlotSpec
from proxima.formats import parse_format

L, N, H, B, D = 3, 5, 2, 32, 64
NAMES = ["int8", "int4", "int2", "fp8", "int4h", "cluster(2)+int4", "cluster(8)+int4", "cluster(4)+int2h"]


def specs() -> list[SlotSpec]:
    return [SlotSpec(parse_format(n), B, D, H) for n in NAMES]


def test_a_block_costs_the_largest_format_not_the_sum() -> None:
    ss = specs()
    m = block_bytes(ss)
    largest = max(s.fmt.pack_ratio * s.meta_bytes_per_slot for s in ss)
    assert largest <= m < largest + ALIGN * max(s.fmt.pack_ratio for s in ss) * 2
    assert m < sum(s.fmt.pack_ratio * s.meta_bytes_per_slot for s in ss) / 2
    for s in ss:  # every format's slot region is a whole, aligned share of the block's
        assert m % s.fmt.pack_ratio == 0 and (m // s.fmt.pack_ratio) % ALIGN == 0
        assert field_offsets(s)[1] <= m // s.fmt.pack_ratio


@pytest.mark.parametrize("name", NAMES)
def test_each_slot_writes_only_its_own_bytes_of_its_own_block_and_layer(name: str) -> None:
    """Write every field of one slot through the views: exactly that slot's bytes change, inside
    its block's region of its layer; the fields of the slot do not overlap."""
    ss = specs()
    arena = SideArena.allocate(ss, L, N, torch.device("cpu"))
    spec = next(s for s in ss if s.fmt.name == parse_format(name).name)
    views = arena.views(spec)
    r, m = spec.fmt.pack_ratio, arena.buffer.shape[2]
    assert set(views) == {f.name for f in spec.meta_fields()}
    for layer, block, j in ((0, 0, 0), (L - 1, N - 1, r - 1), (1, 2, r // 2)):
        arena.buffer.zero_()
        slot = block * r + j
        for i, t in enumerate(views.values()):
            assert t.shape[:2] == (L, N * r) and t.stride(1) * t.element_size() == m // r
            assert t.data_ptr() % ALIGN == 0
            t[layer, slot] = i + 1
        changed = arena.buffer.nonzero()
        assert changed[:, 0].eq(layer).all() and changed[:, 1].eq(block).all()
        lo, hi = changed[:, 2].min().item(), changed[:, 2].max().item()
        assert j * (m // r) <= lo and hi < (j + 1) * (m // r)
        for i, (fname, t) in enumerate(views.items()):  # nothing overwrote another field
            assert t[layer, slot].eq(i + 1).all(), fname


def test_the_stack_reserves_one_arena_and_gives_strangers_their_own() -> None:
    caches = {f"l{i}": torch.zeros(N, H, B, 2 * D, dtype=torch.bfloat16) for i in range(L)}
    stack = LayerStack(caches)
    ss = specs()[:4]
    stack.reserve({s.fmt: s for s in ss})
    shared = L * N * block_bytes(ss)
    assert stack.meta_bytes == shared
    pools = [stack.pool(s.fmt, s) for s in ss]
    assert stack.meta_bytes == shared  # the pools are views of the reserved arena
    base = stack.arenas[ss[0].fmt].buffer.untyped_storage().data_ptr()
    for p in pools:
        assert all(t.untyped_storage().data_ptr() == base for t in p.meta.values())
    stranger = specs()[6]
    p = stack.pool(stranger.fmt, stranger)
    assert stack.meta_bytes == shared + L * N * block_bytes([stranger])
    assert all(t.untyped_storage().data_ptr() != base for t in p.meta.values())
