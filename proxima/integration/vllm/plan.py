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
    revoked: list[CompressAction] = field(default_factory=list)
    """Actions that failed on some rank since the last plan: a rank that wrote one points its block
    map back to where the block was (first, before anything else in this plan reuses the slot)."""
    check_remap: dict[str, dict[int, list[tuple[str, int, int]]]] | None = None
    """With PROXIMA_CHECK_ACCOUNTING=1: the slots the scheduler holds (`ranks.expected_remap`);
    every rank asserts its block map points nowhere else."""
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
    """Wall time of this step's compressions (all formats and layers; summed over merged ranks)."""
    importance: dict[str, list[float]] = field(default_factory=dict)
    """Request -> attention mass of each of its logical blocks (observed this step; blocks the
    worker could not observe, e.g. compressed ones, are NaN)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of this worker's step parts completed since the last report (`timing.py`; empty
    unless `PROXIMA_TIME_SPLIT=1`; the slowest rank's when merged)."""
    ranks: int = 1
    """Worker ranks merged into this report (tensor parallelism: `merge_reports`)."""

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
    drift: list[tuple[str, int, float, float]] = field(default_factory=list)
    """(request, output position, sampled-token log-prob, entropy) of the tagged requests' tokens
    sampled since the last report (`drift.DriftObserver`)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """vLLM merges the ranks' reports pairwise with this (tensor parallelism)."""
        if not isinstance(other, ProximaReport):
            raise TypeError(f"proxima: cannot merge a ProximaReport with a {type(other).__name__}")
        return merge_reports(self, other)


def merge_reports(a: ProximaReport, b: ProximaReport) -> ProximaReport:
    """One report for the ranks behind `a` and `b` (vLLM calls it pairwise, in rank order).

    An action is written only if every rank wrote it. A block the compression-time probe refused
    on any rank stays as it was everywhere (`rejected`: each rank measures its own heads); a rank
    that wrote it undoes it from the next plan (`ProximaPlan.revoked`, as for a failure)."""
    rejected_any = set(a.rejected) | set(b.rejected)
    failed = set(a.failed) | set(b.failed) | ((set(a.ok) ^ set(b.ok)) - rejected_any)
    rejected = {aid: f for aid, f in {**b.rejected, **a.rejected}.items() if aid not in failed}
    ok = (set(a.ok) & set(b.ok)) - failed - set(rejected)
    importance = dict(a.importance)
    for rid, imp in b.importance.items():
        mine = importance.get(rid)
        importance[rid] = imp if mine is None else _nanmax_lists(mine, imp)
    errors = a.errors + [e for e in b.errors if e not in a.errors]
    # The ranks run a step's parts in parallel: the slowest bounds the step.
    timings = {k: max(a.timings.get(k, 0.0), b.timings.get(k, 0.0)) for k in a.timings.keys() | b.timings.keys()}
    return ProximaReport(ok=sorted(ok), failed=sorted(failed), errors=errors,
                         kernel_seconds=a.kernel_seconds + b.kernel_seconds, importance=importance,
                         timings=timings, ranks=a.ranks + b.ranks, rejected=rejected,
                         probe_errors=a.probe_errors + b.probe_errors,
                         probe_measured=max(a.probe_measured, b.probe_measured),
                         probe_refused=max(a.probe_refused, b.probe_refused),
                         probe_seconds=max(a.probe_seconds, b.probe_seconds))


def settle(report: ProximaReport, ranks: int) -> ProximaReport:
    """`report` as the scheduler may commit it in an engine of `ranks` worker ranks."""
    if report.ranks > ranks:
        raise RuntimeError(f"proxima: a step's report merged {report.ranks} rank reports, but the engine has {ranks} "
                           "ranks (tensor_parallel_size): vLLM merged reports of different steps")
    if report.ranks == ranks or not report.ok:
        return report
    missing = (f"proxima: {ranks - report.ranks} of {ranks} ranks sent no report for a step with compressions; "
               "they are undone")
    return ProximaReport(ok=[], failed=sorted(set(report.failed) | set(report.ok)), errors=[*report.errors, missing],
                         kernel_seconds=report.kernel_seconds, importance=report.importance, timings=report.timings,
                         ranks=report.ranks, rejected=report.rejected, probe_errors=report.probe_errors,
                         probe_measured=report.probe_measured, probe_refused=report.probe_refused,
                         probe_seconds=report.probe_seconds)


def _nanmax_lists(a: list[float], b: list[float]) -> list[float]:
    """Element-wise larger mass, a NaN (not observed) losing to any number; the longer list's tail
    is kept (a rank may have observed a request one block further, e.g. across a step boundary)."""
    n = min(len(a), len(b))
    head = [y if math.isnan(x) else x if math.isnan(y) else max(x, y) for x, y in zip(a[:n], b[:n], strict=True)]
    return head + (a[n:] if len(a) > n else b[n:])
