"""The blocks vLLM's waiting queue will ask for: the demand the policy engine prices in.

The engine settles a cold block's rung once, at the depth this episode's demand will push the
pool to (`policy.engine.settled_price`): the blocks freed now, this step's need, and the blocks
still queued (`Snapshot.queued_blocks`). Without the queue, a burst of arrivals is met one
admission at a time and every rung of the ladder is written in turn as the pool fills (the H100
throughput run, 2026-12-07: 2.87 compressions per compressed block under aggressive; the
simulator, which counts its queue, 1.0 on the same shape: `bench/results/write-once-sim.md`).

vLLM's KV manager sees only the head of the queue (the scheduler stops at the first request
that does not fit), so this reads the scheduler's own waiting queue. The scheduler is the
object that binds the connector (`Scheduler.__init__` calls `bind_kv_cache_manager`); no vLLM
hook hands it over, so `binding_scheduler` takes it from that call (read only, never changed;
patch 4 of `_patches`). Without it (another scheduler, another vLLM) the demand is 0:
the engine then plans as before, on the present need alone.

Bounded per step: at most the free request slots (`max_num_seqs` minus the resident requests)
are read, and the sum stops at `limit` (the manager passes the blocks the pool holds at the
policy's harshest format: a queue asking more cannot be met anyway). A first version stopped at
the pool's own size: the price then saw at most one pool of demand, and a burst of 15 queued
prompts of 64 blocks each (960) against a pool of 192 still climbed the ladder (H100, aggressive:
1.61 compressions per compressed block; CPU capacity workload 1.23, 1.007 without that cap).
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any

from proxima.integration.vllm.scheduler.admission import blocks_for


def binding_scheduler(depth: int = 2) -> Any | None:
    """Patch 4 (`_patches`): the vLLM scheduler whose `__init__` is `depth` frames up (the caller
    of the connector's `bind_kv_cache_manager`, which calls this), or None if that is not one."""
    from vllm.v1.core.sched.interface import SchedulerInterface

    candidate = sys._getframe(depth).f_locals.get("self")
    return candidate if isinstance(candidate, SchedulerInterface) else None


class QueueDemand:
    """Reads a scheduler's waiting queue; holds it weakly (the engine owns the scheduler)."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = weakref.ref(scheduler)

    def blocks(self, block_size: int, resident: int, limit: int, head_counted: bool) -> int:
        """Uncompressed blocks of the waiting requests' prompts that can still be admitted.

        `resident`: requests holding blocks now (they use request slots); `head_counted`: the
        queue's head already counts as this step's pending need (`ProximaState.waiting_need`),
        so it is skipped, as the simulator does."""
        sched = self._scheduler()
        queue = getattr(sched, "waiting", None) if sched is not None else None
        if queue is None:
            return 0
        slots = int(getattr(sched, "max_num_running_reqs", 0) or 0) - resident
        if slots <= 0:
            return 0
        total = 0
        for req in itertools.islice(iter(queue), int(head_counted), slots):  # the head takes a slot too
            total += blocks_for(int(req.num_tokens), block_size)
            if total >= limit:
                return limit
        return total


__all__ = ["QueueDemand", "binding_scheduler"]
