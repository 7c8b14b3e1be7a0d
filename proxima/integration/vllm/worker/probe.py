"""The compression-time probe, in the worker: measure a block's attention error before it commits.

When a batch of compressions has been written, each block is measured in the observed layer
(`WorkerStore.observe_layer`, the one whose queries the importance observation already reads):
the attention output of the request's most recent queries over the block as written (its
destination slot, read back as stored) is compared with their output over the block as it is
until the commit (`compression.attention_errors_dense`: sources are freed only after the commit). A
block whose error is over the policy's bound (`probes.compression.max_error`) is not installed:
the report names the next milder format of the policy's ladders (the scheduler plans the block
into it at a later step, since a milder format needs another destination, and it is measured
then, as any block is) or, with none left, says the block stays hot.

Only the chosen format is measured (2026-12-07): measuring each milder candidate in the same pass
(so that a refusal could name the first one within the bound at once) cost up to 3 more
compressions and error passes per block for a block planned straight into a deep format
(aggressive's hot -> cluster(8)+int4: 4 k-means per block in the observed layer), for refusals
that are rare (0 of 593 blocks on the CPU capacity workload). A refused block now walks the ladder
one rung per verdict; it ends where it did before, later.

No value is read back in the step (issue 37): the chosen format's errors are measured in one
pass and copied to pinned host memory behind a CUDA event (`ProbeBatch`); the
blocks are written meanwhile, but installed in the block map, and reported, only when the
verdict is read (`WorkerStore.settle_probes`: at the end of the step if the copy has arrived,
else at the next). Until then attention reads the source, which the scheduler keeps until the
report, so a refused block simply stays where it was.

One layer of L is measured (its sources and written slots, read in place by the step kernels'
dequantize where they cover the format, and a softmax over W queries by one block). Blocks of a
request with no recent query (not observed yet) are not written this step: they are reported
refused in their own format (the scheduler plans them again, by when their request's queries
have been seen), so no block is written unmeasured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from proxima.compression.attention import attention_errors_dense
from proxima.formats import HOT, Format, recompressible
from proxima.integration.vllm.plan import ActionId, CompressAction, ProximaReport
from proxima.policy.probes import choose_within_bound
from proxima.policy.refusal import milder_formats  # shared with the transformers cache
from proxima.policy.schema import CompressionProbe, Policy

if TYPE_CHECKING:
    from proxima.integration.vllm.worker.layer_formats import LayerFormats


class ProbedStore(Protocol):
    """What the probe reads of the worker's store (`worker.WorkerStore`, which imports this
    module: a Protocol instead of that import keeps the two free of an import cycle)."""

    kv_caches: dict[str, torch.Tensor]
    observe_layer: str | None
    recent_queries: RecentQueries
    formats: LayerFormats
    policy: Policy | None
    cpu_kernels: Literal["torch", "triton"]
    """On CPU, the torch reference or the (interpreted) Triton kernels; a GPU runs Triton."""

    def read_current(self, layer: str, from_fmt: Format, acts: list[CompressAction],
                     table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...

    def layer_format(self, layer: str, fmt: Format) -> Format: ...

    def written(self, layer: str, fmt_l: Format, table: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class RecentQueries:
    """Each request's last `window` queries in the observed layer (copies: vLLM reuses its buffers)."""

    def __init__(self, window: int = 32) -> None:
        self.window = window
        self.scale: float | None = None
        """The observed layer's softmax scale (from the attention implementation)."""
        self._q: dict[str, torch.Tensor] = {}

    def add(self, req_id: str, q: torch.Tensor, scale: float) -> None:
        """q: [n, Hq, D], the request's newest queries (oldest first)."""
        self.scale = scale
        old = self._q.get(req_id)
        if old is not None and old.shape[1:] == q.shape[1:]:
            q = torch.cat([old, q.detach()])
        self._q[req_id] = q[-self.window:].detach().clone()

    def get(self, req_id: str) -> torch.Tensor | None:
        return self._q.get(req_id)

    def drop(self, req_id: str) -> None:
        self._q.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._q)


@dataclass
class ProbeOutcome:
    """What the probe decided for one batch (one target format)."""

    accepted: list[CompressAction] = field(default_factory=list)
    rejected: dict[ActionId, Format] = field(default_factory=dict)
    """Refused actions -> the next milder format (`HOT` = none left: the block stays hot)."""
    errors: list[tuple[Format, float]] = field(default_factory=list)
    """(format, relative attention error) of every measurement: each block in its chosen format."""
    measured: int = 0
    """Blocks measured in their chosen format."""
    refused: int = 0
    """Of those, over the bound (a milder format, or none, was named for them)."""


@dataclass
class ProbeBatch:
    """One group's blocks measured on the device, their verdict not read yet.

    The errors of every measured block in its chosen format are measured in one pass and copied
    to pinned host memory behind a CUDA event: nothing waits for them in the step. The blocks are
    written (their slots are theirs until the report), but the block map points at them only once
    the verdict is read (`outcome`, when `ready`): until then attention reads each block's source,
    which the two-phase commit keeps until the report."""

    fmt: Format
    from_fmt: Format
    acts: list[CompressAction]
    milder: list[Format]
    """The milder formats a refusal may name, mildest last: a refused block is named the first."""
    errors: torch.Tensor
    """float32 [len(acts)], on the host (pinned on a GPU)."""
    cfg: CompressionProbe
    event: torch.cuda.Event | None = None
    stored: Format | None = None
    """`fmt` as the worker tagged the written slots (`LayerFormats.current` then): a policy change
    before the verdict must not change how they are read."""
    gone: set[str] = field(default_factory=set)
    """Requests dropped since: their blocks are neither reported nor installed."""

    def ready(self) -> bool:
        """Whether the errors have arrived on the host (`event.query()` does not wait)."""
        return self.event is None or bool(self.event.query())

    def outcome(self) -> ProbeOutcome:
        """The verdicts (`choose_within_bound` over the chosen format's errors). Reads host memory only."""
        errors: list[float] = [float(e) for e in self.errors.tolist()]
        out = ProbeOutcome()
        for i, a in enumerate(self.acts):
            if a.req_id in self.gone:
                continue
            out.measured += 1
            out.errors.append((self.fmt, errors[i]))

            def measure(_f: Format, i: int = i) -> float:
                return errors[i]

            if choose_within_bound([self.fmt], measure, self.cfg).chosen == self.fmt:
                out.accepted.append(a)
            else:
                out.rejected[a.action_id] = self.milder[0] if self.milder else HOT
                out.refused += 1
        return out


def split_measurable(store: ProbedStore, fmt: Format, acts: Sequence[CompressAction], cfg: CompressionProbe
                     ) -> tuple[list[CompressAction], ProbeOutcome | None]:
    """Before a group is written: the actions to write now, and the verdicts known already (None:
    the probe is off or has no observed layer, so every written block is accepted at once).
    Blocks of a request with no recent query are not measurable yet: they are reported refused in
    their own format (planned again at a later step), so no block is written unmeasured."""
    if not cfg.enabled or store.observe_layer is None:
        return list(acts), None
    queries = store.recent_queries
    if queries.scale is None:
        return [], ProbeOutcome(rejected={a.action_id: fmt for a in acts})
    write = [a for a in acts if queries.get(a.req_id) is not None]
    return write, ProbeOutcome(rejected={a.action_id: fmt for a in acts if queries.get(a.req_id) is None})


def measure_written(store: ProbedStore, fmt: Format, from_fmt: Format, acts: Sequence[CompressAction],
                    cfg: CompressionProbe, table: torch.Tensor) -> ProbeBatch:
    """After a group is written: each block's attention error in the observed layer, the block
    as the step wrote it (its destination slot, read back as stored) against the block as it is
    until the commit (its source, which the scheduler keeps until the report), without reading
    anything back to the host. `acts`: the written actions, every one measurable
    (`split_measurable`); `table`: their rows of the step's action table (`WorkerStore._step_tables`).

    Measuring the written slot, not a second compression of the observed layer (until
    2026-12-08): the probe checks what attention will read, whichever kernel wrote it (the step
    kernels, the fused write-once path, the batch path), and skips the second compression's
    kernels and its importance upload."""
    layer = store.observe_layer
    queries = store.recent_queries
    assert layer is not None and queries.scale is not None, "split_measurable lets no block through then"
    kv = store.kv_caches[layer]
    k, v, counts = store.read_current(layer, from_fmt, list(acts), table)  # [N, T, H, D], log-counts or None
    qs = [q for a in acts if (q := queries.get(a.req_id)) is not None]
    if len(qs) != len(acts):
        raise RuntimeError(f"proxima: {len(acts) - len(qs)} written blocks have no recent queries to measure with")
    w = max(len(q) for q in qs)
    valid: torch.Tensor | None = None
    if all(len(q) == w for q in qs) and all(q.device == kv.device for q in qs):
        # Every window full (the steady state): one stack, no padding to mask.
        q_obs = torch.stack(qs).float()
    else:
        q_obs = torch.zeros(len(qs), w, *qs[0].shape[1:], dtype=torch.float32, device=kv.device)
        valid = torch.zeros(len(qs), w, dtype=torch.bool, device=kv.device)  # filled in place: no host copy
        for i, q in enumerate(qs):
            q_obs[i, : len(q)] = q.to(q_obs.device, torch.float32)
            valid[i, : len(q)].fill_(True)  # a fill, not a host scalar tensor copied in
    src_l = store.layer_format(layer, from_fmt)
    milder = milder_formats(store.policy, fmt, from_fmt)
    if not from_fmt.is_hot:  # a recompression: only formats this block can still move into
        milder = [f for f in milder if recompressible(src_l, store.layer_format(layer, store.formats.current(f)))]
    stored = store.formats.current(fmt)
    kh, vh, lc = store.written(layer, store.layer_format(layer, stored), table)
    dev = attention_errors_dense(q_obs, k, v, kh, vh, lc, q_valid=valid, sm_scale=queries.scale,
                                 ref_log_count=counts, on_host=False,
                                 backend="auto" if k.is_cuda else store.cpu_kernels).float()
    event = None
    if dev.is_cuda:
        host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
        host.copy_(dev, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        dev = host
    return ProbeBatch(fmt, from_fmt, list(acts), milder, dev, cfg, event, stored=stored)


def record(report: ProximaReport, fmt: Format, out: ProbeOutcome) -> None:
    """A probe outcome of target `fmt` into the worker's report: refusals, measurements, counts."""
    # The report counts blocks by action id, so that the ranks' counts merge into the engine's
    # (`merge_reports`). Measured = accepted + refused, unless nothing was measured (no observed
    # layer: all accepted); a verdict in the action's own format is a deferral, not a refusal
    # (every milder format has a lower pack ratio than `fmt`).
    refused = [aid for aid, verdict in out.rejected.items() if verdict != fmt]
    measured = [a.action_id for a in out.accepted] + refused if out.measured else []
    if (len(measured), len(refused)) != (out.measured, out.refused):
        raise RuntimeError(f"proxima: the probe counted {out.measured} measured / {out.refused} refused blocks, "
                           f"its verdicts {len(measured)} / {len(refused)}")
    report.rejected.update(out.rejected)
    report.probe_errors.extend(out.errors)
    report.probe_measured_ids.extend(measured)
    report.probe_refused_ids.extend(refused)


__all__ = ["ProbeBatch", "ProbeOutcome", "RecentQueries", "measure_written", "milder_formats", "record",
           "split_measurable"]
