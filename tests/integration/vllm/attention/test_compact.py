"""Decode rows attended entry by entry (`cpu_compact.py`): each stored token or centroid once,
weighted by its count, must give the formats' attention, on the fused and the torch fill alike."""

from __future__ import annotations

import pytest
import torch

from proxima.formats import Format
from proxima.integration.vllm.attention.cpu_compact import attend_compact, fill_compact, new_buffer, plan_compact
from proxima.integration.vllm.attention.cpu_scratch import ScratchRow, store_reader
from tests.integration.vllm.attention.test_scratch import HQ, LAYER, B, D, _reference, _scenario


def _entries(fmt: Format) -> int:
    return fmt.kept_tokens(B)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("formats", [
    [["int4", "int8", None, None]],
    [["cluster(2)+int4", None, "int4", None], [None, "cluster(4)", None]],
    [["sparse(4)+int4", "sparse(2)", None, "int2", None], ["int8", "sparse(4)", "cluster(2)+int4", None, None]],
    [["fp8", "cluster(8)+int4", "cluster(4)+int2", None], [None, None]],
    [["int4h", "int4", None, "cluster(2)+int4h", None], [None, "int2h", None]],  # lean: the torch fill
])
def test_compact_attention_equals_the_formats_attention(formats: list[list[str | None]], fused: bool) -> None:
    st, kv, rows = _scenario(formats)
    assert st.layout is not None
    plan = plan_compact([ScratchRow(blocks, seq_len, st.remap.get(rid, {})) for rid, blocks, seq_len in rows],
                        B, _entries)
    buf = new_buffer(plan, kv)
    log_w = fill_compact(plan, kv, lambda f, d, s: st.read_with_counts(LAYER, f, d, s), buf, st.layout,
                         raw=store_reader(st, LAYER) if fused else None)
    q = torch.randn(len(rows), HQ, D).to(torch.bfloat16)
    got = attend_compact(q, buf, log_w, plan, D**-0.5)
    for i, (rid, blocks, seq_len) in enumerate(rows):
        want = _reference(st, kv, rid, blocks, seq_len, q[i].float())
        torch.testing.assert_close(got[i], want, atol=2e-3, rtol=2e-3)


def test_a_layer_storing_fewer_centroids_masks_the_rest() -> None:
    """Entries planned for the largest layer format: a layer storing fewer leaves its spare
    positions at weight 0, so the answer is still that layer's formats' attention."""
    st, kv, rows = _scenario([["cluster(4)", None, "int4", None]])
    assert st.layout is not None
    plan = plan_compact([ScratchRow(b, n, st.remap.get(rid, {})) for rid, b, n in rows], B, lambda f: B)
    buf = new_buffer(plan, kv)
    log_w = fill_compact(plan, kv, lambda f, d, s: st.read_with_counts(LAYER, f, d, s), buf, st.layout,
                         raw=store_reader(st, LAYER))
    spare = plan.groups[[str(g.fmt) for g in plan.groups].index("cluster(4)")].target[:, B // 4:]
    assert torch.isinf(log_w[spare.reshape(-1)]).all()
    q = torch.randn(1, HQ, D).to(torch.bfloat16)
    rid, blocks, seq_len = rows[0]
    want = _reference(st, kv, rid, blocks, seq_len, q[0].float())
    torch.testing.assert_close(attend_compact(q, buf, log_w, plan, D**-0.5)[0], want, atol=2e-3, rtol=2e-3)


def test_each_centroid_takes_one_position() -> None:
    """The point of the module: a row's width is its stored entries, not its tokens."""
    st, _kv, rows = _scenario([["cluster(8)+int4", "cluster(4)", "int4", None, None]])
    rid, blocks, seq_len = rows[0]
    plan = plan_compact([ScratchRow(blocks, seq_len, st.remap.get(rid, {}))], B, _entries)
    assert seq_len == 4 * B + 5
    assert plan.width == B // 8 + B // 4 + B + B + 5


def test_a_prefill_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="decode rows"):
        plan_compact([ScratchRow([1, 2], 2 * B, {}, query_len=3)], B, _entries)
