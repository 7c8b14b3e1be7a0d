"""vLLM's block pool as the placement model's `BlockSource` (`proxima.placement`)."""

from __future__ import annotations

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from proxima.placement import BlockId


class VllmBlockSource:
    """Destination blocks come from vLLM's `BlockPool` and go back to it only through `give_back`:
    listed for the worker to zero first (`ProximaPlan.scrub`: packed bytes read as bf16 include
    NaN, and vLLM's CPU kernel reads whole blocks), then freed, now or by vLLM's deferred-free
    path (`pop_blocks_for_free`)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.scrub: list[BlockId] = []
        """Destinations given back since the last plan (the next plan carries them)."""

    def num_free(self) -> int:
        return self.pool.get_num_free_blocks()

    def take(self) -> BlockId:
        # get_new_blocks also evicts any prefix-cache hash the block carried.
        return BlockId(self.pool.get_new_blocks(1)[0].block_id)

    def blocks(self, ids: list[BlockId]) -> list[KVCacheBlock]:
        return [self.pool.blocks[i] for i in ids]

    def give_back(self, blocks: list[BlockId], *, free_now: bool = True) -> None:
        self.scrub.extend(blocks)
        if free_now and blocks:
            self.pool.free_blocks(self.blocks(blocks))

    def take_scrub(self) -> list[BlockId]:
        out, self.scrub = self.scrub, []
        return out
