"""The messages between the scheduler-side and worker-side halves of Proxima (plain, picklable data).

They ride vLLM's KV-connector channel: `ProximaPlan` is the scheduler's per-step
`KVConnectorMetadata`; `ProximaReport` is the worker's `KVConnectorWorkerMetadata`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NewType

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from proxima.placement import BlockId, SlotIndex
from proxima.policy.schema import Policy

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
    policy_version: int = 0
    """The scheduler's live policy version when it built this plan (0: the startup policy)."""
    policy: Policy | None = None
    """The live policy, in the first plan after it changed (else None): the worker adopts it
    (importance settings, compression probe, layer overrides) before this plan's work."""


@dataclass
class ProximaReport(KVConnectorWorkerMetadata):
    ok: list[ActionId] = field(default_factory=list)
    failed: list[ActionId] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    kernel_seconds: float = 0.0
    """Wall time of this step's compressions (all formats and layers)."""
    importance: dict[str, list[float]] = field(default_factory=dict)
    """Request -> attention mass of each of its logical blocks (observed this step; blocks the
    worker could not observe, e.g. compressed ones, are NaN)."""
    rejected: dict[ActionId, str] = field(default_factory=dict)
    """Actions the compression-time probe refused (the block is as it was) -> the milder format
    within the bound, "" for none (the block stays hot), or the action's own format when the
    block could not be measured yet (planned again later)."""
    probe_errors: list[tuple[str, float]] = field(default_factory=list)
    """(format, relative attention-output error) of every probe measurement this step."""
    probe_measured: int = 0
    """Blocks the probe measured in their chosen format (the denominator of the refusals)."""
    probe_refused: int = 0
    """Of those, over the bound."""
    probe_seconds: float = 0.0
    """Wall time of this step's probe measurements."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ProximaReport), f"cannot aggregate ProximaReport with {type(other)}"
        # With several workers (tensor parallel) an action succeeded only if it did everywhere.
        failed = set(self.failed) | set(other.failed)
        ok = (set(self.ok) | set(other.ok)) - failed
        # Every worker holds all layers' heads of its shard; the scheduler wants one number per block.
        importance = dict(self.importance)
        for rid, imp in other.importance.items():
            mine = importance.get(rid)
            importance[rid] = imp if mine is None else [_nanmax(a, b) for a, b in zip(mine, imp, strict=False)]
        # A block refused anywhere stays as it was. Each rank measures its own heads' shard; a rank
        # that accepted where another refused has written its slot (the same caveat as an action
        # that failed on one rank only: that rank's remap keeps the entry).
        rejected = {aid: f for aid, f in {**other.rejected, **self.rejected}.items() if aid not in failed}
        ok -= set(rejected)
        return ProximaReport(
            ok=sorted(ok), failed=sorted(failed), errors=self.errors + other.errors,
            kernel_seconds=max(self.kernel_seconds, other.kernel_seconds), importance=importance, rejected=rejected,
            probe_errors=self.probe_errors + other.probe_errors,
            probe_measured=max(self.probe_measured, other.probe_measured),
            probe_refused=max(self.probe_refused, other.probe_refused),
            probe_seconds=max(self.probe_seconds, other.probe_seconds),
        )


def _nanmax(a: float, b: float) -> float:
    """The larger of two masses, a NaN (not observed) losing to any number (Python's max is order-dependent)."""
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)
