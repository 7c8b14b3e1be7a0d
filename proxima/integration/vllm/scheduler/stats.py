"""The scheduler side's counters and its `summary()` (the JSON the connector dumps, the capacity
bench reads). Moved out of the KV manager unchanged: `ProximaStats`, the per-step residency
record, side-table bytes and the summary, as functions of the ledger and the block pool."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import KVCacheConfig

from proxima.compression.spec import SlotSpec
from proxima.formats import Format
from proxima.integration.vllm.scheduler.ledger import RequestLedger
from proxima.integration.vllm.scheduler.pool_usage import total_blocks
from proxima.integration.vllm.scheduler.side_tables import SideTableCharge
from proxima.placement import SlotPacker
from proxima.policy.schema import Storage

TARGETS_KEPT = 4096
"""Requests whose reached target ratio the stats keep (the oldest go first)."""
COUNTED_STEPS_KEPT = 4096
"""Sampled step counts the stats keep (the oldest go first): the medians are of the recent ones."""


@dataclass
class ProximaStats:
    steps: int = 0
    planned: int = 0
    committed: int = 0
    failed: int = 0
    rejected: int = 0
    """Compressions the worker's compression-time probe refused (error over the policy's bound)."""
    emergencies: int = 0
    peak_running: int = 0
    running_sum: int = 0
    side_bytes_peak: int = 0
    preemptions: int = 0
    freed_blocks: int = 0
    importance_updates: int = 0
    """Requests whose block importance the worker reported (summed over steps)."""
    planned_in_prefill: int = 0
    """Compressions planned for requests whose prompt was still being prefilled (chunked prefill)."""
    committed_in_prefill: int = 0
    """... and of those, committed (the rest of the prompt then attended to them)."""
    committed_by_format: dict[str, int] = field(default_factory=dict)
    blocks_compressed: int = 0
    """Commits that compressed a hot block (a block's first compression; the rest of `committed`
    are recompressions): `committed / blocks_compressed` is the compressions per compressed block."""
    queued_blocks_peak: int = 0
    """The most blocks vLLM's waiting queue asked for at a planning step (`queue_demand.py`): the
    demand the engine priced in; 0 throughout when the scheduler's queue was not found."""
    pool_at_peak: dict[str, float] = field(default_factory=dict)
    """Where the pool went at the (first) step of peak residency: hot blocks, destination
    blocks and their filled fraction, free blocks (what bounds the next resident request)."""
    errors: list[str] = field(default_factory=list)
    time_s: dict[str, float] = field(default_factory=dict)
    """Seconds summed over the run, by part of a step (`timing.py`): the scheduler's planning
    (`plan_s`) and commit (`commit_s`), and what the worker reports (forward, compression,
    attention: with `PROXIMA_TIME_SPLIT=1`)."""

    step_counts: list[dict[str, int]] = field(default_factory=list)
    """The worker's sampled steps (`worker/step_counter.py`, one compressing step in 64 with the
    step split): device kernels, host-device copies and host syncs of Proxima's part of each."""

    targets: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Request -> (asked, reached) bytes ratio of its prompt, for requests that set a target
    (`targets.py`; the last `TARGETS_KEPT`)."""

    def record_target(self, req_id: str, asked: float, reached: float) -> None:
        self.targets[req_id] = (asked, reached)
        while len(self.targets) > TARGETS_KEPT:
            self.targets.pop(next(iter(self.targets)))

    def record_counts(self, samples: list[dict[str, int]]) -> None:
        self.step_counts.extend(samples)
        del self.step_counts[:-COUNTED_STEPS_KEPT]

    def add_time(self, name: str, seconds: float) -> None:
        self.time_s[name] = self.time_s.get(name, 0.0) + seconds

    def record_step(self, resident: int, usage: Callable[[], dict[str, float]], side_bytes: int) -> None:
        """Once per engine step: residency, where the pool went at peak residency, side-table peak."""
        self.steps += 1
        if resident > self.peak_running or not self.pool_at_peak:
            self.pool_at_peak = usage()
        self.peak_running = max(self.peak_running, resident)
        self.running_sum += resident
        self.side_bytes_peak = max(self.side_bytes_peak, side_bytes)

    def record_commit(self, fmt: Format, *, in_prefill: bool, first: bool) -> None:
        """One compression the worker reported written; `in_prefill`: planned during its prefill;
        `first`: its source was hot (not a recompression)."""
        self.committed += 1
        self.blocks_compressed += first
        self.committed_in_prefill += in_prefill
        name = fmt.name  # (keyed by name: the stats file is JSON)
        self.committed_by_format[name] = self.committed_by_format.get(name, 0) + 1


class MetaSizes:
    """Side-table bytes (scales, zero points, log-counts) per compressed slot and format, all layers.

    They live outside vLLM's KV pool; the scheduler charges them against it, holding back pool
    blocks for their bytes (`side_tables.py`). With tensor parallelism vLLM's spec describes one
    rank's heads; every rank holds its heads' blocks and side table, so both sizes are the spec's
    times `ranks` (all ranks together)."""

    def __init__(self, config: KVCacheConfig, ranks: int = 1, storage: Storage | None = None) -> None:
        group = config.kv_cache_groups[0]
        self.storage = storage if storage is not None else Storage()
        """The start-up policy's `storage`: the worker's slots' metadata is laid out for its groups."""
        self.spec = group.kv_cache_spec
        self.layers = len(group.layer_names)
        self.ranks = ranks
        self.block_bytes = int(self.spec.page_size_bytes) * self.layers * self.ranks
        """Bytes of one physical block, all layers, all ranks."""
        self._cache: dict[Format, int] = {}
        self._costs: dict[Format, float] = {}

    def per_slot(self, fmt: Format) -> int:
        cached = self._cache.get(fmt)
        if cached is None:
            s = self.spec
            ss = SlotSpec(fmt, s.block_size, s.head_size, s.num_kv_heads,  # type: ignore[attr-defined]
                          self.storage.group_for(fmt))
            cached = self._cache[fmt] = ss.meta_bytes_per_slot * self.layers * self.ranks
        return cached

    def held_block_bytes(self, fmt: Format) -> float:
        """What one logical block held in `fmt` costs, all layers and ranks: its slot's data (a
        physical block over the pack ratio) plus its side-table metadata; a hot block: a block."""
        return self.block_bytes if fmt.is_hot else self.block_bytes / fmt.pack_ratio + self.per_slot(fmt)

    def block_cost(self, fmt: Format) -> float:
        """`held_block_bytes` in physical blocks (admission's unit)."""
        c = self._costs.get(fmt)
        if c is None:
            c = self._costs[fmt] = self.held_block_bytes(fmt) / self.block_bytes
        return c

    def side_table_bytes(self, ledger: RequestLedger) -> int:
        """Metadata bytes of the live compressed slots."""
        return sum(n * self.per_slot(f) for f, n in ledger.formats().items())


def summary(stats: ProximaStats, ledger: RequestLedger, packer: SlotPacker, pool: BlockPool, meta: MetaSizes,
            disabled: str | None, charge: SideTableCharge | None = None) -> dict[str, object]:
    s = stats
    return {
        "steps": s.steps, "planned": s.planned, "committed": s.committed, "failed": s.failed,
        "rejected_by_probe": s.rejected,
        "emergencies": s.emergencies, "freed_blocks": s.freed_blocks,
        "importance_updates": s.importance_updates, "planned_in_prefill": s.planned_in_prefill,
        "committed_in_prefill": s.committed_in_prefill, "disabled": disabled,
        "committed_by_format": dict(s.committed_by_format),
        "blocks_compressed": s.blocks_compressed,
        "compressions_per_block": round(s.committed / s.blocks_compressed, 3) if s.blocks_compressed else 0.0,
        "queued_blocks_peak": s.queued_blocks_peak,
        "peak_resident": s.peak_running, "pool_at_peak": dict(s.pool_at_peak),
        "mean_resident": s.running_sum / max(1, s.steps), "preemptions": s.preemptions,
        "resident_now": len(ledger),
        "side_table_peak_bytes": s.side_bytes_peak,
        "block_bytes": meta.block_bytes, "ranks": meta.ranks,
        "compressed_slots_now": sum(len(e.compressed) for e in ledger.values()),
        "dest_blocks_now": len(packer.owned()),
        "free_blocks": pool.get_num_free_blocks(), "total_blocks": total_blocks(pool),
        "errors": s.errors[-3:],
        "time_split_s": {k: round(v, 4) for k, v in sorted(s.time_s.items())},
        **step_counters(s.step_counts),
        "side_tables_in_pool": charge is not None,  # (always charged when the manager runs)
        "side_table_held_peak_blocks": charge.peak_blocks if charge else 0,
        "side_table_shortfall_peak_bytes": charge.shortfall_peak_bytes if charge else 0,
        "targets": {rid: {"asked": a, "reached": round(r, 4)} for rid, (a, r) in s.targets.items()},
    }


def step_counters(samples: list[dict[str, int]]) -> dict[str, float | int]:
    """Medians over the sampled steps (`launches_per_step`, `memcpys_per_step`, `syncs_per_step`)
    and how many there were; nothing when no step was sampled (a reader then says why)."""
    if not samples:
        return {}
    out: dict[str, float | int] = {f"{k}_per_step": statistics.median(x.get(k, 0) for x in samples)
                                   for k in ("launches", "memcpys", "syncs")}
    out["counted_steps"] = len(samples)
    return out
