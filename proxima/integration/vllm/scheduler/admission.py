"""Admission estimates: how many blocks a prompt will hold once the policy compressed it.

vLLM admits a request only if its whole prompt fits uncompressed. When the policy compresses
finished prompt chunks (`protect.prefilling: false`), the manager admits on this estimate
instead. Moved out of the KV manager unchanged; it reads only the ledger and the policy.
"""

from __future__ import annotations

import math

from proxima.integration.vllm.scheduler.ledger import RequestLedger
from proxima.policy.schema import Policy


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def achieved_pack_ratio(ledger: RequestLedger) -> float | None:
    """Compressed blocks per physical block they take, over the resident requests' committed
    blocks (None before any): the engine's actual mix of formats under this workload."""
    count, space = 0, 0.0
    for c in ledger.compressed_slots():
        count += 1
        space += 1.0 / c.fmt.pack_ratio
    return count / space if count else None


def compressed_footprint(tokens: int, block_size: int, policy: Policy, achieved: float | None) -> int:
    """Blocks a request of `tokens` tokens holds once the policy compressed it under pressure:
    its protected blocks (sinks, recent window, hot tail) stay hot, the others compress as the
    resident requests' blocks did (`achieved`, see `achieved_pack_ratio`); before any
    compression, as the first format of the highest band's ladder (what the engine picks first
    when memory is tightest)."""
    b, prot = block_size, policy.protect
    n = blocks_for(tokens, b)
    hot = min(n, blocks_for(prot.sink_tokens, b) + blocks_for(prot.recent_tokens, b) + 1)
    ladder = policy.bands[-1].ladder if policy.bands else []
    if achieved is None:
        ratio: float = ladder[0].pack_ratio if ladder else 1
    else:  # (a policy changed live to milder formats: no more than it can reach now)
        ratio = min(achieved, max((f.pack_ratio for band in policy.bands for f in band.ladder), default=1))
    return hot + math.ceil((n - hot) / ratio - 1e-9)
