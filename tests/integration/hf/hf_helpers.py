"""A tiny random Llama for the transformers tests (here and in tests/quality).

A uniquely named module: several test folders have a conftest.py, and `from conftest import ...`
gets whichever of them pytest imported last.
"""

from __future__ import annotations

import torch
import transformers  # the [quality] extra: a missing one fails the run, never skips it


def tiny_llama(seed: int = 0, head_dim: int = 32) -> transformers.LlamaForCausalLM:
    """A random 2-layer Llama with GQA (4 query heads, 2 KV heads, head_dim 32 unless given), built in ~0.1 s."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg).eval()
