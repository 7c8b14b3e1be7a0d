"""The attention function that lets transformers see Proxima's compressed blocks.

Why a custom attention function: after `sparse(R)` or `cluster(R)` a block holds fewer keys than
tokens, and a STAR-KV centroid stands for n tokens, so its logit needs `+ log n`. We keep the
key axis at its *logical* length (one slot per token position, so transformers' own causal and
padding masks stay valid): a reduced block puts its kept keys or centroids in its first slots,
with an additive bias of `log(count)` (0 for sparse) and `-inf` in the unused slots. This function
is transformers' SDPA path plus that per-key bias (folded into the additive mask), and it
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


def with_key_bias(
    attention_mask: torch.Tensor | None, bias: torch.Tensor, query: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """transformers' mask (None, bool or additive float, broadcastable to `[B, Hq, Q, K]`) plus
    Proxima's per-key bias `[B, Hkv, K]`, as one additive float mask `[B, Hq, Q, K]`.

    Why the mask and not sdpa's `position_bias`: transformers 5.2 accepts and silently drops
    `position_bias` (it lands in `**kwargs`), so merged and evicted tokens were attended as if
    whole. Every version passes `attention_mask` to torch's SDPA."""
    q_len = query.shape[2]
    n_rep = query.shape[1] // bias.shape[1]
    # [B, Hkv, K] -> [B, Hq, 1, K]; query head h reads KV head h // n_rep (transformers' repeat_kv).
    pb = bias.repeat_interleave(n_rep, dim=1)[:, :, None, :].to(query.dtype)
    if attention_mask is None:
        if q_len == 1:
            return pb
        # sdpa's own causal mask is top-left aligned; with a past it must be bottom-right.
        pos = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
        attention_mask = (pos >= torch.arange(kv_len, device=query.device)[None, :]).view(1, 1, q_len, kv_len)
    if attention_mask.dtype == torch.bool:
        base = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        base = base.masked_fill(~attention_mask, float("-inf"))
    else:
        base = attention_mask.to(query.dtype)
    return base[..., :kv_len] + pb


def proxima_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with Proxima's per-key bias folded into the mask. Shapes:
    query `[B, Hq, Q, D]`, key/value `[B, Hkv, K, D]`, bias from the cache `[B, Hkv, K]`."""
    from transformers.integrations import sdpa_attention

    cache = active()
    if cache is not None:
        layer_idx = int(getattr(module, "layer_idx", -1))
        cache._observe_queries(layer_idx, query)
        bias = cache._take_attention_bias(layer_idx, key.shape[-2])
        if bias is not None:
            attention_mask = with_key_bias(attention_mask, bias, query, key.shape[-2])
            kwargs["is_causal"] = False  # the mask carries causality now
    return sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


SUPPORTED_TRANSFORMERS = ((5, 2), (6, 0))
"""[lowest, first unsupported) transformers versions; pyproject's `quality` extra declares the same.
Both ends are exercised: 5.19 in CI, 5.2.0 by hand (see docs/quality.md)."""


def check_transformers_version(version: str) -> None:
    """Raise a clear error for a transformers version outside `SUPPORTED_TRANSFORMERS`."""
    lo, hi = SUPPORTED_TRANSFORMERS
    try:
        parts = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        raise RuntimeError(f"cannot read the transformers version {version!r}") from None
    if not (lo <= parts < hi):
        raise RuntimeError(
            f"transformers {version} is not supported by proxima.integration.hf: need >= "
            f"{lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]} (pyproject.toml, extra 'quality')"
        )


def check_bias_reaches_softmax() -> None:
    """Run Proxima's attention once on a tiny input whose bias hides one key and doubles another,
    against the same attention written out; raise if the installed transformers drops the bias.
    A wrong answer here would otherwise be silent: merged and evicted tokens attended as whole."""

    class _Probe(torch.nn.Module):
        layer_idx = 0
        num_key_value_groups = 2
        is_causal = True

    class _Source:
        def __init__(self, bias: torch.Tensor) -> None:
            self.bias: torch.Tensor | None = bias

        def _take_attention_bias(self, layer_idx: int, kv_len: int) -> torch.Tensor | None:
            b, self.bias = self.bias, None
            return b

        def _observe_queries(self, layer_idx: int, query: torch.Tensor) -> None:
            return None

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 2, 8, generator=g)
    k, v = torch.randn(1, 1, 5, 8, generator=g), torch.randn(1, 1, 5, 8, generator=g)
    bias = torch.tensor([[[0.0, float("-inf"), 0.0, 0.6931, 0.0]]])
    prev = active()
    set_active(_Source(bias))  # type: ignore[arg-type]
    try:
        got, _ = proxima_sdpa_attention(_Probe(), q, k, v, None, scaling=8**-0.5)
    finally:
        set_active(prev)
    logits = torch.einsum("bhqd,bkd->bhqk", q, k[:, 0]) * 8**-0.5 + bias[:, :, None, :]
    causal = torch.arange(2)[:, None] + 3 >= torch.arange(5)[None, :]
    want = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1) @ v[:, 0][:, None]
    if not torch.allclose(got.transpose(1, 2), want, atol=1e-5):
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__}: Proxima's attention does not apply the per-key bias "
            "(cluster log-counts, evicted slots); refusing to compute attention without it"
        )


def register() -> str:
    """Register the attention function and its mask builder with transformers (idempotent)."""
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    check_transformers_version(transformers.__version__)
    check_bias_reaches_softmax()
    AttentionInterface.register(ATTN_NAME, proxima_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME


def enable(model: Any) -> Any:
    """Switch `model` to Proxima's attention (needed for sparse and cluster formats); returns it."""
    register()
    model.set_attn_implementation(ATTN_NAME)
    return model
