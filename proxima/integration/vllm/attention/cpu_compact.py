"""Decode rows with compressed blocks on CPU: every stored entry attended once, weighted by its count.

The scratch (`cpu_scratch.py`) rebuilds a row as vLLM's kernel wants it: whole bf16 blocks, each
cluster centroid repeated by its count. Its work grows with the row's *tokens*, not with what is
stored: a cluster(8)+int4 block holds 4 centroids, yet the scratch decodes 32 tokens and the kernel
reads 32. On the CPU capacity workload that made the scratch fill 27% and Proxima's attention 39%
of the aggressive process (py-spy, `bench/results/capacity-cpu.md`, 2026-12-07).

A decode row has one query, which sees every token before it: no causal mask inside the row, so
the order of its entries does not matter. This module packs the decode rows' entries into a dense
buffer `[R * L, H, 2, D]` (row r at `[r * L, r * L + len_r)`, zero padding after it): hot blocks
and the tail's tokens copied from vLLM's pages, each compressed slot's stored tokens or centroids
decoded once (the same numba kernels as the scratch, or the torch reference). Next to it a
log-weight per entry and head: log(count) for centroids, 0 for exact tokens, -inf for padding and
for slot positions a layer's format leaves unused (a layer override may store fewer centroids
than another layer). Attention is then a count-weighted softmax, two batched matmuls per layer in
float32 for all the rows: the repetition's math (n copies of a key add n * exp(q.k) =
exp(q.k + log n)) at the cost of the stored entries.

Prefill chunks over compressed blocks (causal within the chunk) keep the scratch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from proxima.compression.spec import LEAN_BITS
from proxima.formats import Format
from proxima.integration.vllm.attention.cpu_scratch import (
    NO_TOKEN_MAP,
    RawReader,
    Reader,
    ScratchRow,
    decode_slots,
    fused_kernels,
    identity_positions,
)
from proxima.integration.vllm.worker.page_layout import PageLayout

L = torch.long


@dataclass(frozen=True)
class CompactGroup:
    """The compressed blocks of one (scheduler's) format, all rows together."""

    fmt: Format
    dst: torch.Tensor  # long [N]
    slot: torch.Tensor  # long [N]
    target: torch.Tensor
    """long [N, C]: buffer positions of each slot's entries; C is the most entries any layer stores
    for `fmt` (a layer storing fewer leaves the rest at log-weight -inf)."""


@dataclass
class CompactPlan:
    rows: int
    width: int
    """Entries per row in the buffer (the longest row's; shorter rows are padded)."""
    hot_src: torch.Tensor  # long [Nh]: hot physical blocks, copied whole
    hot_dst: torch.Tensor  # long [Nh * B]: buffer position of each of their tokens
    tok_src: torch.Tensor  # long [Nt]: flat cache positions (block * B + offset) of the tails' tokens
    tok_dst: torch.Tensor  # long [Nt]
    log_weight: torch.Tensor
    """float32 [R * L, 1]: 0 for a position that holds an entry, -inf for padding."""
    groups: list[CompactGroup] = field(default_factory=list)

    @property
    def positions(self) -> int:
        return self.rows * self.width


def plan_compact(rows: list[ScratchRow], block_size: int, entries: Callable[[Format], int]) -> CompactPlan:
    """Lay out decode rows (query_len 1) entry by entry. `entries(fmt)`: the most entries (tokens
    or centroids) a slot of `fmt` holds in any layer."""
    b = block_size
    sizes: dict[Format, int] = {}
    lengths: list[int] = []
    for row in rows:
        if row.query_len != 1:
            raise ValueError(f"compact attention serves decode rows (1 query token), got {row.query_len}")
        last = (row.seq_len - 1) // b  # the block holding the query, and the tail
        bad = [j for j in row.remap if j >= last]
        if bad:  # the engine never compresses a block that receives queries (the hot tail)
            raise ValueError(f"blocks {bad} of a row are compressed but hold its query token: they must stay hot")
        n = row.seq_len - last * b
        for j in range(last):
            hit = row.remap.get(j)
            if hit is None:
                n += b
            else:
                if hit[0] not in sizes:
                    sizes[hit[0]] = entries(hit[0])
                n += sizes[hit[0]]
        lengths.append(n)
    width = max(lengths, default=1)
    hot_src: list[int] = []
    hot_dst: list[int] = []
    tok_src: list[torch.Tensor] = []
    tok_dst: list[torch.Tensor] = []
    groups: dict[Format, tuple[list[int], list[int], list[int]]] = {}
    for r, row in enumerate(rows):
        pos = r * width
        last = (row.seq_len - 1) // b
        for j in range(last):
            hit = row.remap.get(j)
            if hit is None:
                hot_src.append(row.blocks[j])
                hot_dst.append(pos)
                pos += b
            else:
                g = groups.setdefault(hit[0], ([], [], []))
                g[0].append(hit[1])
                g[1].append(hit[2])
                g[2].append(pos)
                pos += sizes[hit[0]]
        tail = row.seq_len - last * b
        tok_src.append(row.blocks[last] * b + torch.arange(tail))
        tok_dst.append(torch.arange(pos, pos + tail))
    log_weight = torch.full((len(rows), width), float("-inf"))
    log_weight[torch.arange(width).view(1, -1) < torch.tensor(lengths, dtype=L).view(-1, 1)] = 0.0
    empty = torch.zeros(0, dtype=L)
    plan = CompactPlan(
        rows=len(rows), width=width,
        hot_src=torch.tensor(hot_src, dtype=L),
        hot_dst=(torch.tensor(hot_dst, dtype=L).view(-1, 1) + torch.arange(b)).flatten(),
        tok_src=torch.cat(tok_src) if tok_src else empty,
        tok_dst=torch.cat(tok_dst) if tok_dst else empty,
        log_weight=log_weight.view(-1, 1),
    )  # fmt: skip
    for fmt, (dsts, slots, starts) in groups.items():
        target = torch.tensor(starts, dtype=L).view(-1, 1) + torch.arange(sizes[fmt])
        plan.groups.append(CompactGroup(fmt, torch.tensor(dsts, dtype=L), torch.tensor(slots, dtype=L), target))
    return plan


def new_buffer(plan: CompactPlan, kv: torch.Tensor) -> torch.Tensor:
    """The step's entry buffer [R * L, H, 2, D], reused by every layer. Zeroed: padding is read
    (with weight 0) by the matmuls, and 0 * NaN would poison a row."""
    h, d = kv.shape[1], kv.shape[3] // 2
    return kv.new_zeros((plan.positions, h, 2, d))


def fill_compact(plan: CompactPlan, kv: torch.Tensor, read: Reader, buf: torch.Tensor,
                 layout: PageLayout, raw: RawReader | None = None) -> torch.Tensor:
    """Fill `buf` from one layer's cache `kv` [N, H, B, 2D]; returns the layer's log-weights
    float32 [R * L, H]. Compressed slots go through the fused numba kernels when `raw` is given
    (and the slot format is one they read), else through `read` (the torch reference)."""
    h, b, d = kv.shape[1], kv.shape[2], kv.shape[3] // 2
    if len(plan.hot_src):
        k, v = layout.read_blocks(kv, plan.hot_src)  # [Nh, B, H, D], canonical
        buf[plan.hot_dst, :, 0] = k.reshape(-1, h, d)
        buf[plan.hot_dst, :, 1] = v.reshape(-1, h, d)
    if len(plan.tok_src):
        buf[plan.tok_dst] = layout.read_tokens(kv, plan.tok_src)
    log_w = plan.log_weight.expand(-1, h).clone()
    kernels = fused_kernels(buf, raw)
    # The kernels see the buffer as pages of one token: uint16 [R * L, H, 2D], canonical order.
    out = buf.view(buf.shape[0], h, 2 * d).view(torch.int16).numpy().view("uint16") if kernels is not None else None
    for g in plan.groups:
        slots = raw(g.fmt, g.dst, g.slot) if kernels is not None and raw is not None else None
        counts: torch.Tensor | None
        if slots is not None and out is not None and slots.fmt.quant not in LEAN_BITS:  # (no lean slots in numba)
            c = slots.fmt.kept_tokens(b)
            decode_slots(kernels, slots, NO_TOKEN_MAP, g.target[:, :c].contiguous().numpy(), out,
                         identity_positions(2 * d))
            counts = slots.meta["log_count"][slots.rows] if slots.fmt.attention_uses_counts else None
        else:
            kh, vh, counts = read(g.fmt, g.dst, g.slot)  # [N, C, H, D], log-counts [N, C, H]
            c = kh.shape[1]
            flat = g.target[:, :c].reshape(-1)
            buf[flat, :, 0] = kh.reshape(-1, h, d)
            buf[flat, :, 1] = vh.reshape(-1, h, d)
        if c < g.target.shape[1]:  # this layer's format stores fewer entries than another layer's
            log_w[g.target[:, c:].reshape(-1)] = float("-inf")
        if counts is not None:
            log_w[g.target[:, :c].reshape(-1)] = counts.reshape(-1, h).float()
    return log_w


def attend_compact(q: torch.Tensor, buf: torch.Tensor, log_w: torch.Tensor, plan: CompactPlan,
                   scale: float) -> torch.Tensor:
    """Count-weighted attention of each decode row's query q [R, Hq, D] over its entries:
    [R, Hq, D] float32. Query head i reads KV head i // (Hq / H), as vLLM's kernels do."""
    r, w = plan.rows, plan.width
    h, d = buf.shape[1], buf.shape[3]
    x = buf.view(r, w, h, 2, d)
    k = x[:, :, :, 0].permute(0, 2, 3, 1).float()  # [R, H, D, L]
    v = x[:, :, :, 1].permute(0, 2, 1, 3).float()  # [R, H, L, D]
    qh = q.float().view(r, h, -1, d)  # [R, H, G, D]
    s = torch.matmul(qh, k).mul_(scale).add_(log_w.view(r, w, h).permute(0, 2, 1).unsqueeze(2))
    return torch.matmul(torch.softmax(s, -1), v).view(r, -1, d)
