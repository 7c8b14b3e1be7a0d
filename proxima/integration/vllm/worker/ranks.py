"""Tensor parallelism: one plan for every rank, one report from all of them.

With `tensor_parallel_size` N, vLLM runs one scheduler (and one Proxima KV manager) and N worker
processes; each worker holds the KV heads of its shard in blocks with the same ids. vLLM sends
the scheduler's `ProximaPlan` to every rank unchanged, and merges the ranks' `ProximaReport`s
pairwise through `KVConnectorWorkerMetadata.aggregate` (vLLM's `KVOutputAggregator`, in the
executor) before the scheduler sees one. The merge itself lives with the report (`plan.merge_reports`,
`plan.settle`); this module holds the rest:

* `merge_reports` (in `plan.py`): the pairwise merge. An action is written only if every rank wrote it (`ok` is
  the intersection, anything one rank failed or did not confirm is failed), so the two-phase
  commit stays all-or-nothing; a block the compression-time probe refused on any rank is refused,
  with the mildest of the ranks' verdicts; probe counts are distinct blocks (the union of the
  ranks' action ids); block importance is the larger mass (each rank saw only its heads, and one
  rank's value is already the max over its heads); kernel and probe time are summed, the step
  split is the slowest rank's; identical errors (the same fault on every rank) are kept once.
* `settle` (in `plan.py`): the scheduler's last word on a merged report. vLLM drops a rank's output from the
  merge when it carries no report, so a report that merged fewer ranks than the engine has cannot
  prove that the missing ranks wrote anything: its writes are failed too.
* `expected_remap` (in `scheduler/ledger.py`) / `check_remap`: with `PROXIMA_CHECK_ACCOUNTING=1` each plan
  carries the slots the scheduler holds per request (committed, or in flight), and every rank asserts that its
  block map holds nothing else. A rank whose write was undone elsewhere must have dropped it
  (`WorkerStore.revoke`), or it would read a slot the scheduler has released.
"""

from __future__ import annotations

from collections.abc import Mapping

from proxima.formats import Format
from proxima.integration.vllm.plan import SlotKey
from proxima.integration.vllm.worker.layer_formats import plain


def check_remap(remap: Mapping[str, Mapping[int, tuple[Format, int, int]]],
                expected: Mapping[str, Mapping[int, list[SlotKey]]], rank: int) -> None:
    """Raise if this rank's block map points anywhere the scheduler does not hold a slot."""
    for rid, blocks in remap.items():
        for index, (fmt, dst, slot) in blocks.items():
            allowed = expected.get(rid, {}).get(index, [])
            # (the block map's entry may carry its override epoch: `layer_formats.StoredFormat`)
            if (plain(fmt), dst, slot) not in allowed:
                raise AssertionError(
                    f"proxima rank {rank}: request {rid} block {index} reads {fmt.name} slot {slot} of block {dst}, "
                    f"but the scheduler holds {allowed or 'no compressed slot'} for it (a write undone on another "
                    "rank was not revoked here)")


__all__ = ["check_remap"]
