"""Where attention importance is observed: in one layer, the middle one, in both integrations.

vLLM's kernels return no attention probabilities, so the vLLM worker scores the observation
window's queries against the keys itself, beside the kernel, in one layer per step (the cost of a
second attention pass in every layer would be paid at every step). The quality harness's cache
(`integration/hf/cache.py`) could observe every layer, but then it would rank blocks (and the
tokens inside them) differently from what vLLM serves: on issue 18's full suite, with the
harness's max over all 30 layers, aggressive@4x kept 9% of the passkeys where vLLM, with the middle
layer, kept 24-60% (docs/quality.md). So both read the same layer.
"""

from __future__ import annotations

import torch


def observed_layer(num_layers: int) -> int:
    """Index of the layer whose attention both integrations observe (the middle one)."""
    if num_layers <= 0:
        raise ValueError(f"a model has at least one attention layer, got {num_layers}")
    return num_layers // 2


def fold_heads(mass: torch.Tensor, aggregate: str, dim: int | tuple[int, ...]) -> torch.Tensor:
    """Combine attention mass over heads (`importance.aggregate`: "max" or "mean").

    The one definition both integrations use, at both places heads are combined: a KV head's
    query heads (a token's importance per KV head) and a block's KV heads (the block's one number
    for the scheduler). They once differed (the harness summed query heads and followed
    `aggregate` over KV heads, vLLM took the max of both), and the harness then ranked tokens
    differently from what vLLM serves (docs/quality.md, "Looking for the perplexity gap").
    One difference stays: the worker's EMA over decode steps runs per token and head before the
    block fold, the harness's per block after it; they agree on a single observation (the
    harness's case: one observation window before compression).
    """
    if aggregate == "max":
        return mass.amax(dim)
    if aggregate == "mean":
        return mass.mean(dim)
    raise ValueError(f"importance.aggregate is 'max' or 'mean', got {aggregate!r}")
