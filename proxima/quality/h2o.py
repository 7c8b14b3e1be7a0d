"""The H2O baseline's scores: per layer, the attention every cached token has received from every
query so far (heavy hitters are the tokens with the most).

`AttentionSums` is a query hook (`proxima.integration.hf.hooks.QueryHook`): attached to a
`ProximaCache` before the prefill, it sees each layer's queries after the layer's keys were cached
and adds their attention probabilities to the layer's column sums. It is a second attention pass
over every forward's queries in every layer, so the harness attaches it only when a method reads
it (`Method.needs_accumulated_attention`); `attention_sums(cache)` finds it again.
"""

from __future__ import annotations

import torch

from proxima.integration.hf import attention
from proxima.integration.hf.cache import ProximaCache
from proxima.integration.hf.layer import NEG_INF

ACCUMULATE_CHUNK = 256
"""Queries per step of the accumulated-attention pass: its float32 probabilities are
`[B, Hq, 256, T]` at a time (SmolLM2, 9 query heads, a 4k prompt: 38 MB) where the whole prompt
at once would be `[B, Hq, T, T]` (600 MB). Cost: one such layer at 4k tokens took 0.8 s on one
CPU thread of this project's machine (SmolLM2's 30 layers: about 25 s per 4k prefill)."""


class AttentionSums:
    """Accumulated attention per layer of one cache (see the module docstring)."""

    def __init__(self) -> None:
        self.sums: dict[int, tuple[torch.Tensor, int]] = {}
        """Per layer: attention column sums `[B, H_kv, T]` (T: the tokens cached at the last
        forward) and how many queries they sum. Replaced on every forward, never written in place
        (forks share them)."""

    def fork(self) -> AttentionSums:
        out = AttentionSums()
        out.sums = dict(self.sums)
        return out

    def __call__(self, cache: ProximaCache, layer_idx: int, query: torch.Tensor) -> None:
        """Add this forward's attention probabilities, summed over its queries, to the layer's
        column sums. Called after the layer's keys were cached, so its queries are the last Q of
        the T cached tokens (causal, bottom-right aligned), as in `token_importance`; the keys
        are what attention reads (working copy and tail, with the per-key bias).

        A KV head's score is the sum over its query heads, not `fold_heads` with the policy's
        aggregate: every query head sharing the KV head reads the same cached token, so the sum
        is the total attention that evicting it takes away (H2O's score, a sum over queries,
        extended over the group); it is linear, so chunks and forwards add up exactly with no
        per-query-head state; and it does not depend on which policy the cache holds at prefill
        (the baselines' caches run with policy off, and `proxima:` methods replace the policy
        afterwards). Mean over the group would rank identically (a constant factor)."""
        layer = cache.proxima_layers[layer_idx]
        assert layer.tail_k is not None
        wk, _, wb = layer.materialize()
        keys = torch.cat([wk, layer.tail_k], dim=-2).float()  # [B, Hkv, T, D]
        b, hq, nq, d = query.shape
        hkv, t = keys.shape[1], keys.shape[2]
        g = hq // hkv
        qf = query.float().reshape(b, hkv, g, nq, d)  # query head h reads KV head h // g
        bias = None if wb is None else torch.cat([wb, wb.new_zeros(b, hkv, t - wb.shape[-1])], dim=-1)
        cols = keys.new_zeros(b, hkv, t)
        first = t - nq  # position of this forward's first query
        for s in range(0, nq, ACCUMULATE_CHUNK):
            qc = qf[:, :, :, s : s + ACCUMULATE_CHUNK]
            hi = first + s + qc.shape[3]  # the chunk's last query sees keys [0, hi)
            logits = torch.einsum("bhgqd,bhtd->bhgqt", qc, keys[:, :, :hi]) * d**-0.5
            if bias is not None:
                logits = logits + bias[:, :, None, None, :hi]
            qpos = torch.arange(first + s, hi, device=keys.device)
            future = torch.arange(hi, device=keys.device)[None, :] > qpos[:, None]  # [Qc, hi]
            p = torch.softmax(logits.masked_fill(future, NEG_INF), dim=-1)
            cols[..., :hi] += p.sum(dim=(2, 3))
        prev = self.sums.get(layer_idx)
        seen = nq
        if prev is not None and prev[0].shape[:2] == cols.shape[:2] and prev[0].shape[-1] <= t:
            cols[..., : prev[0].shape[-1]] += prev[0]  # tokens cached since then start at 0
            seen += prev[1]
        self.sums[layer_idx] = (cols, seen)

    def scores(self, cache: ProximaCache, layer_idx: int) -> torch.Tensor:
        """Attention mass each cached token received from every query so far (every prefill
        query, then every later one), `[B, H_kv, T_full]` over the full blocks: per KV head the
        sum over its query heads and over queries of the causal softmax (`__call__`). Needs the
        hook attached from the first forward on, and the model on Proxima's attention
        (`proxima.integration.hf.enable`), which hands the queries over."""
        layer = cache.proxima_layers[layer_idx]
        acc = self.sums.get(layer_idx)
        if acc is None or acc[1] != layer.n_tokens:
            got = 0 if acc is None else acc[1]
            raise RuntimeError(
                f"layer {layer_idx}: accumulated attention covers {got} of its {layer.n_tokens} queries: attach "
                "AttentionSums before the first forward, and run the model on Proxima's attention "
                f"(proxima.integration.hf.enable(model), attn_implementation={attention.ATTN_NAME!r})"
            )
        return acc[0][..., : layer.n_blocks * layer.block_size]


def attention_sums(cache: ProximaCache) -> AttentionSums:
    """The `AttentionSums` hook attached to `cache` (raises if there is none)."""
    for hook in cache.query_hooks:
        if isinstance(hook, AttentionSums):
            return hook
    raise RuntimeError(
        "accumulated attention was not recorded: attach proxima.quality.h2o.AttentionSums to the cache "
        "(ProximaCache(query_hooks=(AttentionSums(),))) before the prefill (the quality harness does when a "
        "method has needs_accumulated_attention=True)"
    )


__all__ = ["ACCUMULATE_CHUNK", "AttentionSums", "attention_sums"]
