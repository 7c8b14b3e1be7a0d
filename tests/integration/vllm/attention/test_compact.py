"""Decode rows attended entry by entry (`cpu_compact.py`): each stored token or centroid once,
where it lies, weighted by its count, must give the formats' attention."""

from __future__ import annotations

import pytest
import torch

from proxima.formats import Format
from proxima.integration.vllm.attention.cpu_compact import attend_compact, plan_compact
from proxima.integration.vllm.attention.cpu_scratch import ScratchRow, store_reader
from tests.integration.vllm.attention.test_scratch import HQ, LAYER, B, D, _reference, _scenario


def _attend(formats: list[list[str | None]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(compact attention of one random query per row, the formats' reference) [R, HQ, D]."""
    st, kv, rows = _scenario(formats, seed)
    assert st.layout is not None
    plan = plan_compact([ScratchRow(blocks, seq_len, st.remap.get(rid, {})) for rid, blocks, seq_len in rows], B)
    q = torch.randn(len(rows), HQ, D).to(torch.bfloat16)
    got = attend_compact(plan, q, kv, st.layout, lambda f, d, s: st.read_with_counts(LAYER, f, d, s),
                         store_reader(st, LAYER), D**-0.5)
    want = torch.stack([_reference(st, kv, rid, blocks, seq_len, q[i].float())
                        for i, (rid, blocks, seq_len) in enumerate(rows)])
    return got, want


@pytest.mark.parametrize("formats", [
    [["int4", "int8", None, None]],
    [["cluster(2)+int4", None, "int4", None], [None, "cluster(4)", None]],
    [["sparse(4)+int4", "sparse(2)", None, "int2", None], ["int8", "sparse(4)", "cluster(2)+int4", None, None]],
    [["fp8", "cluster(8)+int4", "cluster(4)+int2", None], [None, None]],
    [["int4h", "int4", None, "cluster(2)+int4h", None], [None, "int2h", None]],  # lean: decoded by torch first
])
def test_compact_attention_equals_the_formats_attention(formats: list[list[str | None]]) -> None:
    got, want = _attend(formats)
    # The reference rounds decoded values to bf16 (the cache dtype); the kernels keep float32.
    torch.testing.assert_close(got, want, atol=3e-3, rtol=3e-3)


def test_a_row_of_hot_blocks_only_is_plain_attention() -> None:
    got, want = _attend([[None, None, None]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_counts_weigh_the_centroids() -> None:
    """Without the log-count term a cluster row's answer moves: the weighting is what is tested."""
    from proxima.integration.vllm.attention import cpu_compact

    got, want = _attend([["cluster(4)", "cluster(8)+int4", None, None]], seed=3)
    torch.testing.assert_close(got, want, atol=3e-3, rtol=3e-3)
    counts = cpu_compact.no_counts()
    orig = cpu_compact.attend_compact.__globals__["kernels"].attend_slots

    def uncounted(q, heads, rows, ptr, entries, lc, *rest):  # type: ignore[no-untyped-def]
        return orig(q, heads, rows, ptr, entries, counts, *rest)

    cpu_compact.kernels.attend_slots = uncounted
    try:
        wrong, _ = _attend([["cluster(4)", "cluster(8)+int4", None, None]], seed=3)
    finally:
        cpu_compact.kernels.attend_slots = orig
    assert (wrong - want).abs().max() > 1e-2


def test_the_plan_keeps_slots_by_row_and_hot_blocks_in_place() -> None:
    st, _kv, rows = _scenario([["cluster(8)+int4", None, "int4", None], ["int4", None]])
    plan = plan_compact([ScratchRow(b, n, st.remap.get(rid, {})) for rid, b, n in rows], B)
    (_r0, blocks0, n0), (_r1, blocks1, n1) = rows
    assert plan.blk_ids.tolist() == [blocks0[1], blocks0[3], blocks1[1]]  # hot block, then each tail
    assert plan.blk_len.tolist() == [B, n0 - 3 * B, n1 - B]
    by_fmt = {str(g.fmt): g.slot_ptr.tolist() for g in plan.groups}
    assert by_fmt == {"cluster(8)+int4": [0, 1, 1], "int4": [0, 1, 2]}


def test_a_prefill_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="decode rows"):
        plan_compact([ScratchRow([1, 2], 2 * B, {}, query_len=3)], B)


def test_a_compressed_tail_is_refused() -> None:
    with pytest.raises(ValueError, match="must stay hot"):
        plan_compact([ScratchRow([1, 2], 2 * B, {1: (Format.parse("int4"), 9, 0)})], B)


def test_warm_up_compiles_every_variant_a_step_calls() -> None:
    """After `warm_up` over the stored formats' pools, a real step compiles nothing new (a first
    compile takes 10-20 s: inside a step it would stall every request)."""
    from proxima.integration.vllm.attention import cpu_compact

    formats = [["int4", "cluster(8)+int4", "fp8", None, None], ["int8", "cluster(4)", "int4h", None]]
    st, kv, _rows = _scenario(formats)
    assert st.layout is not None
    one = torch.zeros(1, dtype=torch.long)
    names = sorted({f for fs in formats for f in fs if f is not None})
    cpu_compact.warm_up(kv, st.layout, [store_reader(st, LAYER)(Format.parse(f), one, one) for f in names])
    k = cpu_compact.kernels
    before = (len(k.attend_pages.signatures), len(k.attend_slots.signatures))
    _attend(formats)
    assert (len(k.attend_pages.signatures), len(k.attend_slots.signatures)) == before


@pytest.mark.parametrize("order", ["token-major", "channel-major keys", "scattered"])
def test_pages_are_read_in_any_page_order(order: str) -> None:
    """vLLM's CPU page order depends on its ISA: the pages kernel's two fast paths (contiguous
    token-major, contiguous channel-major) and its general path read the same tokens."""
    from proxima.integration.vllm.attention import cpu_compact
    from proxima.integration.vllm.worker.page_layout import PageLayout

    n = B * D
    key_pos, value_pos = torch.arange(n), torch.arange(n, 2 * n)
    if order == "channel-major keys":
        key_pos = (torch.arange(D).view(1, D) * B + torch.arange(B).view(B, 1)).flatten()
    elif order == "scattered":
        perm = torch.randperm(2 * n, generator=torch.Generator().manual_seed(0))
        key_pos, value_pos = perm[:n], perm[n:]
    layout = PageLayout(B, D, key_pos, value_pos)
    torch.manual_seed(1)
    nb, h = 6, 2
    kv = torch.randn(nb, h, B, 2 * D).to(torch.bfloat16)
    rows = [ScratchRow([3, 1, 4], 2 * B + 7, {}), ScratchRow([5, 2], B + 1, {})]
    plan = plan_compact(rows, B)
    q = torch.randn(len(rows), HQ, D).to(torch.bfloat16)
    got = attend_compact(plan, q, kv, layout, lambda f, d, s: None, lambda f, d, s: None, D**-0.5)  # type: ignore[arg-type, return-value]
    for i, row in enumerate(rows):
        nblk = -(-row.seq_len // B)
        k, v = layout.read_blocks(kv, torch.tensor(row.blocks[:nblk]))  # [nblk, B, H, D]
        k, v = k.reshape(-1, h, D)[: row.seq_len].float(), v.reshape(-1, h, D)[: row.seq_len].float()
        kq, vq = k.repeat_interleave(HQ // h, 1), v.repeat_interleave(HQ // h, 1)
        p = torch.softmax(torch.einsum("hd,thd->th", q[i].float(), kq) * D**-0.5, 0)
        torch.testing.assert_close(got[i], torch.einsum("th,thd->hd", p, vq), atol=1e-4, rtol=1e-4)  # (the exp: 4e-6)
    assert cpu_compact.AVAILABLE
