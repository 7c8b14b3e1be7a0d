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
from dataclasses import dataclass, field
from typing import Literal

import torch

from proxima.compression.blocks import CompressedBlocks, compress_blocks, decompress_blocks, recompressible
from proxima.compression.spec import DEFAULT_GROUP_SIZE, SlotSpec
from proxima.formats import HOT, Format
from proxima.integration.vllm.cpu_layout import PageLayout, probe_layout, token_interleaved_layout
from proxima.integration.vllm.debug import SplitErrors
from proxima.integration.vllm.faults import FaultInjector
from proxima.integration.vllm.plan import NO_READER, CompressAction, ProximaPlan, ProximaReport
from proxima.integration.vllm.ranks import check_remap
from proxima.integration.vllm.timing import StepTimes
from proxima.policy.schema import Policy

logger = logging.getLogger("proxima.vllm")

_META_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def _startup_policy() -> Policy | None:
    """The policy this process was started with (PROXIMA_POLICY)."""
    from proxima.integration.vllm import POLICY_ENV
    from proxima.policy.loader import load_policy

    path = os.environ.get(POLICY_ENV)
    return load_policy(path) if path else None


def _page_layout(kv: torch.Tensor) -> PageLayout:
    """The page order of a cache no `SlotReader` claimed (stores built by hand in tests): that of
    the reader this device would have (vLLM's CPU kernel's, probed; on CUDA TRITON_ATTN's)."""
    _, _, b, d2 = kv.shape
    if kv.device.type == "cpu":
        return probe_layout(b, d2 // 2, kv.dtype)
    return token_interleaved_layout(b, d2 // 2)


def layer_index(name: str, position: int) -> int:
    """vLLM names attention layers like `model.layers.12.self_attn.attn`; else the dict order."""
    m = re.search(r"\.(\d+)\.", name)
    return int(m[1]) if m else position


def _kernels(t: torch.Tensor) -> Literal["torch", "auto"]:
    """Proxima's Triton kernels on a GPU; on CPU the torch reference (Triton there is the interpreter)."""
    return "auto" if t.is_cuda else "torch"


@dataclass
class _LayerPool:
    """One layer's view of the KV tensor as compressed slots of one format, plus its side table."""

    spec: SlotSpec
    k: torch.Tensor  # [num_blocks * r, C, H, P] view into vLLM's KV tensor
    v: torch.Tensor
    meta: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [num_blocks * r, ...]


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
        self.pools: dict[tuple[str, Format], _LayerPool] = {}
        self.remap: dict[str, dict[int, tuple[Format, int, int]]] = {}
        """request -> logical block index -> (format, destination block, slot)."""
        self.sources: dict[str, dict[int, int]] = {}
        """request -> logical block index -> source physical block (diagnostics only: freed)."""
        self.key_blocks: dict[int, str] = {}
        self.group_size = DEFAULT_GROUP_SIZE
        self.report = ProximaReport()
        self.meta_bytes = 0
        self.faults = FaultInjector(rank=rank)
        """Tests and benchmarks: failures injected into compression batches (`faults`)."""
        self.dtypes: dict[Format, tuple[torch.dtype, torch.dtype]] = {}
        self.policy: Policy | None = None
        """Its `layer_overrides` decide the format each layer stores (same pack ratio, same slot)."""
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
        self.split_errors = SplitErrors()
        """read-sources diagnostics (`debug.py`), CUDA backend."""
        self.times = StepTimes()
        """This worker's step split (`timing.py`; off unless `PROXIMA_TIME_SPLIT=1`)."""
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
        names = list(kv_caches)
        self.observe_layer = names[len(names) // 2] if names else None
        policy = policy if policy is not None else _startup_policy()
        if policy is not None:
            imp = policy.importance
            self.ema_decay, self.aggregate = imp.ema_decay, imp.aggregate
            self.observation_window = imp.observation_window
            self.policy = policy
        self.layer_numbers = {name: layer_index(name, i) for i, name in enumerate(names)}
        self.layout = _page_layout(next(iter(kv_caches.values()))) if kv_caches else None
        shapes = {tuple(t.shape) for t in kv_caches.values()}
        logger.info("proxima worker: %d KV layers, shapes %s, importance observed in %s",
                    len(kv_caches), shapes, self.observe_layer)

    def geometry(self, layer: str) -> tuple[int, int, int, int]:
        """(num_blocks, H_kv, block_size, head_dim) of a layer's `[N, H, B, 2D]` tensor."""
        n, h, b, d2 = self.kv_caches[layer].shape
        return n, h, b, d2 // 2

    def pool(self, layer: str, fmt: Format) -> _LayerPool:
        key = (layer, fmt)
        p = self.pools.get(key)
        if p is not None:
            return p
        kv = self.kv_caches[layer]
        n, h, b, d = self.geometry(layer)
        spec = SlotSpec(fmt, b, d, h, self.group_size)
        r, c = fmt.pack_ratio, spec.slot_tokens
        # Byte views; the element types (which may differ for keys and values) are applied on
        # read and write, from what `compress_blocks` produced.
        raw = kv.view(torch.uint8).view(n * r, 2, c, h, -1)
        meta = {}
        for f in spec.meta_fields():
            # MetaField shapes exclude the slot and head axes; CompressedBlocks puts heads second.
            shape = (n * r, f.shape[0], h, *f.shape[1:])
            meta[f.name] = torch.empty(shape, dtype=_META_DTYPES[f.dtype], device=kv.device)
            self.meta_bytes += meta[f.name].numel() * meta[f.name].element_size()
        p = _LayerPool(spec, raw[:, 0], raw[:, 1], meta)
        self.pools[key] = p
        return p

    def layer_format(self, layer: str, fmt: Format) -> Format:
        """The format `layer` stores when the scheduler chose `fmt` (policy `layer_overrides`).

        A substitution that changes the number of stored tokens between a sparse format and any
        other would change the scratch layout per layer; the vLLM path keeps the chosen format.
        """
        if self.policy is None or fmt.is_hot:
            return fmt
        sub = self.policy.layer_format(fmt, self.layer_numbers.get(layer, -1))
        if (sub.reduction == "sparse") != (fmt.reduction == "sparse"):
            return fmt
        return sub

    def stored_formats(self) -> dict[Format, str]:
        """Every format the startup policy can store (its bands' ladders, after each layer's
        overrides), with the first layer that stores it: what a kernel warm-up must cover."""
        if self.policy is None or not self.policy.enabled:
            return {}
        out: dict[Format, str] = {}
        for layer in self.kv_caches:
            for f in self.policy.all_formats():
                out.setdefault(self.layer_format(layer, f), layer)
        return out

    def page_layout(self, kv: torch.Tensor) -> PageLayout:
        if self.layout is None:
            self.layout = _page_layout(kv)
        return self.layout

    # --- executor ---------------------------------------------------------------------------

    def apply(self, plan: ProximaPlan) -> None:
        """Undo writes that failed on another rank, zero released destinations, drop freed requests,
        then run this step's compressions (before the forward pass, so before this step writes
        into a reused block)."""
        self.revoke(plan.revoked)
        if plan.scrub and self.kv_caches:
            ids = torch.tensor(plan.scrub, dtype=torch.long, device=next(iter(self.kv_caches.values())).device)
            for kv in self.kv_caches.values():
                kv.index_fill_(0, ids, 0)
        for rid in plan.dropped:
            self.remap.pop(rid, None)
            self.sources.pop(rid, None)
            self.token_importance.pop(rid, None)
        if plan.check_remap is not None:
            check_remap(self.remap, plan.check_remap, self.rank)
        self.key_blocks = dict(plan.key_blocks)
        self.faults.refresh()  # once per step: a benchmark switches faults on and off between steps
        if plan.actions and self.require_reader and not self.readers:
            # e.g. CUDA with vLLM's default backend: compressing would make attention read freed
            # blocks. Every action fails, so every block stays hot and every request stays exact.
            self.report.failed.extend(a.action_id for a in plan.actions)
            self.report.errors.append(NO_READER)
            return
        by_fmt: dict[tuple[str, str], list[CompressAction]] = {}
        for a in plan.actions:
            by_fmt.setdefault((a.fmt, a.from_fmt), []).append(a)
        for (name, from_name), acts in by_fmt.items():
            t0 = time.perf_counter()
            try:
                self._compress(Format.parse(name), Format.parse(from_name), acts)
            except Exception as e:  # a failure must never fail a request: keep the blocks hot
                self.report.kernel_seconds += time.perf_counter() - t0
                self.report.failed.extend(a.action_id for a in acts)
                self.report.errors.append(f"{type(e).__name__}: {e}")
                continue
            for a in acts:
                self.remap.setdefault(a.req_id, {})[a.index] = (Format.parse(a.fmt), a.dst, a.slot)
                self.sources.setdefault(a.req_id, {})[a.index] = a.src
            self.report.kernel_seconds += time.perf_counter() - t0
            self.report.ok.extend(a.action_id for a in acts)

    def revoke(self, actions: list[CompressAction]) -> None:
        """Point the block map back where it was for actions that failed on some rank (tensor
        parallelism: the scheduler kept the block where it was and released the slot). A rank that
        did not write an action (it failed here too) has nothing to undo."""
        for a in actions:
            blocks = self.remap.get(a.req_id)
            if blocks is None or blocks.get(a.index) != (Format.parse(a.fmt), a.dst, a.slot):
                continue
            if a.from_fmt == HOT.name:
                del blocks[a.index]
                self.sources.get(a.req_id, {}).pop(a.index, None)
            else:  # a recompression: the old slot was not touched (a new slot is always another one)
                blocks[a.index] = (Format.parse(a.from_fmt), a.from_dst, a.from_slot)

    def _compress(self, fmt: Format, from_fmt: Format, acts: list[CompressAction]) -> None:
        self.faults.check()
        dev = next(iter(self.kv_caches.values())).device
        src = torch.tensor([a.src for a in acts], dtype=torch.long, device=dev)
        r = fmt.pack_ratio
        slots = torch.tensor([a.dst * r + a.slot for a in acts], dtype=torch.long, device=dev)
        staged: list[tuple[_LayerPool, CompressedBlocks]] = []
        from_dst = torch.tensor([a.from_dst for a in acts], dtype=torch.long, device=dev)
        from_slot = torch.tensor([a.from_slot for a in acts], dtype=torch.long, device=dev)
        for layer, kv in self.kv_caches.items():
            _n, h, b, _d = self.geometry(layer)
            fmt_l = self.layer_format(layer, fmt)
            counts = None
            if from_fmt.is_hot:
                k, v = self.page_layout(kv).read_blocks(kv, src)  # [N, B, H, D]
                k, v = k.contiguous(), v.contiguous()
            else:  # recompression: from the current slot (its loss is kept, not undone)
                from_l = self.layer_format(layer, from_fmt)
                if not recompressible(from_l, fmt_l):
                    raise ValueError(
                        f"cannot recompress {from_l} into {fmt_l} (proxima.compression.blocks.recompressible)"
                    )
                k, v, counts = self.read_with_counts(layer, from_fmt, from_dst, from_slot)
                if from_l.reduction is None:
                    counts = None
            imp = None
            if fmt_l.reduction is not None:
                # A reduced block's rows are no longer token positions: uniform importance (the
                # counts still weight the merge), as its per-token history cannot be mapped to them.
                imp = (self._importance_of(acts, b, h) if counts is None else torch.ones(counts.shape)).to(kv.device)
            cb = compress_blocks(fmt_l, k, v, token_importance=imp, group_size=self.group_size,
                                 backend=_kernels(kv), log_count=counts, source_tokens=b)
            staged.append((self.pool(layer, fmt_l), cb))
        # Writes happen only after every layer compressed: a failure above leaves no partial slot.
        for p, cb in staged:
            self.dtypes[p.spec.fmt] = (cb.k_data.dtype, cb.v_data.dtype)
            p.k[slots] = (
                cb.k_data.contiguous().view(torch.uint8).reshape(len(slots), *p.k.shape[1:]))
            p.v[slots] = cb.v_data.contiguous().view(torch.uint8).reshape(len(slots), *p.v.shape[1:])
            for name, t in p.meta.items():
                t[slots] = getattr(cb, name).to(t.dtype)

    @property
    def device(self) -> torch.device | None:
        return next(iter(self.kv_caches.values())).device if self.kv_caches else None

    def take_report(self) -> ProximaReport | None:
        rep, self.report = self.report, ProximaReport()
        rep.timings = self.times.take()
        return rep if (rep.ok or rep.failed or rep.importance or rep.timings) else None

    # --- importance -------------------------------------------------------------------------

    def observe(self, req_id: str, mass: torch.Tensor, *, reset: bool) -> None:
        """Fold one observation into a request's token importance.

        mass: float32 [tokens, H_kv], the attention mass each token got from the observed queries
        (NaN where the token could not be seen: compressed blocks keep their last value).
        `reset` (a prefill chunk's observation window) replaces the history of the tokens it saw; decode steps update
        the moving average, and a token seen for the first time starts at its first mass.
        """
        old = self.token_importance.get(req_id)
        n = mass.shape[0]
        seen = ~torch.isnan(mass)
        if old is None:
            new = torch.where(seen, mass, torch.zeros_like(mass))
        elif reset:  # unseen tokens (chunks compressed earlier in the prefill) keep their last value
            kept = torch.zeros_like(mass)
            m = min(n, old.shape[0])
            kept[:m] = old[:m]
            new = torch.where(seen, mass, kept)
        else:
            new = torch.zeros_like(mass)
            m = min(n, old.shape[0])
            new[:m] = old[:m]
            upd = torch.full_like(mass, float("nan"))
            upd[:m] = self.ema_decay * old[:m] + (1 - self.ema_decay) * mass[:m]
            upd[m:] = mass[m:]
            new = torch.where(seen, upd, new)
        self.token_importance[req_id] = new
        # One number per block for the scheduler: the block's mass (summed over its tokens), the
        # hottest head; blocks with no visible token this step are NaN (the scheduler keeps theirs).
        b = next(iter(self.kv_caches.values())).shape[2]
        nb = -(-n // b)
        pad = torch.zeros(nb * b, new.shape[1])
        pad[:n] = new
        per_block = pad.view(nb, b, -1).sum(1).amax(1)
        vis = torch.zeros(nb * b, dtype=torch.bool)
        vis[:n] = seen.any(1)
        per_block[~vis.view(nb, b).any(1)] = float("nan")
        self.report.importance[req_id] = per_block.tolist()

    def _importance_of(self, acts: list[CompressAction], b: int, h: int) -> torch.Tensor:
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
        p = self.pool(layer, fmt)
        idx = (dst * fmt.pack_ratio + slot).to(p.k.device)
        spec = p.spec
        kdt, vdt = self.dtypes[fmt]
        cb = CompressedBlocks(
            fmt, p.k.index_select(0, idx).view(kdt), p.v.index_select(0, idx).view(vdt), head_dim=spec.head_dim,
            dtype=self.kv_caches[layer].dtype, group_size=spec.group_size, source_tokens=spec.block_size,
            **{name: t.index_select(0, idx) for name, t in p.meta.items()},
        )
        return decompress_blocks(cb, backend=_kernels(p.k))

