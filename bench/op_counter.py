"""The off-line op counter of `bench/step_ops.py`: the product's (`worker/step_counter.py`, where
the engine samples it too; one implementation, re-exported here for the bench's imports)."""

from __future__ import annotations

from proxima.integration.vllm.worker.step_counter import (
    HOST_READS,
    HOST_WORK,
    NO_KERNEL_OPS,
    SYNC_OPS,
    Counts,
    OpCounter,
)

__all__ = ["HOST_READS", "HOST_WORK", "NO_KERNEL_OPS", "SYNC_OPS", "Counts", "OpCounter"]
