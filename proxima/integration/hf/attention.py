"""The attention function that lets transformers see Proxima's compressed blocks.

Why a custom attention function: after `sparse(R)` or `cluster(R)` a block holds fewer keys than
tokens, and a STAR-KV centroid stands for n tokens, so its logit needs `+ log n`. We keep the
key axis at its *logical* length (one slot per token position, so transformers' own causal and
padding masks stay valid): a reduced block puts its kept keys or centroids in its first slots,
with an additive bias of `log(count)` (0 for sparse) and `-inf` in the unused slots. This function
is transformers' SDPA path plus that per-key bias (sdpa's `position_bias` argument), and it
records the last queries of each layer (the observation window that scores tokens at compression
time). Adding log n to a centroid's logit is exactly the same as repeating it n times.

The bias travels from `ProximaCache.update` to this function through a thread-local handoff:
transformers calls the cache's `update` and then, in the same layer and thread, the attention
function, and passes the cache to neither. The handoff is checked (same layer, same key length),
and a cache whose bias is never picked up raises (the model is not using this function).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

ATTN_NAME = "proxima"


class _BiasSource(Protocol):
    def _take_attention_bias(self, layer_idx: int, kv_len: int) -> torch.Tensor | None: ...
    def _observe_queries(self, layer_idx: int, query: torch.Tensor) -> None: ...


_local = threading.local()


def set_active(cache: _BiasSource | None) -> None:
    """Called by the cache's `update`: the next attention call in this thread reads from it."""
    _local.cache = cache


def active() -> _BiasSource | None:
    return getattr(_local, "cache", None)


def proxima_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with Proxima's per-key bias. Shapes: query `[B, Hq, Q, D]`,
    key/value `[B, Hkv, K, D]`, bias from the cache `[B, Hkv, K]`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache = active()
    if cache is not None:
        layer_idx = int(getattr(module, "layer_idx", -1))
        cache._observe_queries(layer_idx, query)
        bias = cache._take_attention_bias(layer_idx, key.shape[-2])
        if bias is not None:
            n_rep = query.shape[1] // bias.shape[1]
            # [B, Hkv, K] -> [B, Hq, 1, K]; query head h reads KV head h // n_rep (transformers' repeat_kv).
            pb = bias.repeat_interleave(n_rep, dim=1)[:, :, None, :].to(query.dtype)
            if attention_mask is None and query.shape[2] > 1 and key.shape[2] != query.shape[2]:
                # sdpa's own causal mask is top-left aligned; with a past it must be bottom-right.
                q, k = query.shape[2], key.shape[2]
                attention_mask = (
                    torch.arange(q, device=key.device)[:, None] + (k - q) >= torch.arange(k, device=key.device)[None, :]
                ).view(1, 1, q, k)
            kwargs["position_bias"] = pb
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Register the attention function and its mask builder with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_NAME, proxima_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME


def enable(model: Any) -> Any:
    """Switch `model` to Proxima's attention (needed for sparse and cluster formats); returns it."""
    register()
    model.set_attn_implementation(ATTN_NAME)
    return model
