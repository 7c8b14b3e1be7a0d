"""Run every compression group a policy can plan once before serving, so none compiles in a step.

Triton compiles a kernel variant on its first launch (one to a few seconds on the H100's host).
The attention backend's warm-up compiled the batch kernels per format, but not the step kernels
(`compression.kernels.step`, issue 37) nor the batch path of a first merge as the executor calls
it: on the H100 throughput run (2026-12-07, commit 0ef0329) each new (source, target) group
then compiled inside the serving window, and the CUDA-event time of the step's compression
(634 ms a step under aggressive, 19.8 ms under balanced) held the host's compile time, the GPU
idle meanwhile.

This runs the executor itself (`WorkerStore._compress`, fused or batch path alike, and with the
probe on its reads of the observed layer: `read_current`, `written`) on one dummy action per
group, (hot -> every stored format), then (every format -> every format it can be recompressed
into), in that order so that a recompression's source dtypes are known. The dummy reads and
writes only block 0, vLLM's null block, which vLLM never hands out (so it is never a source, a
destination, nor a side-table row of a real slot) and which attention reads only under a mask.
Nothing enters the block map or the report.

The kernels' variants do not depend on how many actions a step has (`A` is not specialized on,
nor the step table's alignment: see `kernels/step.py`), so one action compiles what any step
launches.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING

import torch

from proxima.formats import HOT, Format
from proxima.integration.vllm.plan import ActionId, CompressAction
from proxima.placement import BlockId, SlotIndex

if TYPE_CHECKING:
    from proxima.integration.vllm.worker.store import WorkerStore

logger = logging.getLogger("proxima.vllm")

NULL_BLOCK = BlockId(0)
"""vLLM's null block (`BlockPool.null_block`, the first block, never allocated)."""


def step_groups_of(store: WorkerStore) -> list[tuple[Format, Format]]:
    """(source, target) pairs, as the scheduler names formats, that the live policy can plan:
    hot into every format, then every format into each it can be recompressed into."""
    policy = store.policy
    if policy is None or not policy.enabled:
        return []
    # Formats the readers cannot read are never written (`WorkerStore._readable`): not run either.
    formats = [f for f in policy.all_formats() if (store.readable_quants is None or f.quant in store.readable_quants)
               and (store.format_gate is None or store.format_gate(store.formats.current(f)) is None)]
    first = [(HOT, f) for f in formats]
    again = [(a, b) for a, b in itertools.permutations(formats, 2) if policy.can_recompress(a, b)]
    return first + again


def warm_up_step_groups(store: WorkerStore) -> list[tuple[Format, Format]]:
    """Compress a dummy block of the null block through every group of `step_groups_of`; returns
    the groups run. A group that fails is logged and skipped (serving would then report the
    same failure for its real actions, and keep their blocks hot)."""
    pairs = step_groups_of(store)
    device = store.device
    if not pairs or device is None:
        return []
    t0 = time.perf_counter()
    table = torch.zeros(1, 3, dtype=torch.long, device=device)  # source page, source row, destination row
    done = []
    for from_fmt, fmt in pairs:
        act = CompressAction(ActionId(-1), "proxima-warm-up", 0, NULL_BLOCK, NULL_BLOCK, SlotIndex(0), fmt,
                             from_fmt=from_fmt, from_dst=NULL_BLOCK, from_slot=SlotIndex(0))
        try:
            store._compress(fmt, from_fmt, [act], table)
            if store.probes_compressions and store.observe_layer is not None:
                # the probe's reads of the observed layer (one layer: other kernel variants)
                layer = store.observe_layer
                store.read_current(layer, from_fmt, [act], table)
                store.written(layer, store.layer_format(layer, store.formats.current(fmt)), table)
        except Exception as e:  # never stop the engine from starting over a warm-up
            logger.warning("proxima: warm-up of %s -> %s failed: %s: %s", from_fmt, fmt, type(e).__name__, e)
            continue
        done.append((from_fmt, fmt))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("proxima: %d compression groups run once in %.1f s", len(done), time.perf_counter() - t0)
    return done


__all__ = ["NULL_BLOCK", "step_groups_of", "warm_up_step_groups"]
