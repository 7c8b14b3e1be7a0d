"""A small paged KV world for the paged-attention tests: vLLM's cache with some blocks compressed.

The cache is one layer's tensor as vLLM's Triton backend holds it (logical [NB, H, B, 2D],
physical LBHNC, read through the FLASH_ATTN views). Compressed blocks are written into slots of
spare physical blocks through the vLLM worker's own slot pool and write (`LayerStack.pool`,
`LayerStack.write`), and read through its `LayerSlots.blocks` view, so the tests certify the bytes
the product writes; their source blocks are overwritten with garbage (the null block and a
reused block in vLLM), so a test passes only if nothing reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proxima.compression import (
    CompressedBlocks,
    KVLayout,
    LayerStack,
    compress_blocks,
    decompress_blocks,
    hot_store,
    slot_spec,
)
from proxima.compression.paged import PagedRow
from proxima.formats import Format
from tests.compression.synthetic import realistic_kv


@dataclass
class World:
    kv: torch.Tensor  # [NB, H, B, 2D] bf16
    rows: list[PagedRow]
    hot: CompressedBlocks
    pools: dict[Format, CompressedBlocks]
    dense: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """Per request: keys, values [T, H, D] and logit bias [T, H] (log count of cluster centroids,
    else 0) as attention should see them (decompressed where compressed; a token-reducing
    block contributes its kept tokens), and the logical block of each of the T tokens."""
    token_block: list[torch.Tensor]


def build_world(
    seq_lens: list[int],
    query_lens: list[int],
    compressed: list[dict[int, str]],
    *,
    h: int = 2,
    d: int = 32,
    b: int = 16,
    seed: int = 0,
    device: str = "cpu",
) -> World:
    """Requests with `seq_lens` tokens; `compressed[r]` maps logical block -> format name."""
    nblk = [-(-n // b) for n in seq_lens]
    fmts = sorted({Format.parse(f) for c in compressed for f in c.values()}, key=str)
    # physical blocks: 0 = vLLM's null block, then every request's blocks, then one destination
    # block per pack_ratio blocks of a format, per request (packing per request, as the manager does)
    def blocks_for(c: dict[int, str]) -> int:
        per_fmt = [list(c.values()).count(f) for f in set(c.values())]
        return sum(-(-n // Format.parse(f).pack_ratio) for n, f in zip(per_fmt, set(c.values()), strict=True))

    dst_needed = sum(blocks_for(c) for c in compressed)
    total = 1 + sum(nblk) + dst_needed
    k, v = realistic_kv(total, b, h, d, seed=seed)
    kv = torch.cat([k, v], -1).transpose(1, 2).contiguous().to(device)  # [NB, H, B, 2D]
    stack = LayerStack({"layer": kv})
    slots = {f: stack.pool(f, slot_spec(f, block_size=b, head_dim=d, num_kv_heads=h)) for f in fmts}
    dtypes: dict[Format, tuple[torch.dtype, torch.dtype]] = {}
    next_block = 1
    next_dst = 1 + sum(nblk)
    rows, dense, freed, token_blocks = [], [], [], []
    for n, ql, comp in zip(seq_lens, query_lens, compressed, strict=True):
        nb = -(-n // b)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        placements: dict[int, tuple[Format, int, int]] = {}
        dst_of: dict[Format, tuple[int, int]] = {}
        ks, vs, bias, owner = [], [], [], []
        for j in range(nb):
            blk = kv[table[j]].transpose(0, 1)  # [B, H, 2D]
            kj, vj = blk[..., :d], blk[..., d:]
            if j in comp:
                f = Format.parse(comp[j])
                if f not in dst_of or dst_of[f][1] == f.pack_ratio:  # open a fresh destination block
                    dst_of[f] = (next_dst, 0)
                    next_dst += 1
                dst, used = dst_of[f]
                dst_of[f] = (dst, used + 1)
                cb = compress_blocks(f, kj.unsqueeze(0).cpu(), vj.unsqueeze(0).cpu(), backend="torch")
                placements[j] = (f, dst, used)
                kh, vh, lc = decompress_blocks(cb, backend="torch")
                ks.append(kh[0])
                vs.append(vh[0])
                bias.append(lc[0])
                ids = torch.tensor([dst * f.pack_ratio + used], device=device)
                stack.write(slots[f], (0,), ids, _to(cb, device))
                dtypes[f] = (cb.k_data.dtype, cb.v_data.dtype)
                freed.append(table[j])
                table[j] = 0  # the source is freed: vLLM's table holds the null block
            else:
                t = min(b, n - j * b)
                ks.append(kj[:t].cpu())
                vs.append(vj[:t].cpu())
                bias.append(torch.zeros(t, h))
            owner.append(torch.full((ks[-1].shape[0],), j))
        rows.append(PagedRow(table, n, ql, placements))
        dense.append((torch.cat(ks), torch.cat(vs), torch.cat(bias)))
        token_blocks.append(torch.cat(owner))
    # garbage where nothing may read: the null block and every freed source
    kv[[0, *freed]] = 1e4
    hot = hot_store(kv, KVLayout.FLASH_ATTN, num_kv_heads=h, head_dim=d)
    pools = {f: slots[f].at(0).blocks(*dtypes[f], kv.dtype) for f in fmts}
    return World(kv, rows, hot, pools, dense, token_blocks)


def _to(cb: CompressedBlocks, device: str) -> CompressedBlocks:
    from dataclasses import replace

    def mv(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return replace(
        cb, k_data=mv(cb.k_data), v_data=mv(cb.v_data), k_scale=mv(cb.k_scale), k_zero=mv(cb.k_zero),
        v_scale=mv(cb.v_scale), v_zero=mv(cb.v_zero), log_count=mv(cb.log_count),
    )  # fmt: skip


def reference(world: World, q: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense float32 causal attention over the decompressed contexts.

    q [Sq, Hq, D] in plan order. Returns out [Sq, Hq, D], lse [Sq, Hq] and the block mass
    [R, NB, Hq] (mean over the request's query tokens), as `PagedOutput` defines them. Compressed
    blocks are never the causal tail, so every query sees all of their tokens.
    """
    outs, lses, masses = [], [], []
    nbmax = max(-(-row.seq_len // block_size) for row in world.rows)
    i = 0
    for row, (k, v, bias), owner in zip(world.rows, world.dense, world.token_block, strict=True):
        h = k.shape[1]
        qr = q[i : i + row.query_len].float().cpu()
        i += row.query_len
        hq = qr.shape[1]
        g = hq // h
        kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
        logits = torch.einsum("qhd,thd->qht", qr, kf) / qr.shape[-1] ** 0.5
        logits = logits + bias.repeat_interleave(g, 1).T.unsqueeze(0)
        # token positions: a hot token's own; a compressed block's tokens all lie before the query
        pos = torch.where(
            torch.tensor([j in row.compressed for j in owner.tolist()]),
            owner * block_size,
            owner * block_size + torch.arange(len(owner)) - torch.searchsorted(owner, owner),
        )
        qpos = torch.arange(row.seq_len - row.query_len, row.seq_len).view(-1, 1, 1)
        logits = logits.masked_fill(pos.view(1, 1, -1) > qpos, float("-inf"))
        lses.append(torch.logsumexp(logits, -1))
        p = torch.softmax(logits, -1)
        outs.append(torch.einsum("qht,thd->qhd", p, vf))
        mass = torch.zeros(nbmax, hq)
        mass.index_add_(0, owner, p.mean(0).T)  # [T, Hq] summed per block
        masses.append(mass)
    return torch.cat(outs), torch.cat(lses), torch.stack(masses)
