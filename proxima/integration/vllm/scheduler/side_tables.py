"""Side tables counted against vLLM's KV pool: blocks held back for the bytes of the metadata.

Compressed slots live in vLLM's pool; their scales, zero points and log-counts live in the
worker's side tables next to it (`worker/store.py`). vLLM sizes its pool to fill its memory budget
(`gpu_memory_utilization`, or `kv_cache_memory_bytes`), so metadata allocated on top of the pool
would take the engine past that budget (an out-of-memory at 0.9 on the H200 was seen when this was
a benchmark-only switch): the metadata's bytes come out of the pool, always. The scheduler holds
back, at every step, as many of the pool's blocks as the live side tables
(committed and in-flight slots) fill: those blocks are owned and never written, so admission,
the destination reserve and vLLM's own allocation all see a pool smaller by exactly the
metadata. The metadata itself stays in the worker's tensors (moving it into the held blocks
would save nothing: same bytes).

Why the live size and not a bound fixed at startup: an upper bound (every pool block a
destination of the most metadata-heavy format) is 25% of the pool for int4 and 69% for
cluster(4)+int4 at block 32, several times what a run ever holds (CPU table: 13-26%), so a fixed
bound would charge memory no request uses. The live charge can lag: if the pool has no free
block when the metadata grows (vLLM allocated them in the same step), the shortfall is recorded
(`shortfall_peak_bytes`) and taken back from the next freed blocks. A compression always frees
more than its metadata costs (one source block against 1/r of a destination plus at most 0.7 of
a block's bytes per r slots), so the shortfall stays small and is reported, not hidden.
"""

from __future__ import annotations

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from proxima.placement import BlockId


def blocks_needed(side_bytes: int, block_bytes: int) -> int:
    """Whole blocks that hold `side_bytes` (0 for none)."""
    if block_bytes <= 0:
        raise ValueError(f"block bytes must be positive, got {block_bytes}")
    return -(-max(0, side_bytes) // block_bytes)


class SideTableCharge:
    """Blocks of vLLM's pool held back for the side tables' bytes (see the module docstring)."""

    def __init__(self, pool: BlockPool, block_bytes: int) -> None:
        self.pool = pool
        self.block_bytes = block_bytes
        self.held: list[KVCacheBlock] = []
        self.peak_blocks = 0
        self.shortfall_peak_bytes = 0
        """Largest excess of side-table bytes over the held blocks' bytes (0: always covered)."""

    def ids(self) -> set[BlockId]:
        return {BlockId(b.block_id) for b in self.held}

    def settle(self, side_bytes: int) -> None:
        """Hold exactly the blocks `side_bytes` need (as many as are free when they grow)."""
        need = blocks_needed(side_bytes, self.block_bytes)
        if need > len(self.held):
            n = min(need - len(self.held), self.pool.get_num_free_blocks())
            if n > 0:
                self.held.extend(self.pool.get_new_blocks(n))
        elif need < len(self.held):
            extra = self.held[need:]
            del self.held[need:]
            self.pool.free_blocks(extra)
        self.peak_blocks = max(self.peak_blocks, len(self.held))
        self.shortfall_peak_bytes = max(self.shortfall_peak_bytes, side_bytes - len(self.held) * self.block_bytes)
