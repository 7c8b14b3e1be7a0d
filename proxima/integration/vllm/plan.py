"""The messages between the scheduler-side and worker-side halves of Proxima (plain, picklable data).

They ride vLLM's KV-connector channel: `ProximaPlan` is the scheduler's per-step
`KVConnectorMetadata`; `ProximaReport` is the worker's `KVConnectorWorkerMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from proxima.placement import BlockId, SlotIndex

NO_BLOCK = BlockId(-1)
"""`src` of a recompression, `from_dst` of a first compression."""
NO_SLOT = SlotIndex(-1)
ActionId = NewType("ActionId", int)
"""One planned compression, from plan to report (unique per engine)."""

NO_READER = ("no Proxima attention backend runs in this worker, so compressed blocks could not be read: "
             "compression is off for this engine. On CUDA start vLLM with `--attention-backend CUSTOM` "
             "(docs/vllm-integration.md); on CPU the plugin installs its backend itself.")
"""The worker's error when no Proxima backend reads compressed blocks; the scheduler then stops
planning (otherwise every emergency compression would fail and be planned again, forever)."""


@dataclass(frozen=True)
class CompressAction:
    """Compress logical block `index` of `req_id` (now at physical `src`) into slot `slot` of `dst`."""

    action_id: ActionId
    req_id: str
    index: int
    src: BlockId
    dst: BlockId
    slot: SlotIndex
    fmt: str
    """Format spelling (`Format.parse` gives it back); strings keep the message small."""
    from_fmt: str = "bf16"
    """Recompression: the block's current format, read from (from_dst, from_slot); `src` unused."""
    from_dst: BlockId = NO_BLOCK
    from_slot: SlotIndex = NO_SLOT


@dataclass
class ProximaPlan(KVConnectorMetadata):
    actions: list[CompressAction] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    """Requests whose blocks were freed (finished, aborted, preempted): forget their remap."""
    scrub: list[int] = field(default_factory=list)
    """Destination blocks released to vLLM since the last plan: zero them (every layer) before
    this step's forward. Their packed bytes read as bf16 include NaN, and vLLM's CPU kernel reads
    whole blocks (masking afterwards), so a NaN left in a position a new owner has not written
    yet would poison its attention rows."""
    key_blocks: dict[int, str] = field(default_factory=dict)
    """Physical block receiving this step's first token -> request, for every scheduled request
    (exclusively owned, so it identifies the batch row without request ids in attention
    metadata): attention finds the rows with compressed blocks, and the rows to observe."""
    revoked: list[CompressAction] = field(default_factory=list)
    """Actions that failed on some rank since the last plan: a rank that wrote one points its block
    map back to where the block was (first, before anything else in this plan reuses the slot)."""
    check_remap: dict[str, dict[int, list[tuple[str, int, int]]]] | None = None
    """With PROXIMA_CHECK_ACCOUNTING=1: the slots the scheduler holds (`ranks.expected_remap`);
    every rank asserts its block map points nowhere else."""


@dataclass
class ProximaReport(KVConnectorWorkerMetadata):
    ok: list[ActionId] = field(default_factory=list)
    failed: list[ActionId] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    kernel_seconds: float = 0.0
    """Wall time of this step's compressions (all formats and layers; summed over merged ranks)."""
    importance: dict[str, list[float]] = field(default_factory=dict)
    """Request -> attention mass of each of its logical blocks (observed this step; blocks the
    worker could not observe, e.g. compressed ones, are NaN)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of this worker's step parts completed since the last report (`timing.py`; empty
    unless `PROXIMA_TIME_SPLIT=1`; the slowest rank's when merged)."""
    ranks: int = 1
    """Worker ranks merged into this report (tensor parallelism: `ranks.merge_reports`)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """vLLM merges the ranks' reports pairwise with this (tensor parallelism)."""
        from proxima.integration.vllm.ranks import merge_reports

        if not isinstance(other, ProximaReport):
            raise TypeError(f"proxima: cannot merge a ProximaReport with a {type(other).__name__}")
        return merge_reports(self, other)
