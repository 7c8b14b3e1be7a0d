"""The transient bf16 KV that vLLM's CPU kernel reads for requests with compressed blocks.

Planned once per step (`plan_scratch`), filled once per layer (`fill_scratch`) into one buffer
that every layer reuses, so it costs one layer's worth of those requests' KV.

A request with compressed blocks is always a *decode* row: compression waits for the end of the
prefill, and a preempted request comes back uncompressed. Its one query sees every token and
RoPE is already applied to cached keys, so the order of its tokens in the scratch does not
matter. That freedom gives a simple layout per row:

1. block-aligned: hot blocks other than the last (one block copy each), quantized blocks
   (decompressed in one batched call per format) and cluster blocks, each centroid repeated as
   many times as tokens it merged. Repetition reproduces the count-weighted softmax exactly
   (n copies of a key add n * exp(q.k)), so vLLM's unmodified kernel computes STAR-KV attention;
2. token-level, packed after them: the kept tokens of sparse blocks (fewer than a block each),
   then the tokens of the row's last block (partial; it receives the new token).

Only part 2 is copied token by token: at most one block per row plus the sparse blocks' tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from proxima.formats import Format

Reader = Callable[[Format, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""(format, destination blocks, slots) -> (k_hat, v_hat [N, C, H, D], log_count [N, C, H])."""


@dataclass(frozen=True)
class ScratchRow:
    """One request's blocks as the worker's block table has them, with its compressed ones."""

    blocks: list[int]
    """Physical block of each logical block (compressed ones: their freed source, never read)."""
    seq_len: int
    remap: dict[int, tuple[Format, int, int]]
    """Logical block index -> (format, destination block, slot)."""


@dataclass
class ScratchGroup:
    """The compressed blocks of one format, all rows together."""

    fmt: Format
    dst: torch.Tensor  # long [N]
    slot: torch.Tensor  # long [N]
    target: torch.Tensor
    """long [N]: scratch block of each (block-aligned formats) or [N, C]: flat scratch position of
    each kept token (sparse)."""


@dataclass
class ScratchPlan:
    num_blocks: int
    block_table: torch.Tensor  # int32 [R, W]: scratch blocks of each row
    seq_lens: torch.Tensor  # int32 [R]: tokens of each row in the scratch (<= its real length)
    hot_src: torch.Tensor  # long [Nh]: physical blocks copied whole
    hot_dst: torch.Tensor  # long [Nh]
    tok_src: torch.Tensor  # long [Nt]: flat cache positions (block * B + offset) copied token by token
    tok_dst: torch.Tensor  # long [Nt]: flat scratch positions
    groups: list[ScratchGroup] = field(default_factory=list)


def plan_scratch(rows: list[ScratchRow], block_size: int) -> ScratchPlan:
    b = block_size
    L = torch.long
    hot_src: list[int] = []
    hot_dst: list[int] = []
    tok_src: list[torch.Tensor] = []
    tok_dst: list[torch.Tensor] = []
    groups: dict[Format, tuple[list[int], list[int], list[int] | list[torch.Tensor]]] = {}
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    base = 0  # first scratch block of the current row
    for row in rows:
        nb = -(-row.seq_len // b)
        aligned = 0
        sparse: list[tuple[Format, int, int]] = []
        for j in range(nb - 1):
            hit = row.remap.get(j)
            if hit is None:
                hot_src.append(row.blocks[j])
                hot_dst.append(base + aligned)
            elif hit[0].reduction == "sparse":
                sparse.append(hit)
                continue
            else:
                g = groups.setdefault(hit[0], ([], [], []))
                g[0].append(hit[1])
                g[1].append(hit[2])
                g[2].append(base + aligned)  # type: ignore[arg-type]
            aligned += 1
        pos = (base + aligned) * b  # flat scratch position of the next token-level token
        for fmt, dst, slot in sparse:
            c = fmt.kept_tokens(b)
            g = groups.setdefault(fmt, ([], [], []))
            g[0].append(dst)
            g[1].append(slot)
            g[2].append(torch.arange(pos, pos + c))  # type: ignore[arg-type]
            pos += c
        if (nb - 1) in row.remap:  # the engine never compresses the last block (the hot tail)
            raise ValueError(f"the last block ({nb - 1}) of a row is compressed: it must stay hot")
        tail = row.seq_len - (nb - 1) * b
        tok_src.append(row.blocks[nb - 1] * b + torch.arange(tail))
        tok_dst.append(torch.arange(pos, pos + tail))
        pos += tail
        used = pos - base * b
        n_blocks = -(-used // b)
        tables.append(list(range(base, base + n_blocks)))
        seq_lens.append(used)
        base += n_blocks
    width = max((len(t) for t in tables), default=1)
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    out = ScratchPlan(
        num_blocks=base,
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        hot_src=torch.tensor(hot_src, dtype=L),
        hot_dst=torch.tensor(hot_dst, dtype=L),
        tok_src=torch.cat(tok_src) if tok_src else torch.zeros(0, dtype=L),
        tok_dst=torch.cat(tok_dst) if tok_dst else torch.zeros(0, dtype=L),
    )
    for fmt, (dsts, slots, target) in groups.items():
        tgt = torch.stack(target) if fmt.reduction == "sparse" else torch.tensor(target, dtype=L)  # type: ignore[arg-type]
        out.groups.append(ScratchGroup(fmt, torch.tensor(dsts, dtype=L), torch.tensor(slots, dtype=L), tgt))
    return out


def expand_centroids(k: torch.Tensor, v: torch.Tensor, log_count: torch.Tensor, tokens: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat each centroid by its member count: [N, C, H, D] -> [N, tokens, H, D].

    Counts of a (block, head) sum to the block's tokens, so position t takes the centroid whose
    cumulative count first exceeds t (empty centroids, log_count -inf, take no position).
    """
    counts = log_count.float().exp().round().long()  # exp(-inf) = 0
    cum = counts.cumsum(1)  # [N, C, H]
    t = torch.arange(tokens, device=k.device).view(1, tokens, 1, 1)
    idx = (cum.unsqueeze(1) <= t).sum(2).clamp_max(k.shape[1] - 1)  # [N, T, H]
    gidx = idx.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])
    return k.gather(1, gidx), v.gather(1, gidx)


def fill_scratch(plan: ScratchPlan, kv: torch.Tensor, read: Reader, scratch: torch.Tensor) -> None:
    """Fill `scratch` [num_blocks, H, 2B, D] from one layer's cache `kv` [N, H, B, 2D] (vLLM CPU)."""
    nb, h, b, d2 = kv.shape
    d = d2 // 2
    kv5 = kv.view(nb, h, 2, b, d)
    s5 = scratch.view(-1, h, 2, b, d)
    if len(plan.hot_src):
        s5.index_copy_(0, plan.hot_dst, kv5.index_select(0, plan.hot_src))
    if len(plan.tok_src):
        # Advanced indices on dims 0 and 3 (separated by slices) put the token axis first: [T, H, 2, D].
        s5[plan.tok_dst // b, :, :, plan.tok_dst % b] = kv5[plan.tok_src // b, :, :, plan.tok_src % b]
    for g in plan.groups:
        kh, vh, log_count = read(g.fmt, g.dst, g.slot)  # [N, C, H, D]
        if g.fmt.reduction == "sparse":
            flat = g.target.reshape(-1)
            s5[flat // b, :, 0, flat % b] = kh.reshape(-1, h, d)
            s5[flat // b, :, 1, flat % b] = vh.reshape(-1, h, d)
            continue
        if kh.shape[1] != b:  # centroids (this layer may store a cluster format in place of another)
            kh, vh = expand_centroids(kh, vh, log_count, b)
        s5[g.target, :, 0] = kh.transpose(1, 2)
        s5[g.target, :, 1] = vh.transpose(1, 2)
