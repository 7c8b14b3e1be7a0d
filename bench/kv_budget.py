"""Equal KV memory across vLLM's cache dtypes and Proxima: block counts from one byte budget.

The capacity benchmark gives every row the same KV bytes. vLLM's own quantized caches store a
block in fewer bytes, so the same bytes hold more of their blocks; Proxima's rows keep vLLM's
bf16 block and count their side tables against the same bytes (`side_tables.py`). The page size
of a dtype is vLLM's own: `FullAttentionSpec.page_size_bytes` after TRITON_ATTN's
`customize_spec` (vLLM 0.32 packs one fp32 scale per token, head and K/V side inline for the
`*_per_token_head` dtypes, and halves the head dim for int4), so the arithmetic follows whatever
the installed vLLM allocates instead of a copy of its formula.
"""

from __future__ import annotations

from dataclasses import dataclass

VLLM_KV_DTYPES: dict[str, str] = {
    "vanilla": "auto",
    "vllm_fp8": "fp8",
    "vllm_int8_pth": "int8_per_token_head",
    "vllm_int4_pth": "int4_per_token_head",
}
"""Benchmark rows served by vLLM's own KV cache, and the `kv_cache_dtype` each passes."""


@dataclass(frozen=True)
class KVShape:
    """What sizes a KV block: layers, KV heads, head dim, tokens per block (bf16 model)."""

    layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @classmethod
    def from_hf_config(cls, config: dict, block_size: int) -> KVShape:
        """From a Hugging Face `config.json` (Llama-style keys)."""
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return cls(int(config["num_hidden_layers"]), int(config.get("num_key_value_heads", heads)), head_dim,
                   block_size)


def vllm_block_bytes(shape: KVShape, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block over all layers, as vLLM sizes it under TRITON_ATTN for `kv_cache_dtype`
    (`auto`: the model's bf16)."""
    import torch
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    if kv_cache_dtype not in ("auto", "bfloat16") and kv_cache_dtype not in STR_DTYPE_TO_TORCH_DTYPE:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of vLLM's "
                         f"({', '.join(sorted(STR_DTYPE_TO_TORCH_DTYPE))})")
    dtype = torch.bfloat16 if kv_cache_dtype in ("auto", "bfloat16") else STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype]
    spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=shape.num_kv_heads,
                             head_size=shape.head_dim, dtype=dtype, kv_quant_mode=get_kv_quant_mode(kv_cache_dtype))
    return int(TritonAttentionBackend.customize_spec(spec).page_size_bytes) * shape.layers


@dataclass(frozen=True)
class Pool:
    """One row's KV pool: usable blocks (vLLM's null block excluded), bytes per block (all
    layers), and the bytes they hold (never more than the budget)."""

    blocks: int
    block_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def num_gpu_blocks(self) -> int:
        """vLLM's `num_gpu_blocks_override`: the usable blocks plus its null block."""
        return self.blocks + 1


def pool_for_budget(kv_bytes: int, block_bytes: int) -> Pool:
    """The most whole blocks of `block_bytes` that `kv_bytes` hold."""
    if kv_bytes <= 0 or block_bytes <= 0:
        raise ValueError(f"KV bytes and block bytes must be positive, got {kv_bytes} and {block_bytes}")
    return Pool(kv_bytes // block_bytes, block_bytes)


def equal_memory_pools(shape: KVShape, bf16_blocks: int, rows: list[str]) -> dict[str, Pool]:
    """Each row's pool at the bytes of `bf16_blocks` bf16 blocks: vLLM's dtype rows get the blocks
    those bytes hold in their dtype; every other row (Proxima's) gets the bf16 pool itself and
    charges its side tables against it."""
    bf16 = vllm_block_bytes(shape, "auto")
    budget = bf16_blocks * bf16
    return {row: pool_for_budget(budget, vllm_block_bytes(shape, VLLM_KV_DTYPES[row]))
            if row in VLLM_KV_DTYPES else Pool(bf16_blocks, bf16) for row in rows}
