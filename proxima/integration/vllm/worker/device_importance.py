"""Block importance observed on the device, brought to the scheduler's report one step later.

The one-pass decode keeps each request's per-block attention mass as an exponential average in
`DeviceBlockTable.importance` (`mixed_decode.update_block_importance`, in the observed layer).
The scheduler still receives it as `ProximaReport.importance` (request -> one number per block,
NaN = keep yours). Reading it back in the step that computed it would make the host wait for the
step's attention; instead the step ends with one non-blocking copy of the observed requests'
rows (folded over KV heads on the device) into pinned memory, and the next step's report carries
it, after an event that has long completed by then (or this step's, if the copy has already
landed when the step ends: always on the CPU). Host work per step: one gather launch, one
copy, and per observed request one list conversion of its blocks (the report's format).
"""

from __future__ import annotations

import torch

from proxima.integration.vllm.plan import ProximaReport
from proxima.integration.vllm.worker.block_table import DeviceBlockTable
from proxima.observation import fold_heads


def seed_from_host(table: DeviceBlockTable, rid: str, token_importance: torch.Tensor, block_size: int) -> None:
    """Continue the device average from a host observation (a prefill window, or a decode step
    on the split path): `rid`'s row becomes its token importance [tokens, H] summed per block
    (the torch path's block mass before the KV-head fold). Host work only in steps the host
    observed; one small copy per such request."""
    row = table.imp_rows.get(rid)
    if row is None:
        return
    n, h = token_importance.shape
    nb = min(-(-n // block_size), table.max_blocks)
    pad = torch.zeros(nb * block_size, h)
    pad[: min(n, nb * block_size)] = token_importance[: nb * block_size]
    per_block = pad.view(nb, block_size, h).sum(1)
    table.importance[row, :nb].copy_(per_block, non_blocking=True)


class ImportanceReadback:
    def __init__(self) -> None:
        self._pending: tuple[list[str], torch.Tensor, torch.cuda.Event | None, str] | None = None

    def start(self, table: DeviceBlockTable, rids: list[str], width: int, aggregate: str) -> None:
        """Queue the copy of `rids`' importance (their first `width` blocks), folded over KV heads."""
        rids = [rid for rid in rids if rid in table.imp_rows]
        if not rids:
            return
        rows = torch.tensor([table.imp_rows[rid] for rid in rids], dtype=torch.long)
        cuda = table.device.type == "cuda"
        rows_dev = (rows.pin_memory() if cuda else rows).to(table.device, non_blocking=True)
        width = max(1, min(width, table.max_blocks))
        folded = fold_heads(table.importance[:, :width].index_select(0, rows_dev), aggregate, 2)  # [n, width]
        host = torch.empty(folded.shape, dtype=folded.dtype, pin_memory=cuda)
        host.copy_(folded, non_blocking=True)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending = (rids, host, event, aggregate)

    def finish(self, report: ProximaReport, *, wait: bool = True) -> None:
        """Put the queued observation into `report` (a request also observed on the host this
        step keeps the host's numbers: they are newer). Without `wait`, only if the copy has
        already landed (on the CPU it has: the copy was synchronous; on a GPU at the step's end it
        usually has not, and the next step's report carries it)."""
        if self._pending is None:
            return
        rids, host, event, aggregate = self._pending
        if event is not None:
            if not wait and not event.query():
                return
            event.synchronize()  # recorded a step ago: complete in all but the first step
        self._pending = None
        for i, rid in enumerate(rids):
            if rid in report.importance:
                continue
            vals = host[i]
            seen = (~torch.isnan(vals)).nonzero()
            if not len(seen):
                continue
            report.importance[rid] = vals[: int(seen[-1]) + 1].tolist()  # trailing never-seen blocks: unsent
            report.importance_fold = aggregate


__all__ = ["ImportanceReadback"]
