"""The messages between the scheduler-side and worker-side halves of Proxima (plain, picklable data).

They ride vLLM's KV-connector channel: `ProximaPlan` is the scheduler's per-step
`KVConnectorMetadata`; `ProximaReport` is the worker's `KVConnectorWorkerMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class CompressAction:
    """Compress logical block `index` of `req_id` (now at physical `src`) into slot `slot` of `dst`."""

    action_id: int
    req_id: str
    index: int
    src: int
    dst: int
    slot: int
    fmt: str
    """Format spelling (`Format.parse` gives it back); strings keep the message small."""
    from_fmt: str = "bf16"
    """Recompression: the block's current format, read from (from_dst, from_slot); `src` unused."""
    from_dst: int = -1
    from_slot: int = -1


@dataclass
class ProximaPlan(KVConnectorMetadata):
    actions: list[CompressAction] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    """Requests whose blocks were freed (finished, aborted, preempted): forget their remap."""
    key_blocks: dict[int, str] = field(default_factory=dict)
    """Physical block receiving this step's first token -> request, for scheduled requests that
    have compressed blocks (this is how attention finds their rows)."""


@dataclass
class ProximaReport(KVConnectorWorkerMetadata):
    ok: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ProximaReport), f"cannot aggregate ProximaReport with {type(other)}"
        # With several workers (tensor parallel) an action succeeded only if it did everywhere.
        failed = set(self.failed) | set(other.failed)
        ok = (set(self.ok) | set(other.ok)) - failed
        return ProximaReport(sorted(ok), sorted(failed), self.errors + other.errors)
