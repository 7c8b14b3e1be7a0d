"""How much GPU memory the side tables may take beyond vLLM's KV pool, said at start-up.

The worker allocates the side tables (scales, zero points, log-counts) of every format the
start-up policy can store at registration, as one arena over every pool block
(`compression/side_arena.py`: a block holds one format's slots at a time, so its region is the
largest format's), outside vLLM's KV tensor. The scheduler charges the *live* side tables to the
pool (`scheduler/side_tables.py`), so admission is honest, but the physical arena is full-size:
per pool block, in bytes of the pool, the shipped policies' arenas are 0.25x (conservative),
0.50x (balanced) and 1.16x (aggressive) at the 8B shape with block 32 (one table per format, as
before 2026-12-07: 0.33x, 1.23x, 2.47x). vLLM sizes its pool to
`gpu_memory_utilization` and expects the rest of its budget for activations and CUDA graphs, so
tables that outgrow the memory vLLM leaves outside its budget run the GPU out of memory under
load (the 0.9 out-of-memory of issue 41). Until the tables live in the pool's own blocks (a
slot -> row indirection through every reader), the worker says so at start-up, with the numbers
and the setting that fits, instead of failing mid-run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from proxima.compression.side_arena import block_bytes
from proxima.compression.spec import SlotSpec
from proxima.formats import HOT
from proxima.policy.schema import Policy

logger = logging.getLogger("proxima.vllm")

GIB = float(1 << 30)


def worst_case_bytes(policy: Policy, layers: int, num_blocks: int, heads: int, block_size: int,
                     head_dim: int) -> int:
    """Bytes of the side tables `policy`'s formats allocate: one arena over every pool block in
    every layer, each block's region the largest format's (`LayerStack.reserve`, `side_arena`)."""
    specs = [SlotSpec(f, block_size, head_dim, heads, policy.storage.group_for(f))
             for f in policy.stored_formats(layers) if f != HOT]
    return layers * num_blocks * block_bytes(specs)


@dataclass(frozen=True)
class Budget:
    """The side tables' worst case against the memory vLLM leaves outside its budget."""

    worst_bytes: int
    pool_bytes: int
    total_bytes: int
    utilization: float

    @property
    def outside_bytes(self) -> float:
        """GPU memory outside vLLM's budget (1 - gpu_memory_utilization of the device)."""
        return (1.0 - self.utilization) * self.total_bytes

    @property
    def fits(self) -> bool:
        return self.worst_bytes <= self.outside_bytes

    def utilization_that_fits(self) -> float:
        """The largest `gpu_memory_utilization` whose pool's worst-case tables fit outside the
        budget, vLLM's non-KV memory unchanged: lowering the utilization by x shrinks the pool
        by x * total, and its tables by w times that (w = worst / pool bytes)."""
        w = self.worst_bytes / self.pool_bytes if self.pool_bytes else 0.0
        t = float(self.total_bytes)
        u = (t * (1.0 + w * self.utilization) - w * self.pool_bytes) / (t * (1.0 + w))
        return max(0.0, min(self.utilization, u))

    def message(self, policy_name: str) -> str:
        return (
            f"proxima: policy {policy_name!r} can allocate {self.worst_bytes / GIB:.1f} GiB of side tables "
            f"({self.worst_bytes / max(1, self.pool_bytes):.2f}x the {self.pool_bytes / GIB:.1f} GiB KV pool) "
            f"outside vLLM's pool, and gpu_memory_utilization {self.utilization:.2f} leaves "
            f"{self.outside_bytes / GIB:.1f} GiB of the {self.total_bytes / GIB:.1f} GiB device outside vLLM's "
            f"budget: under full load the GPU can run out of memory. Set gpu_memory_utilization <= "
            f"{self.utilization_that_fits():.2f}, or a smaller pool (num_gpu_blocks_override), or a policy "
            f"with lean formats (int4h)."
        )


def check_at_startup(policy: Policy | None, layers: int, shape: tuple[int, ...], pool_bytes: int,
                     total_bytes: int, utilization: float) -> Budget | None:
    """Warn (once, at registration) when the worst-case side tables do not fit outside vLLM's
    budget; return the budget measured (None without a policy that compresses)."""
    if policy is None or not policy.enabled:
        return None
    n, h, b, d2 = shape
    budget = Budget(worst_case_bytes(policy, layers, n, h, b, d2 // 2), pool_bytes, total_bytes, utilization)
    if not budget.fits:
        logger.warning(budget.message(policy.name))
    return budget


__all__ = ["Budget", "check_at_startup", "worst_case_bytes"]
