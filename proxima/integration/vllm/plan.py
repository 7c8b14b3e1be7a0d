"""The messages between the scheduler-side and worker-side halves of Proxima (plain, picklable data).

They ride vLLM's KV-connector channel: `ProximaPlan` is the scheduler's per-step
`KVConnectorMetadata`; `ProximaReport` is the worker's `KVConnectorWorkerMetadata`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NewType

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from proxima.formats import HOT, Format
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
CACHE_8BIT = ("this engine's KV cache is vLLM's own 8-bit cache (kv_cache_dtype), which Proxima cannot "
              "compress: compression is off for this engine. Start vLLM without --kv-cache-dtype to let "
              "Proxima choose the formats.")
"""The worker's error when a compressing policy was adopted over an 8-bit KV cache
(`worker/cache_dtype.py`); the scheduler stops planning, as for `NO_READER`."""
DISABLING_ERRORS = (NO_READER, CACHE_8BIT)


SlotKey = tuple[Format, int, int]
"""(format, destination block, slot): where a compressed logical block lives."""


@dataclass(frozen=True)
class CompressAction:
    """Compress logical block `index` of `req_id` (now at physical `src`) into slot `slot` of `dst`."""

    action_id: ActionId
    req_id: str
    index: int
    src: BlockId
    dst: BlockId
    slot: SlotIndex
    fmt: Format
    """The target format. Formats cross the wire as `Format` values (frozen, pickled with the plan),
    parsed once where a string enters (the policy file, the API body), never again here."""
    from_fmt: Format = HOT
    """Recompression: the block's current format, read from (from_dst, from_slot); `src` unused."""
    from_dst: BlockId = NO_BLOCK
    from_slot: SlotIndex = NO_SLOT

    def __post_init__(self) -> None:
        # A spelling here would compare unequal to every `Format` downstream (silently: no block
        # would match), so the wire refuses it where it is built.
        if not isinstance(self.fmt, Format) or not isinstance(self.from_fmt, Format):
            raise TypeError(f"proxima: CompressAction formats are Format values, got {self.fmt!r} / {self.from_fmt!r}")


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
    check_remap: dict[str, dict[int, list[SlotKey]]] | None = None
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
    """Wall time of this step's compressions (all formats and layers). Merged: summed over the
    ranks, i.e. the compute all ranks spent (the wall time a step waits for is `timings`')."""
    importance: dict[str, list[float]] = field(default_factory=dict)
    """Request -> attention mass of each of its logical blocks (observed this step; blocks the
    worker could not observe, e.g. compressed ones, are NaN), folded over the rank's KV heads
    with `importance_fold`."""
    importance_fold: str = "max"
    """How `importance` folds KV heads (`observation.fold_heads`): the worker's
    `importance.aggregate`, "max" (the hottest head) or "mean". `merge_reports` merges by it."""
    importance_ranks: dict[str, list[int]] = field(default_factory=dict)
    """Fold "mean", in a merged report: request -> how many ranks observed each of its blocks (the
    weight of the block's mean in the next merge; 0 where `importance` is NaN). A request without
    an entry (a rank's own report): every block that is not NaN was observed by all `ranks`."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of this worker's step parts completed since the last report (`timing.py`; empty
    unless `PROXIMA_TIME_SPLIT=1`). Merged: the slowest rank's, per part (the ranks run a step's
    parts side by side, so the split stays a split of the step's wall time)."""
    step_counts: list[dict[str, int]] = field(default_factory=list)
    """Each step this worker measured since the last report (`worker/step_counter.py`; empty unless
    the step split or `PROXIMA_STEP_COUNTERS=1`): its device kernels (`launches`), host-device
    copies (`memcpys`) and host syncs (`syncs`). Merged: the busiest rank's, per step and count."""
    ranks: int = 1
    """Worker ranks merged into this report (tensor parallelism: `merge_reports`)."""

    rejected: dict[ActionId, Format] = field(default_factory=dict)
    """Actions the compression-time probe refused (the block is as it was) -> the milder format
    within the bound, `HOT` for none (the block stays hot), or the action's own format when the
    block could not be measured yet (planned again later). Merged: the mildest verdict of any rank."""
    probe_errors: list[tuple[Format, float]] = field(default_factory=list)
    """(format, relative attention-output error) of every probe measurement this step (merged:
    every rank's, each over its own heads)."""
    probe_measured_ids: list[ActionId] = field(default_factory=list)
    """Actions whose block the probe measured in its chosen format (the refusals' denominator)."""
    probe_refused_ids: list[ActionId] = field(default_factory=list)
    """Of those, the ones over the bound (a milder format, or none, was named for them)."""
    probe_seconds: float = 0.0
    """Wall time of this step's probe measurements (merged: summed, like `kernel_seconds`)."""
    drift: list[tuple[str, int, float, float]] = field(default_factory=list)
    """(request, output position, sampled-token log-prob, entropy) of the tagged requests' tokens
    sampled since the last report (`drift_observer.DriftObserver`; `merge_reports` keeps one rank's)."""
    drift_seconds: float = 0.0
    """Wall time of the drift observer's work since the last report (its cost; merged: summed)."""
    revoke_mismatches: int = 0
    """Revoked recompressions whose replaced entry this worker did not hold (`WorkerStore.revoke`:
    a broken invariant, logged; the block was pointed where the scheduler keeps it). Merged: summed."""

    @property
    def probe_measured(self) -> int:
        """Blocks the probe measured (the engine's: a block measured on N ranks is one block)."""
        return len(self.probe_measured_ids)

    @property
    def probe_refused(self) -> int:
        """Of those, blocks over the bound (a block refused on any rank is refused, once)."""
        return len(self.probe_refused_ids)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """vLLM merges the ranks' reports pairwise with this (tensor parallelism)."""
        if not isinstance(other, ProximaReport):
            raise TypeError(f"proxima: cannot merge a ProximaReport with a {type(other).__name__}")
        return merge_reports(self, other)


def merge_reports(a: ProximaReport, b: ProximaReport) -> ProximaReport:
    """One report for the ranks behind `a` and `b` (vLLM calls it pairwise, in rank order).

    What it decides does not depend on the fold's grouping or the rank order (only the order of
    the error lists does): every rule is a union, an intersection, a sum, a max or a min, or (the
    "mean" importance fold) a mean weighted by per-block rank counts, which is associative and
    commutative too, up to float rounding (`_merge_importance`).

    * An action is written only if every rank wrote it.
    * A block the compression-time probe refused on any rank stays as it was everywhere
      (`rejected`: each rank measures its own heads); a rank that wrote it undoes it from the next
      plan (`ProximaPlan.revoked`, as for a failure). The verdict kept is the mildest of the
      ranks' (`_mildest`): a compression is only as good as its worst rank.
    * Probe counts count the engine's blocks: a block measured on several ranks was measured
      once, a block refused on any rank was refused once (the union of the ranks' action ids;
      `probe_refused <= probe_measured` holds, as the fallback ladder's refused fraction needs).
    * Compute (`kernel_seconds`, `probe_seconds`) is summed over ranks; the step split
      (`timings`) is the slowest rank's per part, and so are the sampled step counts
      (`step_counts`: per step, each count's maximum over the ranks).
    * Drift samples are the first rank's that has any: they come from the sampled tokens' logits,
      which are the engine's, not a rank's (every rank that sees logits sees the same ones).
    * Importance is merged by the reports' `importance_fold` (`_merge_importance`): fold "max"
      keeps the larger value per block, fold "mean" the mean weighted by the ranks that observed
      the block; either way the engine's number over all KV heads. Ranks of one engine share one
      policy, so reports with importance folded differently raise a `ValueError` (a report
      without importance takes the other side's fold: it says nothing about heads).
    """
    rejected_any = set(a.rejected) | set(b.rejected)
    failed = set(a.failed) | set(b.failed) | ((set(a.ok) ^ set(b.ok)) - rejected_any)
    rejected = {aid: _mildest(a.rejected.get(aid), b.rejected.get(aid)) for aid in rejected_any - failed}
    ok = (set(a.ok) & set(b.ok)) - failed - set(rejected)
    fold, importance, importance_ranks = _merge_importance(a, b)
    errors = a.errors + [e for e in b.errors if e not in a.errors]
    # The ranks run a step's parts in parallel: the slowest bounds the step.
    timings = {k: max(a.timings.get(k, 0.0), b.timings.get(k, 0.0)) for k in a.timings.keys() | b.timings.keys()}
    return ProximaReport(ok=sorted(ok), failed=sorted(failed), errors=errors,
                         kernel_seconds=a.kernel_seconds + b.kernel_seconds, importance=importance,
                         importance_fold=fold, importance_ranks=importance_ranks, timings=timings,
                         ranks=a.ranks + b.ranks, rejected=rejected, step_counts=_merge_counts(a, b),
                         probe_errors=a.probe_errors + b.probe_errors,
                         probe_measured_ids=sorted(set(a.probe_measured_ids) | set(b.probe_measured_ids)),
                         probe_refused_ids=sorted(set(a.probe_refused_ids) | set(b.probe_refused_ids)),
                         probe_seconds=a.probe_seconds + b.probe_seconds, drift=a.drift or b.drift,
                         drift_seconds=a.drift_seconds + b.drift_seconds,
                         revoke_mismatches=a.revoke_mismatches + b.revoke_mismatches)


def _merge_importance(a: ProximaReport, b: ProximaReport) -> tuple[str, dict[str, list[float]], dict[str, list[int]]]:
    """(fold, importance, importance_ranks) of the merge of `a` and `b` (`merge_reports`).

    NaN (not observed) loses to any number, and the longer list's tail is kept (the other side did
    not observe those blocks).

    * "max": per block the larger value, i.e. the hottest KV head of all ranks.
    * "mean": per block the mean of the two sides' means, each weighted by the number of ranks
      that observed the block (a side's NaN weighs 0). Every rank of a vLLM engine holds the same
      number of KV heads (num_kv_heads / N, or with N > num_kv_heads one replicated head, every
      head replicated N / num_kv_heads times), so this is the mean over all the engine's KV heads:
      the number a single-rank engine computes. It is associative and commutative: a block's
      (weight, weight * mean) pairs add, so ((a + b) + c) and (a + (b + c)) give the same mean up
      to float rounding (a few ulp; exactly the same when the sums are exact). The weights must be
      per block: weighting a side by its `ranks` alone would count a rank that did not observe the
      block in later merges, and the result would depend on the grouping. They travel in
      `importance_ranks` (derived from `ranks` for a rank's own report).
    """
    if a.importance and b.importance and a.importance_fold != b.importance_fold:
        raise ValueError(f"proxima: cannot merge importance folded with {a.importance_fold!r} and with "
                         f"{b.importance_fold!r}: the ranks of one engine run one policy (importance.aggregate)")
    fold = a.importance_fold if a.importance or not b.importance else b.importance_fold
    if fold == "max":
        importance = dict(a.importance)
        for rid, imp in b.importance.items():
            mine = importance.get(rid)
            importance[rid] = imp if mine is None else _nanmax_lists(mine, imp)
        return fold, importance, {}
    if fold != "mean":
        raise ValueError(f"proxima: importance_fold is 'max' or 'mean', got {fold!r}")
    importance, weights = {}, {}
    for rid in [*a.importance, *(rid for rid in b.importance if rid not in a.importance)]:
        importance[rid], weights[rid] = _nanmean_lists(_observed(a, rid), _observed(b, rid))
    return fold, importance, weights


def _observed(rep: ProximaReport, rid: str) -> tuple[list[float], list[int]]:
    """A request's block importance in `rep` and the ranks that observed each block (fold "mean")."""
    imp = rep.importance.get(rid, [])
    weights = rep.importance_ranks.get(rid)
    if weights is None:
        weights = [rep.ranks] * len(imp)
    return imp, [0 if math.isnan(x) else w for x, w in zip(imp, weights, strict=True)]


def _nanmean_lists(a: tuple[list[float], list[int]], b: tuple[list[float], list[int]]) -> tuple[list[float], list[int]]:
    """Per block, the weighted mean of two (values, weights) lists and the summed weights; a block
    of weight 0 (NaN: not observed) on one side is the other side's, on both sides NaN."""
    (xs, wx), (ys, wy) = a, b
    out, weights = [], []
    for i in range(max(len(xs), len(ys))):
        x, n = (xs[i], wx[i]) if i < len(xs) else (math.nan, 0)
        y, m = (ys[i], wy[i]) if i < len(ys) else (math.nan, 0)
        if m == 0 or n == 0:
            out.append(x if m == 0 else y)  # (both 0: NaN, or a side's NaN as it was)
        else:
            out.append((x * n + y * m) / (n + m))
        weights.append(n + m)
    return out, weights


def _merge_counts(a: ProximaReport, b: ProximaReport) -> list[dict[str, int]]:
    """The ranks sample the same steps (they see the same plans): per step, each count of the
    busiest rank, as the step waits for it (a rank that measured more steps adds its extra ones)."""
    longer, shorter = (a.step_counts, b.step_counts) if len(a.step_counts) >= len(b.step_counts) \
        else (b.step_counts, a.step_counts)
    merged = [{k: max(x.get(k, 0), y.get(k, 0)) for k in x.keys() | y.keys()}
              for x, y in zip(longer, shorter, strict=False)]
    return merged + [dict(x) for x in longer[len(shorter):]]


def _mildest(a: Format | None, b: Format | None) -> Format:
    """The milder of two ranks' verdicts on one refused action (None: that rank wrote it, or has
    no verdict): the format that keeps more, i.e. the lower pack ratio, `HOT` (stays hot) mildest.

    A rank's verdict is the harshest format within the bound on its heads (or the action's own
    format when it could not measure yet, which any measured verdict is milder than), so every
    harsher one failed on some rank: the milder of two is the harshest format still possible on
    all of them. It is a cap, not a write: the scheduler plans the block into it later, and every
    rank measures it again then. Equal pack ratios (e.g. int4 and sparse(4)) are the same
    cap for the scheduler, which compares caps by pack ratio; the name breaks the tie so that the
    merge does not depend on the rank order."""
    verdicts = [v for v in (a, b) if v is not None]
    return min(verdicts, key=lambda v: (v.pack_ratio, v.name))


def settle(report: ProximaReport, ranks: int) -> ProximaReport:
    """`report` as the scheduler may commit it in an engine of `ranks` worker ranks."""
    if report.ranks > ranks:
        raise RuntimeError(f"proxima: a step's report merged {report.ranks} rank reports, but the engine has {ranks} "
                           "ranks (tensor_parallel_size): vLLM merged reports of different steps")
    if report.ranks == ranks or not report.ok:
        return report
    missing = (f"proxima: {ranks - report.ranks} of {ranks} ranks sent no report for a step with compressions; "
               "they are undone")
    # (`replace`: every other field, including ones added later, passes through as it is)
    return replace(report, ok=[], failed=sorted(set(report.failed) | set(report.ok)), errors=[*report.errors, missing])


def _nanmax_lists(a: list[float], b: list[float]) -> list[float]:
    """Element-wise larger mass, a NaN (not observed) losing to any number; the longer list's tail
    is kept (a rank may have observed a request one block further, e.g. across a step boundary)."""
    n = min(len(a), len(b))
    head = [y if math.isnan(x) else x if math.isnan(y) else max(x, y) for x, y in zip(a[:n], b[:n], strict=True)]
    return head + (a[n:] if len(a) > n else b[n:])
