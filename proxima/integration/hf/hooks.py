"""What a caller may attach to a `ProximaCache` to watch it work, without the cache knowing why.

The quality harness attaches its measurements here (`proxima.quality.h2o.AttentionSums`, the H2O
baseline's scores; `proxima.quality.probe_records.ProbeLog`, the damage model's samples): the
cache calls them at the points below and keeps nothing of theirs, so the quality methods live
with the quality suite and imports flow one way (`proxima.quality` -> this package).

Both are forked with the cache (`ProximaCache.fork`): a fork continues from what its hook had
seen, and the two never share state that either changes afterwards.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from proxima.formats import Format


class QueryHook(Protocol):
    """Called with every layer's queries of every forward, after the layer's keys were cached
    (`[B, Hq, Q, D]` after RoPE: the last Q of the layer's cached tokens). `cache` is the
    `ProximaCache` (typed `Any` here: this module is imported by the cache's own modules)."""

    def __call__(self, cache: Any, layer_idx: int, query: torch.Tensor) -> None: ...

    def fork(self) -> QueryHook: ...


class ProbeHook(Protocol):
    """Called for every layer of every compression, with the measured probe error of each block
    (with a probe hook attached every layer is measured, not only the observed one).

    `k`: the blocks' keys as compressed, rows ordered (block, batch element) `[N, C, H, D]`;
    `token_importance`: the observation window's mass per row token `[N, C, H]` (None before
    any query was seen); `errors`: `[len(blocks)]`, averaged over the batch of `batch` rows."""

    def __call__(self, layer_idx: int, blocks: list[int], fmt: Format, k: torch.Tensor,
                 token_importance: torch.Tensor | None, errors: torch.Tensor, batch: int) -> None: ...

    def fork(self) -> ProbeHook: ...


__all__ = ["ProbeHook", "QueryHook"]
