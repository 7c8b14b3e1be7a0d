"""The transformers cache's importance: the observation window's queries, token and block
importance (as the vLLM worker scores them).

`CacheImportance` is a part of `ProximaCache` (`cache.py`), split out so each file has one job;
it reads the cache's layers and policy and keeps `_obs` (window queries per layer) and
`block_importance` (the EMA per logical block). Every layer's queries also go to the cache's
`query_hooks` (`hooks.QueryHook`: the H2O baseline's sums are one, `proxima.quality.h2o`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from proxima.integration.hf.hooks import QueryHook
from proxima.integration.hf.layer import NEG_INF, ProximaLayer
from proxima.observation import fold_heads, observed_layer

if TYPE_CHECKING:
    from proxima.policy.schema import Policy

class CacheImportance:
    """Importance scoring for `ProximaCache` (see the module docstring)."""

    if TYPE_CHECKING:
        policy: Policy
        window: int
        block_size: int
        layers: list
        query_hooks: list[QueryHook]
        block_importance: torch.Tensor | None
        _obs: dict[int, torch.Tensor]

        @property
        def proxima_layers(self) -> list[ProximaLayer]: ...

    def _observe_queries(self, layer_idx: int, query: torch.Tensor) -> None:
        prev = self._obs.get(layer_idx)
        q = query.detach()
        if prev is not None and prev.shape[:2] == q.shape[:2]:
            q = torch.cat([prev, q], dim=2)
        self._obs[layer_idx] = q[:, :, -self.window :].clone()
        if 0 <= layer_idx < len(self.layers):
            for hook in self.query_hooks:
                hook(self, layer_idx, query.detach())

    def window_queries(self, layer_idx: int) -> torch.Tensor | None:
        """The observation window's queries of a layer, `[B, Hq, W, D]` after RoPE (what the
        compression-time probe attends with); None before any was recorded."""
        return self._obs.get(layer_idx)

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
