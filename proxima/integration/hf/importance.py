"""The transformers cache's importance: the observation window's queries, token and block
importance (as the vLLM worker scores them) and, for the H2O baseline, accumulated attention.

`CacheImportance` is a part of `ProximaCache` (`cache.py`), split out so each file has one job;
it reads the cache's layers and policy and keeps `_obs` (window queries per layer), `_acc`
(accumulated column sums per layer) and `block_importance` (the EMA per logical block).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from proxima.integration.hf import attention
from proxima.integration.hf.layer import NEG_INF, ProximaLayer
from proxima.observation import fold_heads, observed_layer

if TYPE_CHECKING:
    from proxima.policy.schema import Policy

ACCUMULATE_CHUNK = 256
"""Queries per step of the accumulated-attention pass: its float32 probabilities are
`[B, Hq, 256, T]` at a time (SmolLM2, 9 query heads, a 4k prompt: 38 MB) where the whole prompt
at once would be `[B, Hq, T, T]` (600 MB). Cost: one such layer at 4k tokens took 0.8 s on one
CPU thread of this project's machine (SmolLM2's 30 layers: about 25 s per 4k prefill)."""


class CacheImportance:
    """Importance scoring for `ProximaCache` (see the module docstring)."""

    if TYPE_CHECKING:
        policy: Policy
        window: int
        block_size: int
        layers: list
        accumulate_attention: bool
        block_importance: torch.Tensor | None
        _obs: dict[int, torch.Tensor]
        _acc: dict[int, tuple[torch.Tensor, int]]

        @property
        def proxima_layers(self) -> list[ProximaLayer]: ...

    def _observe_queries(self, layer_idx: int, query: torch.Tensor) -> None:
        prev = self._obs.get(layer_idx)
        q = query.detach()
        if prev is not None and prev.shape[:2] == q.shape[:2]:
            q = torch.cat([prev, q], dim=2)
        self._obs[layer_idx] = q[:, :, -self.window :].clone()
        if self.accumulate_attention and 0 <= layer_idx < len(self.layers):
            self._accumulate(layer_idx, query.detach())

    def _accumulate(self, layer_idx: int, query: torch.Tensor) -> None:
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
        layer = self.proxima_layers[layer_idx]
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
        prev = self._acc.get(layer_idx)
        seen = nq
        if prev is not None and prev[0].shape[:2] == cols.shape[:2] and prev[0].shape[-1] <= t:
            cols[..., : prev[0].shape[-1]] += prev[0]  # tokens cached since then start at 0
            seen += prev[1]
        self._acc[layer_idx] = (cols, seen)

    def window_queries(self, layer_idx: int) -> torch.Tensor | None:
        """The observation window's queries of a layer, `[B, Hq, W, D]` after RoPE (what the
        compression-time probe attends with); None before any was recorded."""
        return self._obs.get(layer_idx)

    def accumulated_attention(self, layer_idx: int) -> torch.Tensor:
        """Attention mass each cached token received from every query so far (every prefill
        query, then every later one), `[B, H_kv, T_full]` over the full blocks: per KV head the
        sum over its query heads and over queries of the causal softmax (`_accumulate`). Needs
        `ProximaCache(accumulate_attention=True)` from the first forward on, and the model on
        Proxima's attention (`proxima.integration.hf.enable`), which hands the queries over."""
        if not self.accumulate_attention:
            raise RuntimeError(
                "accumulated attention was not recorded: build the cache with ProximaCache(accumulate_attention=True) "
                "before the prefill (the quality harness does when a method has needs_accumulated_attention=True)"
            )
        layer = self.proxima_layers[layer_idx]
        acc = self._acc.get(layer_idx)
        if acc is None or acc[1] != layer.n_tokens:
            got = 0 if acc is None else acc[1]
            raise RuntimeError(
                f"layer {layer_idx}: accumulated attention covers {got} of its {layer.n_tokens} queries: set "
                "accumulate_attention=True before the first forward, and run the model on Proxima's attention "
                f"(proxima.integration.hf.enable(model), attn_implementation={attention.ATTN_NAME!r})"
            )
        return acc[0][..., : layer.n_blocks * layer.block_size]

    def token_importance(self, layer_idx: int) -> torch.Tensor | None:
        """Attention mass each cached token gets from the observation window, `[B, H_kv, T_full]`
        over the full blocks (mean over window queries, each KV head's query heads folded by
        `observation.fold_heads`, as the vLLM worker does)."""
        q = self._obs.get(layer_idx)
        layer = self.proxima_layers[layer_idx]
        if q is None or layer.n_blocks == 0:
            return None
        wk, _, wb = layer.materialize()
        assert layer.tail_k is not None
        keys = torch.cat([wk, layer.tail_k], dim=-2).float()
        b, hq, w, d = q.shape
        hkv = keys.shape[1]
        g = hq // hkv
        qf = q.float().reshape(b, hkv, g, w, d)
        logits = torch.einsum("bhgwd,bhtd->bhgwt", qf, keys) * d**-0.5
        t = keys.shape[-2]
        if wb is not None:
            full_bias = torch.cat([wb, wb.new_zeros(b, hkv, t - wb.shape[-1])], dim=-1)
            logits = logits + full_bias[:, :, None, None, :]
        qpos = torch.arange(t - w, t, device=keys.device)
        causal = torch.arange(t, device=keys.device)[None, :] <= qpos[:, None]  # [W, T]
        logits = logits.masked_fill(~causal, NEG_INF)
        p = torch.softmax(logits, dim=-1)
        imp = fold_heads(p.mean(3), self.policy.importance.aggregate, 2)  # [B, Hkv, T]
        return imp[..., : layer.n_blocks * layer.block_size]

    def refresh_importance(self) -> torch.Tensor:
        """Per logical block: attention mass in the observed layer (`proxima.observation`, the one
        the vLLM worker observes), aggregated over batch and heads (policy's
        `importance.aggregate`), folded into an EMA. Returns `[n_blocks]` (float64)."""
        n = self.proxima_layers[0].n_blocks
        imp = self.token_importance(observed_layer(len(self.layers)))
        if imp is not None:
            blk = imp.view(*imp.shape[:2], n, self.block_size).sum(-1)  # [B, H, n]
            cur = fold_heads(blk, self.policy.importance.aggregate, (0, 1))
        else:
            cur = torch.ones(n)
        cur = cur.double().cpu()
        old = self.block_importance
        if old is not None and 0 < len(old) <= n:
            decay = self.policy.importance.ema_decay
            merged = cur.clone()
            merged[: len(old)] = decay * old + (1 - decay) * cur[: len(old)]
            cur = merged
        self.block_importance = cur
        return cur
