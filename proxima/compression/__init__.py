"""Compressed KV block formats, their torch reference ops and Triton kernels (DESIGN.md "Block formats").

Public API (shapes use named dims: N blocks, T tokens, H KV heads, Hq query heads, D head dim):

- `compress_block(fmt, k [T, H, D], v, *, token_importance [T, H], protected bool [T])`; batched
  `compress_blocks` / `decompress_blocks(cb) -> (k_hat [N, T', H, D], v_hat, log_count [N, T', H])`
  over [N, T, H, D].
- `decode_attention(q [S, Hq, D], segments)`: attention over hot and compressed blocks of
  several formats, with output, log-sum-exp and per-block attention mass.
- `attention_error(q_obs [W, Hq, D], k, v, cb)`: the compression-time probe; `attention_errors`
  the same for N blocks (what the transformers cache and the vLLM worker's probe call).
- Bytes: `CompressedBlocks.held_nbytes` (what a store keeps, metadata included),
  `kv16_bytes` and `bytes_ratio` (`spec.py`): every reported ratio is 16-bit KV bytes over held bytes.
- `slot_spec(fmt, ...)`: bytes and metadata layout of a format; `layout`: views onto vLLM's KV
  tensor (CPU_ATTN and FlashAttention layouts); `layer_stack`: the KV layers as one tensor and
  their compressed slots (`SlotPool`, with its side tables: the one slot-pool view).

Nothing here imports vLLM. Triton is imported only when a Triton backend is used.
"""

from proxima.compression.attention import (
    DecodeOutput,
    KVSegment,
    attention_error,
    attention_errors,
    decode_attention,
    decode_attention_reference,
    merge_partials,
)
from proxima.compression.blocks import (
    CompressedBlock,
    CompressedBlocks,
    compress_block,
    compress_blocks,
    decompress_blocks,
    kept_count,
)
from proxima.compression.layer_stack import LayerSlots, LayerStack, SlotPool
from proxima.compression.layout import KVLayout, hot_store
from proxima.compression.spec import DEFAULT_GROUP_SIZE, SlotSpec, bytes_ratio, kv16_bytes, slot_spec

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "CompressedBlock",
    "CompressedBlocks",
    "DecodeOutput",
    "KVLayout",
    "KVSegment",
    "LayerSlots",
    "LayerStack",
    "SlotPool",
    "SlotSpec",
    "attention_error",
    "attention_errors",
    "bytes_ratio",
    "compress_block",
    "compress_blocks",
    "decode_attention",
    "decode_attention_reference",
    "decompress_blocks",
    "hot_store",
    "kept_count",
    "kv16_bytes",
    "merge_partials",
    "slot_spec",
]
