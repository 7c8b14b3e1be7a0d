"""One (source, target) group of a step on the step kernels (`compression.kernels.step`).

A group's blocks in every layer of the group are read where they live (KV pages or source
slots) and written where they go (destination slots and side-table rows), addressed from the
step table (`WorkerStore._step_tables`): a first compression is one launch, a recompression two
(dequantize, quantize), a first merge three (dequantize, k-means, quantize; from KV pages, the
write-once path of a cold block: one gather of the pages instead of the dequantize) and a merge
of centroids four (the same, and the counts' exp in torch: `_row_counts` takes it there, and the
bits must match). No torch scatter runs around them.

The batch path (`slot_reads.read_rows` -> `compress_read` -> `LayerStack.write`) stays for
what these kernels do not cover: the torch reference (CPU serving), caches that do not stack,
the lean and bf16 formats, sparse reductions, a merge that passes rows through, and value checks
(`PROXIMA_CHECK_VALUES`). Both write the same bytes (tests/integration/vllm/worker/test_step_ops.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import torch

from proxima.compression.blocks import DEFAULT_CLUSTER_ITERS, use_triton
from proxima.compression.layer_stack import LayerStack, SlotPool
from proxima.formats import Format
from proxima.integration.vllm.plan import CompressAction
from proxima.integration.vllm.worker.debug import checks_values
from proxima.integration.vllm.worker.page_layout import PageLayout
from proxima.policy.schema import Policy


class StepStore(Protocol):
    """What a group needs of the `WorkerStore` (a protocol: the store imports this module)."""

    stack: LayerStack
    cpu_kernels: Literal["torch", "triton"]
    dtypes: dict[Format, tuple[torch.dtype, torch.dtype]]
    policy: Policy | None

    def slot_pool(self, fmt: Format) -> SlotPool: ...

    def group_for(self, fmt: Format) -> int: ...

    def page_layout(self, kv: torch.Tensor) -> PageLayout: ...

    def importance_of(self, acts: list[CompressAction], b: int, h: int) -> torch.Tensor: ...

STEP_QUANTS = ("fp8", "int8", "int4", "int2")
"""As `compression.kernels.step.STEP_QUANTS` (not imported here: that imports triton)."""


def _step_kernels_run(store: StepStore) -> bool:
    """Whether the step kernels run at all here: a stacked cache, Triton (compiled on a GPU, or
    the interpreter asked for on CPU), and no value checks (`PROXIMA_CHECK_VALUES`)."""
    stack = store.stack
    if stack.kv is None or not stack.layers or checks_values():
        return False
    kv = stack.layers[0]
    return use_triton("auto" if kv.is_cuda else store.cpu_kernels, kv)


def _step_format(fmt: Format) -> bool:
    """Whether the step kernels read and write this stored format's slots."""
    return fmt.quant in STEP_QUANTS and fmt.reduction in (None, "cluster")


def fused(store: StepStore, src: Format, dst: Format) -> bool:
    """Whether the step kernels run this group (stored formats, after `layer_overrides`)."""
    if not _step_kernels_run(store) or not _step_format(dst):
        return False
    if src.is_hot:
        return True
    if not _step_format(src) or (src.reduction == "cluster" and dst.reduction != "cluster"):
        return False
    b = store.stack.layers[0].shape[2]
    t = src.kept_tokens(b)
    # A merge that keeps every row of a reduced source passes them through (`compress_blocks`).
    return dst.reduction is None or not (dst.kept_count(b) == t and t < b)


def reads_slots(store: StepStore, fmt: Format) -> bool:
    """Whether slots of stored format `fmt` are read by the step kernels' dequantize
    (`dequantize_slots`): the formats, caches and kernels `fused` runs as a group's source."""
    return fmt in store.dtypes and _step_format(fmt) and _step_kernels_run(store)


def hot_pages(store: StepStore, rows: tuple[int, ...], table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step table's source pages (column 0) in stack rows `rows`, layer-major: k, v
    [R * A, B, H, D], contiguous."""
    stack = store.stack
    k, v = store.page_layout(stack.layers[rows[0]]).split_pages(stack.pages(rows, table[:, 0]))
    return k.contiguous(), v.contiguous()


def dequantize_slots(store: StepStore, fmt: Format, rows: tuple[int, ...], table: torch.Tensor, col: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The slots named by column `col` (1: the sources, 2: the destinations) of the step table,
    in stack rows `rows`, read where they live (`reads_slots` said yes), layer-major: k, v
    [R * A, C, H, D] in the cache dtype and, for slots with counts, their log-counts
    [R * A, C, H] (else None). One launch, no gather."""
    from proxima.compression.kernels import step

    kv = store.stack.kv
    assert kv is not None
    sp = store.slot_pool(fmt)
    assert sp.k_all is not None and sp.v_all is not None
    kdt, vdt = store.dtypes[fmt]
    # The kernel reads column 1 of rows of 3: a view starting at column col - 1 reads column col.
    cols = table if col == 1 else table[:, col - 1:]
    return step.dequantize_step(fmt.quant, sp.spec.group_size, cols, store.stack.rows(rows), len(rows),
                                sp.k_all.view(kdt), sp.v_all.view(vdt), sp.meta, sp.spec.head_dim, kv.dtype)


def compress_group(store: StepStore, src: Format, dst: Format, rows: tuple[int, ...], acts: list[CompressAction],
                   table: torch.Tensor, upload: Callable[[torch.Tensor, torch.device], torch.Tensor]) -> None:
    """Compress the actions' blocks in stack rows `rows` from stored format `src` into `dst` and
    write them (`fused` said yes). Writes go straight into the destination slots: a failure
    after the first launch leaves written bytes only in slots no block map entry points at
    (the actions fail, and the scheduler releases their slots). `upload`: the store's one
    pinned, non-blocking host-to-device copy (a first merge sends its blocks' importance)."""
    from proxima.compression.kernels import step

    stack = store.stack
    kv = stack.kv
    assert kv is not None
    pool = store.slot_pool(dst)
    spec = pool.spec
    kdt, vdt = getattr(torch, spec.key_dtype), getattr(torch, spec.data_dtype)
    store.dtypes[dst] = (kdt, vdt)
    assert pool.k_all is not None and pool.v_all is not None
    k_dst, v_dst = pool.k_all.view(kdt), pool.v_all.view(vdt)
    idx = stack.rows(rows)
    group = store.group_for(dst)
    lc: torch.Tensor | None = None
    if src.is_hot and dst.reduction is None:
        kpos, vpos = store.page_layout(stack.layers[0]).positions(kv.device)
        step.quantize_step(dst.quant, group, table, idx, len(rows), k_dst, v_dst, pool.meta, pages=(kv, kpos, vpos))
        return
    if src.is_hot:  # a first merge from pages: the blocks' tokens as a dequantize would give them
        k, v = hot_pages(store, rows, table)  # [R * A, B, H, D]
    else:
        k, v, lc = dequantize_slots(store, src, rows, table, 1)
    if dst.reduction == "cluster":
        b = stack.layers[0].shape[2]  # block size (kv is [L, N, H, B, 2D])
        keep = dst.kept_count(b)
        prot = store.policy.protect if store.policy is not None else None
        pins = min(prot.merged_tokens if prot is not None else 0, keep - 1)
        if lc is None:  # a first merge: the blocks' token importance, the same in every layer
            imp = upload(store.importance_of(acts, b, k.shape[2]), kv.device)
            counts = None
        else:  # centroids merged again: weighed by their counts (`compress_blocks._row_counts`)
            imp, counts = None, lc.exp()
        k, v = step.cluster_step(k, v, keep, DEFAULT_CLUSTER_ITERS, table, idx, pool.meta["log_count"],
                                 importance=imp, counts=counts, n_pinned=pins,
                                 pin_by=prot.merged_by if prot is not None else "mixed")
    step.quantize_step(dst.quant, group, table, idx, len(rows), k_dst, v_dst, pool.meta, k=k, v=v)
