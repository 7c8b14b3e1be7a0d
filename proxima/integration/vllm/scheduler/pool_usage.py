"""Where vLLM's KV pool went: hot blocks, destinations, free; and the accounting check over it.

Plain functions over the ledger, the placement model and vLLM's per-request block lists, so the
manager, the live API (`live.py`) and the tests read the pool one way. Moved out of the KV
manager (`pool_usage`, `owned_blocks`, `check_accounting`) and `live.py` (blocks by format).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from proxima.formats import HOT
from proxima.integration.vllm.scheduler.ledger import RequestLedger
from proxima.placement import BlockId, SlotPacker, check_pool

BlockLists = Mapping[str, Sequence[KVCacheBlock]]
"""vLLM's `req_to_blocks`: request -> its logical blocks' physical blocks (the null block where
a block was compressed away)."""


def total_blocks(pool: BlockPool) -> int:
    return pool.num_gpu_blocks - 1  # block 0 is vLLM's null block


def hot_blocks(ledger: RequestLedger, blocks_of: BlockLists) -> set[BlockId]:
    """Blocks the resident requests hold uncompressed (a shared prefix block once)."""
    return {BlockId(b.block_id) for rid in ledger for b in blocks_of.get(rid, ()) if not b.is_null}


def pool_usage(ledger: RequestLedger, packer: SlotPacker, blocks_of: BlockLists, pool: BlockPool,
               side: int | None = None) -> dict[str, float]:
    """Blocks held hot (shared prefix blocks once), in destinations (and the fraction of their
    slots holding a live compressed block: the rest is packing headroom), free, and (`side`, given
    by the manager: the side tables are charged to the pool) held back for the side tables."""
    dests = list(packer.all_destinations())
    slots = sum(d.fmt.pack_ratio for d in dests)
    usage = {"resident": len(ledger), "hot": len(hot_blocks(ledger, blocks_of)), "dest": len(dests),
             "dest_fill": round(sum(len(d.live) for d in dests) / slots, 3) if slots else 0.0,
             "free": pool.get_num_free_blocks()}
    if side is not None:
        usage["side"] = side
    return usage


def blocks_by_format(ledger: RequestLedger, blocks_of: BlockLists) -> dict[str, int]:
    """Logical blocks of every request in vLLM's lists, by the format they are stored in."""
    by_format: Counter[str] = Counter()
    for rid, blocks in blocks_of.items():
        entry = ledger.get(rid)
        compressed = entry.compressed if entry is not None else {}
        for index, block in enumerate(blocks):
            c = compressed.get(index)
            if c is not None:
                by_format[c.fmt.name] += 1
            elif not block.is_null:  # a committed source is the null block; its copy counted above
                by_format[HOT.name] += 1
    return dict(by_format)


def check_accounting(ledger: RequestLedger, packer: SlotPacker, blocks_of: BlockLists, pool: BlockPool,
                     held: AbstractSet[BlockId] = frozenset()) -> None:
    """The placement invariants (`proxima.placement.model`) over vLLM's pool: the packer agrees
    with the ledger's live slots, and free + owned == total with owned = every block in vLLM's
    per-request lists (Proxima's or not), Proxima's destinations and the blocks `held` back for
    the side tables (`side_tables.py`)."""
    packer.check(ledger.live_slots())
    hot = {BlockId(b.block_id) for blocks in blocks_of.values() for b in blocks if not b.is_null}
    assert not hot & held, f"proxima accounting broken: side-table blocks {sorted(hot & held)} are in a request's list"
    hot |= held
    free = [BlockId(b.block_id) for b in pool.blocks if b.ref_cnt == 0 and not b.is_null]
    check_pool(total_blocks(pool), free, pool.get_num_free_blocks(), hot, packer)
