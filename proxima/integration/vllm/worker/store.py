"""Worker side: the executor that writes compressed slots, and the per-request block map.

Storage (DESIGN.md "Block formats"): a destination physical block of format f holds
`f.pack_ratio` slots; slot s is bytes `[s * n / r, (s + 1) * n / r)` of the block's n bytes in
every layer, keys then values, each `[C, H, P]` of the format's element type. Metadata (scales,
zero points) lives in a per-layer, per-format side table indexed by `dst * r + s`, allocated
with `torch.empty` (pages are committed only where slots are written).

The executor is transactional per batch: if anything raises, none of the batch's actions enter
the block map and all are reported failed, so the scheduler keeps those blocks hot.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from typing import Literal

import torch

from proxima.compression.blocks import CompressedBlocks, compress_blocks
from proxima.compression.layer_stack import LayerSlots, LayerStack, SlotPool
from proxima.compression.layer_stack import upload as _upload
from proxima.compression.spec import SlotSpec, check_group_size
from proxima.formats import HOT, Format, recompressible
from proxima.integration.vllm.plan import CACHE_8BIT, NO_READER, ActionId, CompressAction, ProximaPlan, ProximaReport
from proxima.integration.vllm.worker import slot_reads, step_groups
from proxima.integration.vllm.worker.cache_dtype import compressible
from proxima.integration.vllm.worker.debug import SplitErrors, checks_values
from proxima.integration.vllm.worker.faults import FaultInjector
from proxima.integration.vllm.worker.layer_formats import LayerFormats, plain
from proxima.integration.vllm.worker.page_layout import PageLayout, probe_layout, token_interleaved_layout
from proxima.integration.vllm.worker.probe import ProbeBatch, RecentQueries, measure_written, record, split_measurable
from proxima.integration.vllm.worker.ranks import check_remap
from proxima.integration.vllm.worker.slot_reads import kernels_for
from proxima.integration.vllm.worker.step_counter import StepCounter
from proxima.integration.vllm.worker.timing import StepTimes
from proxima.integration.vllm.worker.token_importance import block_mass, fold_observation
from proxima.observation import observed_layer
from proxima.policy.schema import CompressionProbe, Policy, Storage

logger = logging.getLogger("proxima.vllm")

def _startup_policy() -> Policy | None:
    """The policy this process was started with (PROXIMA_POLICY)."""
    from proxima.integration.vllm import POLICY_ENV
    from proxima.policy.loader import load_policy

    path = os.environ.get(POLICY_ENV)
    return load_policy(path) if path else None


def _page_layout(kv: torch.Tensor) -> PageLayout:
    """The page order of a cache no `SlotReader` claimed (stores built by hand in tests): the
    reader's of this device (vLLM's CPU kernel's, probed; on CUDA TRITON_ATTN's)."""
    _, _, b, d2 = kv.shape
    if kv.device.type == "cpu":
        return probe_layout(b, d2 // 2, kv.dtype)
    return token_interleaved_layout(b, d2 // 2)


def layer_index(name: str, position: int) -> int:
    """vLLM names attention layers like `model.layers.12.self_attn.attn`; else the dict order."""
    m = re.search(r"\.(\d+)\.", name)
    return int(m[1]) if m else position


class SlotReader:
    """Marks an attention implementation that reads compressed blocks through the `WorkerStore`.

    The connector looks for it on every KV layer's implementation when the caches are registered
    (`WorkerStore.readers`): any other implementation would read the freed source blocks. The
    reader also says where its kernel keeps keys and values inside a page (`page_layout`): the
    worker compresses and observes importance in that order."""

    def page_layout(self, kv: torch.Tensor) -> PageLayout:
        """The order of keys and values inside a page of `kv` ([N, H, B, 2D]) for this kernel."""
        raise NotImplementedError

    def warm_up(self, store: WorkerStore) -> None:
        """Run once when the caches are registered, before the engine serves: compile what the
        first compression would otherwise compile in the middle of a step. Default: nothing."""


class WorkerStore:
    """Everything the worker knows about compressed blocks.

    Owned by the worker role of `ProximaConnector` (one per worker process, as vLLM creates one
    connector there); the attention backends reach it through `connector.worker_store()`."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        """This worker's tensor-parallel rank (its KV heads are the shard's; `ranks.py`)."""
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.stack = LayerStack({})
        """Every layer as one tensor and the slot pools of every stored format (`compression.layer_stack`)."""
        self.pools: dict[tuple[str, Format], LayerSlots] = {}
        self.remap: dict[str, dict[int, tuple[Format, int, int]]] = {}
        """request -> logical block index -> (format, destination block, slot)."""
        self.replaced: dict[str, dict[int, tuple[ActionId, tuple[Format, int, int]]]] = {}
        """request -> block index -> (this rank's last recompression of it, the `remap` entry it
        replaced, with its epoch, which plain format names cannot carry): what a revocation
        restores. One per recompressed block, until its next recompression or the request ends."""
        self.key_blocks: dict[int, str] = {}
        self.storage = Storage()
        """Quantization groups of the slots written (`group_for`): the start-up policy's, fixed."""
        self.report = ProximaReport()
        self.cpu_kernels: Literal["torch", "triton"] = "torch"
        """CPU compression kernels: the torch reference (serving) or Triton (interpreted: counts)."""
        self.faults = FaultInjector(rank=rank)
        """Tests and benchmarks: failures injected into compression batches (`faults`)."""
        self.dtypes: dict[Format, tuple[torch.dtype, torch.dtype]] = {}
        self.policy: Policy | None = None
        """The live policy (`ProximaPlan.policy`): its importance, probe and `layer_overrides`."""
        self.policy_version = 0
        """The version of `policy` (0: the startup policy, before any change was sent)."""
        self.formats = LayerFormats()
        """The format each layer stores, for every override table used so far (`layer_formats`)."""
        self.recent_queries = RecentQueries()
        """Each request's newest queries in the observed layer (the compression-time probe's)."""
        self.probing: list[ProbeBatch] = []
        """Blocks written and measured whose verdict is not read yet (`settle_probes`)."""
        self.settled: list[CompressAction] = []
        """Actions installed by a verdict read after their step (`settle_probes`): the device block
        table follows them at the next plan, as it follows a plan's own actions (`connector.py`)."""
        self.layer_numbers: dict[str, int] = {}
        self.layout: PageLayout | None = None
        """The attention kernel's order of keys and values inside a block's page (see cpu_layout)."""
        self.token_importance: dict[str, torch.Tensor] = {}
        """request -> float32 [tokens, H_kv]: EMA of the attention mass each token received."""
        self.ema_decay = 0.9
        self.aggregate = "max"
        self.observation_window = 32
        self.readers: set[str] = set()
        """Class names of the `SlotReader` attention implementations of this worker's KV layers
        (set by the connector): the only readers of compressed blocks. vLLM's own backends would
        read the freed sources."""
        self.require_reader = False
        """Set by the KV connector (a real vLLM worker): refuse to compress without a reader."""
        self.compressible = True  # the KV cache is 16-bit (`cache_dtype`): else Proxima stands aside
        self.one_pass_lean = True
        """The one-pass decode kernel is compiled with its lean reader (the connector turns it off
        when the start-up policy stores no lean format; then `readable_quants` excludes them)."""
        self.readable_quants: frozenset[str] | None = None
        """Quantizations every reader of this worker can read (None: any). Set by the connector
        with the one-pass decode, whose kernel reads fewer than the split path and replays from
        CUDA graphs that cannot fall back: a block is never written in a format it cannot read."""
        self.format_gate: Callable[[Format], str | None] | None = None
        """Why a block may not be stored in a format (as `formats.current` tags it), None if it may;
        the gate itself None: any. The connector sets it (`DeviceBlockTable.refusal`): the one-pass
        kernel reads a bounded number of format codes and, under CUDA graphs, cannot fall back."""
        self.split_errors = SplitErrors()
        """read-sources diagnostics (`debug.py`), CUDA backend."""
        self.times = StepTimes()
        """This worker's step split (`timing.py`; off unless `PROXIMA_TIME_SPLIT=1`)."""
        self.counter = StepCounter()
        """Kernels, copies and syncs of sampled compressing steps (`step_counter.py`)."""
        self.observe_layer: str | None = None
        """The layer whose attention is observed (the middle one: early layers attend broadly, late
        ones sharply; one layer keeps the cost at ~1/L of attention)."""

    @property
    def active(self) -> bool:
        """Proxima runs in this process (a policy was configured at startup, even `off`: the API
        may turn compression on later). Without it, attention is vLLM's, untouched."""
        return self.policy is not None

    # --- geometry ---------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor], policy: Policy | None = None) -> None:
        self.kv_caches = dict(kv_caches)
        self.stack = LayerStack(self.kv_caches)
        self.pools = {}
        names = list(kv_caches)
        self.observe_layer = names[observed_layer(len(names))] if names else None
        policy = policy if policy is not None else _startup_policy()
        self.compressible = compressible(kv_caches, policy)  # raises if `policy` cannot run on this cache
        if policy is not None:
            self.storage = policy.storage
            stored = sorted(policy.stored_formats(len(kv_caches)), key=lambda f: f.name)
            for kv in kv_caches.values():
                # A group that cannot hold the ladder's formats fails here, once, with its field named.
                for f in stored:
                    check_group_size(self.group_for(f), kv.shape[3] // 2, (f,), self.storage.field_for(f))
            self.formats = LayerFormats(policy)
            self.adopt(policy, self.policy_version)
            # One side arena for the policy's formats (a block's region: the largest's, `side_arena.py`).
            self.stack.reserve({f: self.slot_spec(f) for f in stored if kv_caches})
        self.layer_numbers = {name: layer_index(name, i) for i, name in enumerate(names)}
        self.layout = None
        if kv_caches and self.compressible:
            self.use_layout(_page_layout(next(iter(kv_caches.values()))))
        logger.info("proxima worker: %d KV layers, shapes %s, importance observed in %s", len(kv_caches),
                    {tuple(t.shape) for t in kv_caches.values()}, self.observe_layer)

    def adopt(self, policy: Policy, version: int) -> None:
        """The scheduler's live policy (sent with the plan when it changed), before the step's work.

        Blocks already compressed keep the layer formats they were written with (`LayerFormats`)."""
        imp = policy.importance
        self.ema_decay, self.aggregate = imp.ema_decay, imp.aggregate
        self.observation_window = imp.observation_window
        self.recent_queries.window = imp.observation_window
        self.formats.adopt(policy)
        self.policy, self.policy_version = policy, version

    def group_for(self, fmt: Format) -> int:
        """The quantization group of `fmt`'s slots (the start-up policy's `storage`)."""
        return self.storage.group_for(fmt)

    def geometry(self, layer: str) -> tuple[int, int, int, int]:
        """(num_blocks, H_kv, block_size, head_dim) of a layer's `[N, H, B, 2D]` tensor."""
        n, h, b, d2 = self.kv_caches[layer].shape
        return n, h, b, d2 // 2

    def slot_pool(self, fmt: Format) -> SlotPool:
        """Stored format `fmt`'s slots (after `layer_format`), every layer: byte views, typed on use."""
        return self.stack.pool(fmt, self.slot_spec(fmt))

    def slot_spec(self, fmt: Format) -> SlotSpec:
        """How `fmt` is stored in this worker's caches (every layer has the same geometry)."""
        _n, h, b, d = self.geometry(self.stack.names[0])
        return SlotSpec(fmt, b, d, h, self.group_for(fmt))

    def pool(self, layer: str, fmt: Format) -> LayerSlots:
        """Layer `layer`'s view of `fmt`'s slots (`fmt` as the layer stores it)."""
        key = (layer, fmt)
        if (p := self.pools.get(key)) is None:
            p = self.pools[key] = self.slot_pool(fmt).at(self.stack.index[layer])
        return p

    def layer_format(self, layer: str, fmt: Format) -> Format:
        """The format `layer` stores when the scheduler chose `fmt` (policy `layer_overrides`).

        `fmt` as the worker remembers the block (`remap`): a block written under an older override
        table is read with that table (`layer_formats.StoredFormat`).
        """
        return self.formats.of(fmt, self.layer_numbers.get(layer, -1))

    def stored_formats(self) -> dict[Format, tuple[Format, str]]:
        """Every format the policy can store (its bands' ladders, after each layer's overrides)
        -> (the scheduler's format that stores it, the first layer where it does): what a kernel
        warm-up must cover."""
        if self.policy is None or not self.policy.enabled:
            return {}
        out: dict[Format, tuple[Format, str]] = {}
        for layer in self.kv_caches:
            for f in self.policy.all_formats():
                out.setdefault(self.layer_format(layer, self.formats.current(f)), (f, layer))
        return out

    @property
    def probes_compressions(self) -> bool:
        """The live policy compresses and runs the compression-time probe: only then are the observed layer's
        recent queries kept (a copy per row and step). A policy that turns the probe on later
        defers each block until its request has been observed once (`worker_probe.check_batch`)."""
        return self.policy is not None and self.policy.enabled and self.policy.probes.compression.enabled

    def page_layout(self, kv: torch.Tensor) -> PageLayout:
        return self.layout if self.layout is not None else self.use_layout(_page_layout(kv))

    def use_layout(self, layout: PageLayout) -> PageLayout:
        """Adopt the reader's page order, its positions copied to the device now (not in a step)."""
        self.layout = layout
        if self.device is not None:
            layout.positions(self.device)
            _ = layout.is_canonical
        return layout

    # --- executor ---------------------------------------------------------------------------

    def apply(self, plan: ProximaPlan) -> None:
        """Adopt a changed policy, undo writes that failed on another rank, zero released
        destinations, drop freed requests, then run this step's compressions (before the forward
        pass, so before this step writes into a reused block)."""
        if plan.policy is not None:
            self.adopt(plan.policy, plan.policy_version)
        self.revoke(plan.revoked)
        if plan.scrub and self.kv_caches:
            ids = torch.tensor(plan.scrub, dtype=torch.long, device=next(iter(self.kv_caches.values())).device)
            for kv in self.kv_caches.values():
                kv.index_fill_(0, ids, 0)
        for rid in plan.dropped:
            self.remap.pop(rid, None)
            self.replaced.pop(rid, None)
            self.token_importance.pop(rid, None)
            self.recent_queries.drop(rid)
            for batch in self.probing:
                batch.gone.add(rid)
        self.settle_probes()
        if plan.check_remap is not None:
            check_remap(self.remap, plan.check_remap, self.rank)
        self.key_blocks = dict(plan.key_blocks)
        self.faults.refresh()  # once per step: a benchmark switches faults on and off between steps
        if plan.actions and ((self.require_reader and not self.readers) or not self.compressible):
            # e.g. CUDA with vLLM's default backend: compressing would make attention read freed
            # blocks. Every action fails, so every block stays hot and every request stays exact.
            self.report.failed.extend(a.action_id for a in plan.actions)
            self.report.errors.append(CACHE_8BIT if not self.compressible else NO_READER)
            return
        by_fmt: dict[tuple[Format, Format], list[CompressAction]] = {}
        for a in self._readable(plan.actions):
            by_fmt.setdefault((a.fmt, self._current_format(a)), []).append(a)
        tables = self._step_tables(by_fmt)
        for (fmt, from_fmt), acts in by_fmt.items():
            t0 = time.perf_counter()
            pending: ProbeBatch | None = None
            try:
                planned = acts
                acts, probing = self._probe_split(fmt, acts)
                if acts:
                    table = tables[(fmt, from_fmt)]
                    if len(acts) != len(planned):  # some not measurable yet: their rows leave the table
                        kept = {a.action_id for a in acts}
                        table = table[_upload([i for i, a in enumerate(planned) if a.action_id in kept], table.device)]
                    self._compress(fmt, from_fmt, acts, table)
                    if probing:  # measured as written (`probe.measure_written`), installed with the verdict
                        t1 = time.perf_counter()
                        self.report.kernel_seconds += t1 - t0
                        t0 = t1
                        pending = measure_written(self, fmt, from_fmt, acts, self._probe_cfg(), table)
                        self.report.probe_seconds += time.perf_counter() - t0
                        t0 = time.perf_counter()
            except Exception as e:  # a failure must never fail a request: keep the blocks hot
                self.report.kernel_seconds += time.perf_counter() - t0
                self.report.failed.extend(a.action_id for a in acts)
                self.report.errors.append(f"{type(e).__name__}: {e}")
                continue
            self.report.kernel_seconds += time.perf_counter() - t0
            if pending is not None:
                self.probing.append(pending)  # installed and reported with its verdict
            else:
                self._commit(fmt, from_fmt, acts)

    def _readable(self, actions: list[CompressAction]) -> list[CompressAction]:
        """The actions whose format the readers can read; the others fail (their blocks stay hot)."""
        ok = self.readable_quants
        if ok is None:
            return self._codable(actions)
        bad = sorted({str(a.fmt) for a in actions if a.fmt.quant not in ok})
        if bad:
            self.report.failed.extend(a.action_id for a in actions if a.fmt.quant not in ok)
            self.report.errors.append(f"{', '.join(bad)}: the one-pass decode reads {', '.join(sorted(ok))} codes "
                                      "(the lean int4h / int2h when the start-up policy stores one); set "
                                      "PROXIMA_ONE_PASS_DECODE=0 to store other formats")
        return self._codable([a for a in actions if a.fmt.quant in ok])

    def _codable(self, actions: list[CompressAction]) -> list[CompressAction]:
        """The actions `format_gate` lets through; the others fail (their blocks stay where they
        are) with the gate's reason in the report."""
        gate = self.format_gate
        if gate is None:
            return actions
        why = {f: gate(self.formats.current(f)) for f in {a.fmt for a in actions}}
        for f, reason in why.items():
            if reason is not None:
                self.report.failed.extend(a.action_id for a in actions if a.fmt == f)
                self.report.errors.append(f"{f}: {reason}")
        return [a for a in actions if why[a.fmt] is None]

    def _commit(self, fmt: Format, from_fmt: Format, acts: list[CompressAction], stored: Format | None = None) -> None:
        """Point the block map at the actions' written slots and report them written; `stored`:
        the format as tagged when the slots were written (a probed batch settles steps later)."""
        stored = self.formats.stored(fmt) if stored is None else stored
        for a in acts:
            blocks = self.remap.setdefault(a.req_id, {})
            old = blocks.get(a.index)
            if old is not None and not from_fmt.is_hot:
                self.replaced.setdefault(a.req_id, {})[a.index] = (a.action_id, old)
            blocks[a.index] = (stored, a.dst, a.slot)
        self.report.ok.extend(a.action_id for a in acts)

    def settle_probes(self) -> None:
        """Read the verdicts whose errors have arrived (`ProbeBatch.ready`: never waits): install
        and report the accepted blocks, report the refused ones (their slots are abandoned; the
        scheduler releases them). Called before a step's work and when its report is taken."""
        waiting = []
        for batch in self.probing:
            if not batch.ready():
                waiting.append(batch)
                continue
            out = batch.outcome()
            record(self.report, batch.fmt, out)
            self._commit(batch.fmt, batch.from_fmt, out.accepted, batch.stored)
            self.settled.extend(out.accepted)
        self.probing = waiting

    def revoke(self, actions: list[CompressAction]) -> None:
        """Point the block map back where it was for actions that failed (or were refused by the
        probe) on some rank (tensor parallelism: the scheduler kept the block where it was and
        released the slot). A rank that did not write an action has nothing to undo.

        Invariant relied on: a recompression this rank wrote is in `replaced` until the block's
        next one (the scheduler plans one action per block at a time, and revokes it before
        planning another), so the restored entry is the one it replaced, with its override epoch
        (a live `layer_overrides` change since that write must not change how the block is read)."""
        for a in actions:
            blocks = self.remap.get(a.req_id)
            hit = blocks.get(a.index) if blocks is not None else None
            if blocks is None or hit is None or (plain(hit[0]), hit[1], hit[2]) != (a.fmt, a.dst, a.slot):
                continue
            before = self.replaced.get(a.req_id, {}).pop(a.index, None)
            if a.from_fmt.is_hot:
                del blocks[a.index]
                continue
            # A recompression: the old slot was not touched (a new slot is always another one).
            if before is None or before[0] != a.action_id or before[1][1:] != (a.from_dst, a.from_slot):
                # The invariant is broken (a bug, not the request's fault): never fail the request
                # for it. Point the block where the scheduler keeps it (the action's source slot),
                # read with today's override table (the replaced entry's is lost), and say so.
                logger.error("proxima rank %d: request %s block %d holds the revoked recompression %d, but not "
                             "the entry it replaced (slot %d of block %d): %s; restored from the plan",
                             self.rank, a.req_id, a.index, a.action_id, a.from_slot, a.from_dst, before)
                self.report.revoke_mismatches += 1
                blocks[a.index] = (self.formats.stored(a.from_fmt), a.from_dst, a.from_slot)
                continue
            blocks[a.index] = before[1]

    def _current_format(self, a: CompressAction) -> Format:
        """The block's format now, as this worker stored it (a recompression reads it back)."""
        if a.from_fmt.is_hot:
            return HOT
        hit = self.remap.get(a.req_id, {}).get(a.index)
        return hit[0] if hit is not None else a.from_fmt

    def _probe_cfg(self) -> CompressionProbe:
        assert self.policy is not None
        return self.policy.probes.compression

    def _probe_split(self, fmt: Format, acts: list[CompressAction]) -> tuple[list[CompressAction], bool]:
        """The compression-time probe's first half (`worker/probe.py`): the actions to write now,
        and whether they are measured once written (else installed at once); blocks not
        measurable yet go into the report now."""
        if self.policy is None or not self.policy.probes.compression.enabled:
            return acts, False
        write, now = split_measurable(self, fmt, acts, self._probe_cfg())
        if now is None:
            return write, False
        record(self.report, fmt, now)
        return write, True

    def _step_tables(self, groups: dict[tuple[Format, Format], list[CompressAction]]
                     ) -> dict[tuple[Format, Format], torch.Tensor]:
        """Each group's action table, long [A, 3] on the device: the source page (hot blocks), the
        source slot row (`from_dst * r + from_slot`, recompressions) and the destination slot row
        (`dst * r + slot`) of every action, in the group's order. Built on the host and sent in one
        (pinned, non-blocking) copy for the whole step: no op of the step builds an index per layer."""
        rows: list[list[int]] = []
        for (fmt, from_fmt), acts in groups.items():
            r, r_from = fmt.pack_ratio, from_fmt.pack_ratio
            rows.extend([a.src, a.from_dst * r_from + a.from_slot, a.dst * r + a.slot] for a in acts)
        if not rows or self.device is None:
            return {}
        table = _upload(rows, self.device)
        out, at = {}, 0
        for key, acts in groups.items():
            out[key] = table[at:at + len(acts)]
            at += len(acts)
        return out

    def _layer_groups(self, from_fmt: Format, to_fmt: Format, layers: list[str] | None = None
                      ) -> dict[tuple[Format, Format], tuple[int, ...]]:
        """Stack rows of `layers` (default all) grouped by what they store: (source, target) after
        `layer_overrides`. Without overrides, one group of every layer."""
        out: dict[tuple[Format, Format], list[int]] = {}
        for name in layers if layers is not None else self.stack.names:
            key = (self.layer_format(name, from_fmt), self.layer_format(name, to_fmt))
            out.setdefault(key, []).append(self.stack.index[name])
        return {k: tuple(v) for k, v in out.items()}

    def written(self, layer: str, fmt_l: Format, table: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The slots the step table's rows wrote in `layer` (stored format `fmt_l`), read back:
        what the compression-time probe measures (`slot_reads.written`)."""
        return slot_reads.written(self, self.stack.index[layer], fmt_l, table)

    def compress_read(self, src_l: Format, dst_l: Format, k: torch.Tensor, v: torch.Tensor,
                      counts: torch.Tensor | None, acts: list[CompressAction]) -> CompressedBlocks:
        """Compress blocks as `slot_reads.read_rows` / `read_current` returned them (the actions' blocks in
        one or more layers, layer-major) from stored format `src_l` into `dst_l`: the one compress
        call of the executor and the probe."""
        b = self.stack.layers[0].shape[2]
        imp = None
        # A reduced block's rows are no longer token positions: uniform importance (None: the
        # counts alone weight the merge), as its per-token history cannot be mapped to them. Else
        # the same per-token importance in every layer.
        if dst_l.reduction is not None and counts is None:
            imp = _upload(self.importance_of(acts, b, k.shape[2]), k.device).repeat(k.shape[0] // len(acts), 1, 1)
        # Only centroids stand for several tokens (sparse rows are one token each): said here, so
        # compress_blocks need not read the counts back to find out (a sync on a GPU).
        merged = src_l.reduction == "cluster"
        prot = self.policy.protect if self.policy is not None else None
        return compress_blocks(dst_l, k, v, token_importance=imp, group_size=self.group_for(dst_l),
                               backend=kernels_for(k, self.cpu_kernels), log_count=counts if merged else None,
                               source_tokens=b,
                               check_values=checks_values(), rows_merged=merged if counts is not None else None,
                               pinned_tokens=prot.merged_tokens if prot is not None else 0,
                               pin_by=prot.merged_by if prot is not None else "mixed")

    def read_current(self, layer: str, from_fmt: Format, acts: list[CompressAction],
                     table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The actions' blocks in `layer` as they are now: k, v [N, T, H, D] (bf16 pages, or the
        current slots of a recompression) and, when those slots hold reduced (sparse or merged)
        tokens, their log-counts [N, T, H] (a merge weighs centroids by them); else None.
        `table`: the actions' rows of the step table, if the caller has them (else built here)."""
        if table is None:
            r_from = from_fmt.pack_ratio
            rows = [[a.src, a.from_dst * r_from + a.from_slot, -1] for a in acts]
            table = _upload(rows, self.kv_caches[layer].device)
        return slot_reads.read_rows(self, (self.stack.index[layer],), self.layer_format(layer, from_fmt), table,
                                    in_place=True)

    def _compress(self, fmt: Format, from_fmt: Format, acts: list[CompressAction], table: torch.Tensor) -> None:
        """Compress the actions' blocks in every layer, per (source, target) stored-format group of
        layers (one without `layer_overrides`): on the step kernels (`step_groups`, a few launches,
        written in place) or the batch path; `table`: the actions' rows of `_step_tables`."""
        self.faults.check()
        groups = self._layer_groups(from_fmt, self.formats.current(fmt))  # new blocks: the latest overrides
        # A recompression starts from the current slot (its loss is kept, not undone).
        if bad := [(s, d) for s, d in groups if not s.is_hot and not recompressible(s, d)]:
            raise ValueError(f"cannot recompress {bad[0][0]} into {bad[0][1]} (proxima.formats.recompressible)")
        staged: list[tuple[tuple[int, ...], SlotPool, CompressedBlocks]] = []
        for (src_l, dst_l), rows in groups.items():
            if step_groups.fused(self, src_l, dst_l):
                step_groups.compress_group(self, src_l, dst_l, rows, acts, table, _upload)
                continue
            k, v, counts = slot_reads.read_rows(self, rows, src_l, table)  # [R * A, T, H, D]
            staged.append((rows, self.slot_pool(dst_l), self.compress_read(src_l, dst_l, k, v, counts, acts)))
        # Batch writes after every group compressed (step kernels write slots no block points at yet).
        idx = table[:, 2]
        for rows, sp, cb in staged:
            self.dtypes[sp.spec.fmt] = (cb.k_data.dtype, cb.v_data.dtype)
            self.stack.write(sp, rows, idx, cb)

    @property
    def device(self) -> torch.device | None:
        return next(iter(self.kv_caches.values())).device if self.kv_caches else None

    def take_report(self) -> ProximaReport | None:
        self.settle_probes()  # the step's verdicts, if their errors arrived during the forward
        rep, self.report = self.report, ProximaReport()
        rep.timings = self.times.take()
        rep.step_counts = self.counter.take()
        return rep if any((rep.ok, rep.failed, rep.rejected, rep.importance, rep.timings, rep.drift,
                           rep.step_counts, rep.revoke_mismatches, rep.drift_seconds)) else None

    # --- importance -------------------------------------------------------------------------

    def observe(self, req_id: str, mass: torch.Tensor, *, reset: bool) -> None:
        """Fold one observation into a request's token importance (`token_importance.py`: mass
        [tokens, H_kv], NaN where unseen) and report its per-block mass to the scheduler."""
        new = fold_observation(self.token_importance.get(req_id), mass, reset=reset, decay=self.ema_decay)
        self.token_importance[req_id] = new
        b = next(iter(self.kv_caches.values())).shape[2]
        self.report.importance[req_id] = block_mass(new, (~torch.isnan(mass)).any(1), b, self.aggregate)
        self.report.importance_fold = self.aggregate  # how the ranks' reports merge (`merge_reports`)

    def importance_of(self, acts: list[CompressAction], b: int, h: int) -> torch.Tensor:
        """[N, B, H] token importance of the actions' blocks (1 where never observed)."""
        out = torch.ones(len(acts), b, h)
        for i, a in enumerate(acts):
            imp = self.token_importance.get(a.req_id)
            if imp is None:
                continue
            seg = imp[a.index * b: (a.index + 1) * b]
            out[i, : seg.shape[0]] = seg
        # Weights must stay positive for clustering; ties among unseen tokens break by position.
        return out.clamp_min(1e-6)

    # --- reader -----------------------------------------------------------------------------

    def read(self, layer: str, fmt: Format, dst: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decompress slots (dst, slot) of a layer: k_hat, v_hat [N, C, H, D] in the cache dtype."""
        kh, vh, _ = self.read_with_counts(layer, fmt, dst, slot)
        return kh, vh

    def read_with_counts(self, layer: str, fmt: Format, dst: torch.Tensor, slot: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like `read`, plus log(count) [N, C, H] of each token (cluster centroids; 0 otherwise).

        `fmt` is the format the scheduler chose; this layer's substitute (if any) is read."""
        fmt = self.layer_format(layer, fmt)
        idx = (dst * fmt.pack_ratio + slot).to(self.kv_caches[layer].device)
        return slot_reads.decompress_rows(self, (self.stack.index[layer],), fmt, idx)
