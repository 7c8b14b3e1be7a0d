"""Caches side by side as the rows of one batch: the quality harness decodes every method's
compressed copy of the same prefill in one forward pass (`harness.py`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from proxima.formats import HOT
from proxima.integration.hf import ProximaCache, ProximaLayer


def stacked(caches: Sequence[ProximaCache]) -> ProximaCache:
    """The caches side by side as the rows of one batch (row i = `caches[i]`, each of batch 1),
    to decode their continuations in one forward pass instead of one per cache (the quality
    harness: every method's compressed copy of the same prefill reads the same question).

    Each layer of the result holds, as hot blocks, what attention reads from each cache: its
    working copy (decompressed blocks at their logical length) and per-key bias (log-counts,
    evicted and unused slots), its tail as the tail. Tokens appended later go to the tail and
    to new hot blocks exactly as they would in every cache alone, so row i's logits are those
    of `caches[i]` (up to the batched kernels' rounding). The compressed store is not carried:
    the result has policy off and is for reading and appending, not for compressing or for
    byte accounting (take ratios from the caches themselves)."""
    if not caches:
        raise ValueError("stacked() needs at least one cache")
    first = caches[0]
    n_layers, n_tok = len(first.layers), first.get_seq_length()
    for c in caches:
        if len(c.layers) != n_layers or c.get_seq_length() != n_tok or c.block_size != first.block_size:
            raise ValueError(
                f"stacked caches must match: {len(c.layers)} layers / {c.get_seq_length()} tokens / block "
                f"{c.block_size}, first has {n_layers} / {n_tok} / {first.block_size}"
            )
        if c.proxima_layers and c.proxima_layers[0].tail_k is not None and c.proxima_layers[0].tail_k.shape[0] != 1:
            raise ValueError("stacked() takes caches of batch 1")
    out = ProximaCache(block_size=first.block_size, kv_dtype=first.kv_dtype, observation_window=first.window)
    out._stacked = True
    for li in range(n_layers):
        src = [c.proxima_layers[li] for c in caches]
        layer = ProximaLayer(first.block_size, keep_working_copy=True)
        views = [s.materialize() for s in src]
        wk = torch.cat([v[0] for v in views])
        wv = torch.cat([v[1] for v in views])
        if any(v[2] is not None for v in views):
            wb: torch.Tensor | None = torch.cat(
                [v[2] if v[2] is not None else v[0].new_zeros(v[0].shape[:3], dtype=torch.float32) for v in views]
            )
        else:
            wb = None
        tails_k = [s.tail_k for s in src]
        tails_v = [s.tail_v for s in src]
        assert all(t is not None for t in tails_k) and all(t is not None for t in tails_v)
        layer.lazy_initialization(torch.cat(tails_k), torch.cat(tails_v))  # type: ignore[arg-type]
        layer.tail_k, layer.tail_v = torch.cat(tails_k), torch.cat(tails_v)  # type: ignore[arg-type]
        bs, n = layer.block_size, src[0].n_blocks
        layer.hot_k = [wk[..., i * bs : (i + 1) * bs, :] for i in range(n)]
        layer.hot_v = [wv[..., i * bs : (i + 1) * bs, :] for i in range(n)]
        layer.slots = [None] * n
        layer.formats = [HOT] * n
        layer.keep = [None] * n
        layer.n_tokens = src[0].n_tokens
        layer._work = (wk, wv, wb)
        out.layers.append(layer)
    return out
