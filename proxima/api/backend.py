"""What the controller needs from an engine: the `Backend` protocol and the plain data it returns.

Two implementations: `proxima.api.sim_backend.SimulatedBackend` (the simulator, for demos and
tests) and `proxima.integration.vllm.scheduler.live.ManagerBackend` (vLLM's KV manager). Both are passive:
the engine drives its own steps and calls the controller's hooks (`policy_for_step`, `on_step`,
`on_probe`); the controller only asks the backend for `stats()`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from proxima.compression.spec import bytes_ratio
from proxima.policy.backoff import BackoffEvent


@dataclass(frozen=True)
class BackendStats:
    """The pool as the engine sees it now."""

    pressure: float
    """Used fraction of physical blocks, pending allocations included (the engine's input)."""
    total_blocks: int
    free_blocks: int
    owned_blocks: int
    blocks_by_format: dict[str, int]
    """Resident logical blocks by format name (bf16 = uncompressed)."""
    block_bytes: int
    """Bytes of one uncompressed physical block (all layers, K and V)."""
    fragmentation_blocks: float
    step: int
    applied_policy_version: int | None = None
    """The policy version the engine planned its last step with (None: not known). It trails the
    store's live version until the engine's next step picks a change up."""
    meta_bytes: int = 0
    """Side-table bytes (scales, zero points, log-counts) of the resident compressed slots: they
    count against the compression (in vLLM the pool holds blocks back for them, which
    `owned_blocks` leaves out so they are not counted twice)."""

    @property
    def logical_blocks(self) -> int:
        return sum(self.blocks_by_format.values())

    @property
    def held_bytes(self) -> int:
        """Bytes held for the resident requests: owned physical blocks plus side-table metadata."""
        return self.owned_blocks * self.block_bytes + self.meta_bytes

    @property
    def saved_bytes(self) -> int:
        """Bytes the resident requests would need more without compression (packing waste and
        metadata counted)."""
        return max(0, self.logical_blocks * self.block_bytes - self.held_bytes)

    @property
    def effective_compression(self) -> float:
        """16-bit KV bytes of the resident logical blocks over the bytes held for them, metadata
        included (`proxima.compression.spec.bytes_ratio`); 1.0 with nothing resident."""
        if not self.owned_blocks:
            return 1.0
        return bytes_ratio(self.logical_blocks * self.block_bytes, self.held_bytes)

    @property
    def nominal_compression(self) -> float:
        """Nominal: logical blocks per owned physical block (metadata not counted)."""
        return self.logical_blocks / self.owned_blocks if self.owned_blocks else 1.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            logical_blocks=self.logical_blocks,
            saved_bytes=self.saved_bytes,
            effective_compression=round(self.effective_compression, 6),
            nominal_compression=round(self.nominal_compression, 6),
        )
        return out


@dataclass(frozen=True)
class StepReport:
    """What one engine step did, reported by the engine to `Controller.on_step`."""

    decisions_by_format: dict[str, int] = field(default_factory=dict)
    """Compressions applied this step, by target format."""
    errors_by_reason: dict[str, int] = field(default_factory=dict)
    """Compressions that failed and left the block as it was (e.g. 'kernel', 'pool_exhausted')."""
    rejected_by_probe: int = 0
    """Compressions the compression-time probe refused."""
    kernel_seconds: float | None = None
    """Wall time of the step's compression kernels (None when no kernel ran)."""
    backoff: tuple[BackoffEvent, ...] = ()
    """Formats paused or resumed by the compression backoff (`proxima.policy.backoff`)."""
    probe_errors: tuple[tuple[str, float], ...] = ()
    """(format, relative attention-output error) of every compression-time probe measurement."""
    probe_seconds: float | None = None
    """Wall time of the step's probe measurements (None when none ran)."""


@runtime_checkable
class Backend(Protocol):
    def stats(self) -> BackendStats:
        """A consistent view of the pool; called from API threads, so it must be thread-safe."""
        ...
