"""Blocks read back from where they live: vLLM's pages, or the compressed slots of a stored format.

For the executor's batch path (a recompression's sources), the compression-time probe (the
sources and the slots a group just wrote, in the observed layer) and the readers' `read`. A
slot is read one of two ways: in place by the step kernels' dequantize, one launch, where they
cover the format (`step_groups.dequantize_slots`; the probe's reads), or gathered as stored
(`LayerStack.gather`: keys and values one op, every side-table field one op) and decompressed by
the batch kernels (the batch path, and what the step kernels do not cover).
"""

from __future__ import annotations

from typing import Literal

import torch

from proxima.compression.blocks import CompressedBlocks, decompress_blocks
from proxima.formats import Format
from proxima.integration.vllm.worker import step_groups
from proxima.integration.vllm.worker.step_groups import StepStore


def kernels_for(t: torch.Tensor, cpu: Literal["torch", "triton"] = "torch") -> Literal["torch", "triton", "auto"]:
    """Proxima's Triton kernels on a GPU; on CPU the torch reference (Triton there is the
    interpreter), unless `cpu` asks for the Triton kernels (`WorkerStore.cpu_kernels`)."""
    return "auto" if t.is_cuda else cpu


def read_rows(store: StepStore, rows: tuple[int, ...], src_l: Format, table: torch.Tensor, in_place: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The step table's blocks in stack rows `rows` as they are now, layer-major: k, v
    [R * A, T, H, D] and, when the source slots hold reduced tokens, their log-counts
    [R * A, T, H]; else None. `in_place`: source slots read by the step kernels' dequantize where
    it covers them (the probe's reads; the batch path keeps its gather)."""
    if src_l.is_hot:
        return *step_groups.hot_pages(store, rows, table), None
    if in_place and step_groups.reads_slots(store, src_l):
        k, v, counts = step_groups.dequantize_slots(store, src_l, rows, table, 1)
    else:
        k, v, counts = decompress_rows(store, rows, src_l, table[:, 1])
    return k, v, (counts if src_l.reduction is not None else None)


def decompress_rows(store: StepStore, rows: tuple[int, ...], fmt: Format, idx: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decompress slot rows `idx` (long [A], device) of stored format `fmt` in stack rows `rows`,
    layer-major: k_hat, v_hat [R * A, C, H, D] in the cache dtype and log-counts."""
    sp = store.slot_pool(fmt)
    spec = sp.spec
    kdt, vdt = store.dtypes[fmt]
    k8, v8, meta = store.stack.gather(sp, rows, idx)
    cb = CompressedBlocks(fmt, k8.view(kdt), v8.view(vdt), head_dim=spec.head_dim, dtype=store.stack.layers[0].dtype,
                          group_size=spec.group_size, source_tokens=spec.block_size, **meta)
    return decompress_blocks(cb, backend=kernels_for(k8, store.cpu_kernels))


def written(store: StepStore, row: int, fmt_l: Format, table: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The destination slots of the step table's rows `table` (column 2, `dst * r + slot`) of
    stored format `fmt_l` in stack row `row`, as written: k, v [N, C, H, D] and log-counts
    [N, C, H] (what the compression-time probe measures)."""
    if not step_groups.reads_slots(store, fmt_l):
        return decompress_rows(store, (row,), fmt_l, table[:, 2])
    k, v, lc = step_groups.dequantize_slots(store, fmt_l, (row,), table, 2)
    return k, v, (lc if lc is not None else torch.zeros(k.shape[:3], dtype=torch.float32, device=k.device))


__all__ = ["decompress_rows", "kernels_for", "read_rows", "written"]
