"""Placement: where compressed KV blocks live. One model, used by the vLLM KV manager and the simulator.

Placement is not policy (the engine decides *which* block to compress into *which* format) and
not compression (the bytes): it decides *where* a compressed block's slot goes and when a
physical block goes back to the pool. It is pure Python over an abstract `BlockSource`
(vLLM's `BlockPool` in `integration/vllm/blocks.py`, a counter pool in the simulator), and
imports neither vLLM nor torch.
"""

from proxima.placement.model import (
    DEST_RESERVE_BLOCKS,
    BlockId,
    BlockSource,
    CounterPool,
    Destination,
    SlotIndex,
    SlotPacker,
    check_pool,
)

__all__ = [
    "DEST_RESERVE_BLOCKS",
    "BlockId",
    "BlockSource",
    "CounterPool",
    "Destination",
    "SlotIndex",
    "SlotPacker",
    "check_pool",
]
