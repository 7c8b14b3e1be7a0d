"""Equal KV bytes across vLLM's cache dtypes (vLLM's own page sizes) and the 8B-shaped model folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.capacity_rows import ROWS, shaped_model
from bench.kv_budget import KVShape, equal_memory_pools, pool_for_budget, vllm_block_bytes

LLAMA8B = KVShape(layers=32, num_kv_heads=8, head_dim=128, block_size=32)


def test_vllm_page_sizes_per_dtype() -> None:
    """vLLM 0.32 under TRITON_ATTN: bf16 2 bytes per element; fp8 1; the per-token-head dtypes
    one fp32 scale per token, head and K/V side inline, int4 two elements per byte."""
    per_token_head = {"auto": 2 * 128 * 2, "fp8": 2 * 128, "int8_per_token_head": 2 * 128 + 2 * 4,
                      "int4_per_token_head": 2 * 64 + 2 * 4}
    for dtype, nbytes in per_token_head.items():
        assert vllm_block_bytes(LLAMA8B, dtype) == 32 * 8 * 32 * nbytes, dtype


def test_equal_memory_pools_hold_the_same_bytes() -> None:
    pools = equal_memory_pools(LLAMA8B, 192, list(ROWS))
    budget = pools["vanilla"].kv_bytes
    assert budget == 192 * 32 * 32 * 8 * 512
    for row, p in pools.items():
        assert budget - p.block_bytes < p.kv_bytes <= budget, row
        assert p.num_gpu_blocks == p.blocks + 1
    for row in ("off", "conservative", "balanced", "aggressive"):
        assert pools[row] == pools["vanilla"]  # Proxima keeps the bf16 block and charges its side tables
    # The capacity ratios the issue measured on the H200: 2.00x, 1.94x, 3.76x the bf16 tokens.
    assert pools["vllm_fp8"].blocks == 384
    assert round(pools["vllm_int8_pth"].blocks / 192, 2) == 1.94
    assert round(pools["vllm_int4_pth"].blocks / 192, 2) == 3.76


def test_bad_budget_and_dtype_are_named() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'int3'"):
        vllm_block_bytes(LLAMA8B, "int3")
    with pytest.raises(ValueError, match="must be positive"):
        pool_for_budget(0, 1024)


def test_shaped_model_has_the_8b_kv_shape_and_smollm2_tokenizer(tmp_path: Path) -> None:
    from proxima.models import prepare

    smol_dir = prepare("smollm2", progress=lambda *_: None)  # built on first use (the suite never assumes a cache)
    dst = shaped_model(smol_dir, tmp_path / "m", layers=2)
    cfg = json.loads((dst / "config.json").read_text())
    smol = json.loads((smol_dir / "config.json").read_text())
    assert KVShape.from_hf_config(cfg, 32) == KVShape(2, 8, 128, 32)
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]) == (4096, 14336, 32)
    assert cfg["vocab_size"] == smol["vocab_size"] and not cfg["tie_word_embeddings"]
    assert (dst / "tokenizer.json").read_bytes() == (smol_dir / "tokenizer.json").read_bytes()
    assert not list(dst.glob("*.safetensors"))  # vLLM loads it with random weights
    full = json.loads((shaped_model(smol_dir, tmp_path / "full") / "config.json").read_text())
    assert KVShape.from_hf_config(full, 32) == LLAMA8B
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        shaped_model(tmp_path / "gpt", tmp_path / "x")
