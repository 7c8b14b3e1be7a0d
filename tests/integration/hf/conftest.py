from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401  (the [quality] extra: a missing one fails the run, never skips it)


def tiny_llama(seed: int = 0):
    """A random 2-layer Llama with GQA (4 query heads, 2 KV heads, head_dim 32), built in ~0.1 s."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    return model


@pytest.fixture
def model():
    return tiny_llama()


@pytest.fixture
def ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (1, 300), generator=g)
