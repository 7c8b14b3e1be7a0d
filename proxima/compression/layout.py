"""Views of vLLM's per-layer KV tensor: hot paged blocks, and compressed slots inside blocks.

vLLM 0.32 gives each attention layer one tensor of logical shape [num_blocks, H, B, 2 * D]
(per block, KV head and token: key then value channels), in a physical order chosen by the
backend's KV-cache layout:

- CPU_ATTN (`KVLayout.CPU_ATTN`, physical LBHNC = identity): the backend reinterprets each
  (block, head) page as [2 * B, D]: keys of all B tokens, then values of all B tokens. Careful:
  *inside* each half the order is the kernel's, by ISA (on x86 without AMX the keys are stored
  channel-major, [D, B]); `hot_store` here assumes token-major halves, so the vLLM integration
  reads CPU pages through `proxima.integration.vllm.worker.page_layout.PageLayout` (probed from vLLM).
- FlashAttention / Triton on CUDA (`KVLayout.FLASH_ATTN`): the backend reads keys as
  `kv.transpose(1, 2)[..., :D]` and values as `[..., D:]`, strides whatever the layout gives.

Both are *block-contiguous* (the block is the outermost physical axis), which is what lets a
physical block be reinterpreted as `pack_ratio` compressed slots: slot j of block b owns bytes
[j * S, (j + 1) * S) of the block's bytes, S = block bytes / pack ratio; inside a slot, the
first half holds keys [C, H, P] and the second half values. Metadata (scales, zero points,
counts) lives in side tables indexed by the same slot id (block * ratio + j). The layout inside a
slot is Proxima's own, since only Proxima's kernels read compressed slots.

The slots themselves are `SlotPool`s of a `LayerStack` (`layer_stack.py`): the one slot-pool
view, which the vLLM worker writes and every reader and test reads.
"""

from __future__ import annotations

from enum import Enum

import torch

from proxima.compression.blocks import CompressedBlocks
from proxima.formats import HOT


class KVLayout(str, Enum):  # noqa: UP042 - (str, Enum) keeps str() and format() output as callers see it today
    CPU_ATTN = "cpu_attn"
    FLASH_ATTN = "flash_attn"


def _check_kv(kv: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    if kv.dim() != 4 or kv.shape[1] != num_kv_heads or kv.shape[3] != 2 * head_dim:
        raise ValueError(
            f"kv_cache must be [num_blocks, H={num_kv_heads}, B, 2*D={2 * head_dim}], got {tuple(kv.shape)}"
        )
    return int(kv.shape[0]), int(kv.shape[2])


def hot_store(kv_cache: torch.Tensor, layout: KVLayout, *, num_kv_heads: int, head_dim: int) -> CompressedBlocks:
    """The hot (bf16) blocks as a `CompressedBlocks` pool: k_data, v_data [num_blocks, B, H, D]
    are strided views (no copy) onto `kv_cache`, slot id = physical block id."""
    nb, b = _check_kv(kv_cache, num_kv_heads, head_dim)
    if layout == KVLayout.CPU_ATTN:
        if not kv_cache.is_contiguous():
            raise ValueError("CPU_ATTN kv_cache must be contiguous (physical layout LBHNC)")
        pages = kv_cache.view(nb, num_kv_heads, 2 * b, head_dim)
        k = pages[:, :, :b].permute(0, 2, 1, 3)
        v = pages[:, :, b:].permute(0, 2, 1, 3)
    elif layout == KVLayout.FLASH_ATTN:
        kvt = kv_cache.transpose(1, 2)  # [nb, B, H, 2D]
        k, v = kvt[..., :head_dim], kvt[..., head_dim:]
    else:
        raise ValueError(f"layout must be one of {[x.value for x in KVLayout]}, got {layout!r}")
    return CompressedBlocks(HOT, k, v, head_dim=head_dim, dtype=kv_cache.dtype)
