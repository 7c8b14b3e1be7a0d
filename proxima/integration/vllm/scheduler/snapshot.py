"""What the policy engine sees of vLLM's pool (`proxima.policy.snapshot.Snapshot`), and the check
of what it decides against DESIGN.md's protections.

Plain functions over the ledger, vLLM's per-request block lists and its block pool, so the
manager's planning reads: snapshot, decide, reserve. Moved out of the KV manager unchanged
(`snapshot`, `_finishing`, `_check_protected` there).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from proxima.formats import HOT
from proxima.integration.vllm.scheduler.ledger import RequestEntry, RequestLedger
from proxima.integration.vllm.scheduler.pool_usage import BlockLists, total_blocks
from proxima.policy.schema import Protect
from proxima.policy.snapshot import ProbeStatus, RequestBlocks, Snapshot


def build_snapshot(ledger: RequestLedger, blocks_of: BlockLists, pool: BlockPool, block_size: int,
                   pending_blocks: int = 0, finishing: AbstractSet[str] = frozenset(),
                   probe_status: ProbeStatus = "ok", queued_blocks: int = 0) -> Snapshot:
    """The pool and every resident request's blocks for the policy engine; requests in
    `finishing` are left out (none of their blocks is eligible). `queued_blocks`: what the
    waiting queue will ask for (`queue_demand.py`)."""
    reqs: list[RequestBlocks] = []
    for rid, entry in ledger.items():
        blocks = blocks_of.get(rid)
        if not blocks or rid in finishing:
            continue
        reqs.append(request_blocks(entry, blocks, block_size))
    return Snapshot.build(
        total_blocks=total_blocks(pool),
        free_blocks=pool.get_num_free_blocks(),
        block_size=block_size,
        requests=reqs,
        pending_blocks=pending_blocks,
        queued_blocks=queued_blocks,
        probe_status=probe_status,
    )


def request_blocks(entry: RequestEntry, blocks: Sequence[KVCacheBlock], block_size: int) -> RequestBlocks:
    """One resident request's logical blocks for the engine: tokens computed per block, formats
    from the ledger, and the blocks the engine must not pick (in flight, or a prefix-cache block
    another request also reads)."""
    b, r, n = block_size, entry.request, len(blocks)
    computed = r.num_computed_tokens
    tokens = [max(0, min(b, computed - i * b)) for i in range(n)]
    formats = [entry.compressed[i].fmt if i in entry.compressed else HOT for i in range(n)]
    shared = [(i in entry.in_flight) or (i not in entry.compressed and blocks[i].ref_cnt > 1) for i in range(n)]
    return RequestBlocks(request_id=r.request_id, importance=entry.importance_of(n), formats=formats,
                         tokens=tokens, shared=shared, in_prefill=computed < r.num_prompt_tokens)


def finishing_requests(ledger: RequestLedger, scheduled_req_ids: Iterable[str]) -> set[str]:
    """Scheduled requests that decode their last token this step (`max_tokens`; a stop string
    or EOS cannot be foreseen). vLLM frees a request that finished in a step before it applies
    the step's connector report, so compressing their blocks would be wasted work. (A request
    recomputing after preemption is not decoding: `num_computed_tokens` is behind.)"""
    out = set()
    for rid in scheduled_req_ids:
        entry = ledger.get(rid)
        r = entry.request if entry is not None else None
        if r is not None and r.num_computed_tokens == r.num_tokens - 1 and r.num_output_tokens + 1 >= r.max_tokens:
            out.add(rid)
    return out


def check_protected(entry: RequestEntry, index: int, num_blocks: int, block_size: int, prot: Protect) -> None:
    """DESIGN.md invariants, re-checked on every action (tests): never the hot tail, never a
    protected window, never a block not fully computed, nor one of a request still in prefill
    unless the policy allows it (`protect.prefilling: false`). `num_blocks`: the request's blocks
    in vLLM's list."""
    b, r, n = block_size, entry.request, num_blocks
    ok = (
        index < n - 1
        and index * b >= prot.sink_tokens
        and (index + 1) * b <= r.num_computed_tokens - prot.recent_tokens
        and (r.num_computed_tokens >= r.num_prompt_tokens or not prot.prefilling)
    )
    if not ok:
        raise AssertionError(
            f"proxima would compress block {index} of {r.request_id} ({n} blocks, "
            f"{r.num_computed_tokens} computed, protect={prot}): this indicates a bug in the engine's eligibility"
        )
