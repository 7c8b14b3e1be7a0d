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


def observed_layer(num_layers: int) -> int:
    """Index of the layer whose attention both integrations observe (the middle one)."""
    if num_layers <= 0:
        raise ValueError(f"a model has at least one attention layer, got {num_layers}")
    return num_layers // 2
