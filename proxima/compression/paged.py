"""Attention for a batch of paged requests whose contexts mix hot blocks and compressed slots.

This is the compute core of the CUDA attention backend (`proxima.integration.vllm.attention.triton`),
kept free of vLLM so that it runs wherever Proxima's kernels run (GPU, or CPU under
`TRITON_INTERPRET=1`). A request is described by its block table, its length, its query length
and the placement of its compressed logical blocks; `plan_rows` turns a batch of such requests
into `KVSegment` tables (one hot segment reading vLLM's cache in place, one segment per
compressed format reading its slot pool), and `paged_attention` runs `decode_attention` over them:
one split-K partial per segment, merged by log-sum-exp.

Queries longer than one token (chunked prefill, speculative verification) are expanded to one
decode row per query token; the row's hot entries are clipped to that token's causal position.
Exact, but every query token re-reads the context: meant for the occasional prefill row that
meets a compressed block, not for long prompts (those never have compressed blocks today: the
scheduler compresses after prefill).

Named dims: R requests, Sq query tokens (rows of the decode kernel), Hq query heads, D head dim,
B block size, NB the longest request's logical blocks, E entries of one segment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from proxima.compression.attention import decode_attention
from proxima.compression.blocks import Backend, CompressedBlocks, kept_count
from proxima.compression.segment import KVSegment
from proxima.formats import Format

Placement = tuple[Format, int, int]
"""Where a compressed logical block lives: (format, destination physical block, slot in it)."""


@dataclass(frozen=True)
class PagedRow:
    """One request of the batch."""

    block_ids: Sequence[int]
    """Physical block of each logical block (entries of compressed logical blocks are ignored:
    vLLM's table holds its null block there once the source is freed)."""
    seq_len: int
    """Context length including this step's query tokens (already written to the cache)."""
    query_len: int = 1
    compressed: Mapping[int, Placement] = field(default_factory=dict)


@dataclass
class SegmentTable:
    """One segment's tables, before the pool is attached: `KVSegment` minus the store."""

    fmt: Format
    slot_table: torch.Tensor  # int32 [Sq, E]
    slot_tokens: torch.Tensor  # int32 [Sq, E], 0 = padding
    logical_block: torch.Tensor  # long [Sq, E]: the request's logical block of each entry (0 for padding)


@dataclass
class PagedPlan:
    """Everything `paged_attention` needs besides q and the pools; built once per step."""

    num_requests: int
    max_blocks: int
    query_request: torch.Tensor
    """long [Sq]: request of each query row."""
    query_weight: torch.Tensor
    """float32 [Sq]: 1 / query_len of the row's request (averages block mass over its queries)."""
    segments: list[SegmentTable]
    """The hot segment first (format bf16), then one per compressed format."""

    def to(self, device: torch.device | str) -> PagedPlan:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        segs = [
            SegmentTable(s.fmt, move(s.slot_table), move(s.slot_tokens), move(s.logical_block)) for s in self.segments
        ]
        return PagedPlan(self.num_requests, self.max_blocks, move(self.query_request), move(self.query_weight), segs)


def _entry_tokens(fmt: Format, logical: torch.Tensor, visible: torch.Tensor, block_size: int) -> torch.Tensor:
    """Valid tokens [Sq_r, E_r] of each entry for each query row of one request.

    visible [Sq_r, 1]: tokens the query row may see (its position + 1). A quantized slot keeps
    token order, so a partly visible block is clipped. A token-reducing slot has no order left
    (kept tokens or centroids), so it must be fully visible or not at all.
    """
    seen = (visible - logical.unsqueeze(0) * block_size).clamp(0, block_size)  # [Sq_r, E_r]
    if fmt.reduction is None:
        return seen
    partial = (seen > 0) & (seen < block_size)
    if bool(partial.any()):
        raise ValueError(f"{fmt}: a token-reducing slot cannot be partly visible to a query (causal boundary)")
    return torch.where(seen == block_size, kept_count(fmt, block_size), 0)


def plan_rows(rows: Sequence[PagedRow], block_size: int) -> PagedPlan:
    """Tables for every segment (on the CPU; move them with `PagedPlan.to`)."""
    b = block_size
    per_fmt: dict[Format, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    hot = Format()
    query_request: list[torch.Tensor] = []
    query_weight: list[torch.Tensor] = []
    max_blocks = 0
    for r, row in enumerate(rows):
        nb = -(-row.seq_len // b)
        max_blocks = max(max_blocks, nb)
        if row.query_len < 1 or row.query_len > row.seq_len or len(row.block_ids) < nb:
            raise ValueError(
                f"row {r}: need 1 <= query_len <= seq_len and a block per {b} tokens, got query_len "
                f"{row.query_len}, seq_len {row.seq_len}, {len(row.block_ids)} blocks"
            )
        visible = torch.arange(row.seq_len - row.query_len + 1, row.seq_len + 1).unsqueeze(1)  # [q, 1]
        by_fmt: dict[Format, tuple[list[int], list[int]]] = {hot: ([], [])}
        for j in range(nb):
            place = row.compressed.get(j)
            if place is None:
                slots, logical = by_fmt[hot]
                slots.append(int(row.block_ids[j]))
            else:
                fmt, dst, slot = place
                if fmt.is_hot:
                    raise ValueError(f"row {r}, block {j}: a compressed placement cannot have format bf16")
                slots, logical = by_fmt.setdefault(fmt, ([], []))
                slots.append(dst * fmt.pack_ratio + slot)
            logical.append(j)
        for fmt, (slots, logical) in by_fmt.items():
            lt = torch.tensor(logical, dtype=torch.long)
            ntok = _entry_tokens(fmt, lt, visible, b)
            tab = torch.tensor(slots, dtype=torch.int32).expand(row.query_len, -1)
            per_fmt.setdefault(fmt, []).append((r, tab, ntok.int(), lt.expand(row.query_len, -1)))
        query_request.append(torch.full((row.query_len,), r, dtype=torch.long))
        query_weight.append(torch.full((row.query_len,), 1.0 / row.query_len))
    # every request contributes its query rows to every segment, padded where it has no entries
    row_counts = [row.query_len for row in rows]
    segments = []
    for fmt in sorted(per_fmt, key=lambda f: (not f.is_hot, f.name)):
        segments.append(_pad_segment(fmt, per_fmt[fmt], row_counts))
    empty = torch.zeros(0, dtype=torch.long)
    return PagedPlan(
        len(rows), max_blocks,
        torch.cat(query_request) if rows else empty,
        torch.cat(query_weight) if rows else empty.float(),
        segments,
    )  # fmt: skip


def _pad_segment(
    fmt: Format, parts: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]], row_counts: list[int]
) -> SegmentTable:
    """Stack one format's per-request tables (request, slots, tokens, logical blocks) into [Sq, E];
    requests without this format get padding rows (0 tokens)."""
    width = max((p[1].shape[1] for p in parts), default=0)
    sq = sum(row_counts)
    tab = torch.zeros(sq, max(width, 1), dtype=torch.int32)
    ntok = torch.zeros_like(tab)
    logical = torch.zeros(sq, max(width, 1), dtype=torch.long)
    starts = [0]
    for c in row_counts:
        starts.append(starts[-1] + c)
    for r, t, n, lg in parts:
        e = t.shape[1]
        tab[starts[r] : starts[r + 1], :e] = t
        ntok[starts[r] : starts[r + 1], :e] = n
        logical[starts[r] : starts[r + 1], :e] = lg
    return SegmentTable(fmt, tab, ntok, logical)


@dataclass
class PagedOutput:
    out: torch.Tensor
    """[Sq, Hq, D] attention output, q's dtype."""
    lse: torch.Tensor
    """[Sq, Hq] float32 log-sum-exp over the whole context."""
    entry_lse: list[torch.Tensor]
    """Per segment of the plan, [Sq, E, Hq] float32."""
    plan: PagedPlan

    @property
    def block_mass(self) -> torch.Tensor:
        """float32 [R, NB, Hq]: attention mass of each request's logical block per query head,
        averaged over the request's query tokens (sums to 1 over the blocks; 0 past the
        request's end). Computed on access from the kernels' per-entry log-sum-exp: a few small
        launches, no extra pass over the KV."""
        p = self.plan
        sq, hq = self.lse.shape
        per_query = torch.zeros(sq, max(p.max_blocks, 1), hq, device=self.lse.device, dtype=torch.float32)
        for seg, ent in zip(p.segments, self.entry_lse, strict=True):
            mass = torch.exp(ent - self.lse.unsqueeze(1)).nan_to_num(0.0)  # [Sq, E, Hq]; padding: 0
            per_query.scatter_add_(1, seg.logical_block.unsqueeze(-1).expand(-1, -1, hq), mass)
        per_query *= p.query_weight.view(-1, 1, 1)
        out = torch.zeros(p.num_requests, *per_query.shape[1:], device=per_query.device, dtype=torch.float32)
        return out.index_add_(0, p.query_request, per_query)


def paged_attention(
    q: torch.Tensor,
    plan: PagedPlan,
    hot: CompressedBlocks,
    pools: Mapping[Format, CompressedBlocks],
    *,
    sm_scale: float | None = None,
    backend: Backend = "auto",
    num_splits: int | None = None,
) -> PagedOutput:
    """q [Sq, Hq, D] (the batch's query tokens in plan order) attends to each request's context.

    `hot` is vLLM's cache seen as slots (`layout.hot_store`, slot id = physical block); `pools[f]`
    every slot of format f (slot id = destination block * pack ratio + slot). Each segment yields
    a partial output and log-sum-exp; `decode_attention` merges them in one launch.
    """
    if q.shape[0] != plan.query_request.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows, the plan {plan.query_request.shape[0]} query tokens")
    segments = []
    for st in plan.segments:
        store = hot if st.fmt.is_hot else pools.get(st.fmt)
        if store is None:
            raise ValueError(f"the plan reads format {st.fmt} but no pool was given for it")
        segments.append(KVSegment(store, st.slot_table, st.slot_tokens))
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    res = decode_attention(q, segments, sm_scale=scale, backend=backend, num_splits=num_splits)
    return PagedOutput(res.out, res.lse, res.entry_lse, plan)
