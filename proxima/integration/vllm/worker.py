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
from dataclasses import dataclass, field

import torch

from proxima.compression.blocks import CompressedBlocks, compress_blocks, decompress_blocks
from proxima.compression.spec import DEFAULT_GROUP_SIZE, SlotSpec
from proxima.formats import Format
from proxima.integration.vllm.plan import CompressAction, ProximaPlan, ProximaReport

logger = logging.getLogger("proxima.vllm")
FAULT_ENV = "PROXIMA_FAULT_INJECT"

_META_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class InjectedFault(RuntimeError):
    """Raised by the executor when PROXIMA_FAULT_INJECT=compress (tests only)."""


@dataclass
class _LayerPool:
    """One layer's view of the KV tensor as compressed slots of one format, plus its side table."""

    spec: SlotSpec
    k: torch.Tensor  # [num_blocks * r, C, H, P] view into vLLM's KV tensor
    v: torch.Tensor
    meta: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [num_blocks * r, ...]


class WorkerStore:
    """Everything the worker knows about compressed blocks (one per worker process)."""

    def __init__(self) -> None:
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
        self.batches = 0
        self.dtypes: dict[Format, tuple[torch.dtype, torch.dtype]] = {}

    # --- geometry ---------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(kv_caches)
        shapes = {tuple(t.shape) for t in kv_caches.values()}
        logger.info("proxima worker: %d KV layers, shapes %s", len(kv_caches), shapes)

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
            meta[f.name] = torch.empty(shape, dtype=_META_DTYPES[f.dtype])
            self.meta_bytes += meta[f.name].numel() * meta[f.name].element_size()
        p = _LayerPool(spec, raw[:, 0], raw[:, 1], meta)
        self.pools[key] = p
        return p

    # --- executor ---------------------------------------------------------------------------

    def apply(self, plan: ProximaPlan) -> None:
        """Drop freed requests, then run this step's compressions (before the forward pass)."""
        for rid in plan.dropped:
            self.remap.pop(rid, None)
            self.sources.pop(rid, None)
        self.key_blocks = dict(plan.key_blocks)
        by_fmt: dict[tuple[str, str], list[CompressAction]] = {}
        for a in plan.actions:
            by_fmt.setdefault((a.fmt, a.from_fmt), []).append(a)
        for (name, from_name), acts in by_fmt.items():
            try:
                self._compress(Format.parse(name), Format.parse(from_name), acts)
            except Exception as e:  # a failure must never fail a request: keep the blocks hot
                self.report.failed.extend(a.action_id for a in acts)
                self.report.errors.append(f"{type(e).__name__}: {e}")
                continue
            for a in acts:
                self.remap.setdefault(a.req_id, {})[a.index] = (Format.parse(a.fmt), a.dst, a.slot)
                self.sources.setdefault(a.req_id, {})[a.index] = a.src
            self.report.ok.extend(a.action_id for a in acts)

    def _compress(self, fmt: Format, from_fmt: Format, acts: list[CompressAction]) -> None:
        fault = os.environ.get(FAULT_ENV, "")
        if fault.startswith("compress"):
            # "compress": every batch fails; "compress@N": every Nth batch fails.
            self.batches += 1
            every = int(fault.partition("@")[2] or 1)
            if self.batches % every == 0:
                raise InjectedFault(f"{FAULT_ENV}={fault}")
        src = torch.tensor([a.src for a in acts], dtype=torch.long)
        r = fmt.pack_ratio
        slots = torch.tensor([a.dst * r + a.slot for a in acts], dtype=torch.long)
        staged: list[tuple[_LayerPool, CompressedBlocks]] = []
        from_dst = torch.tensor([a.from_dst for a in acts], dtype=torch.long)
        from_slot = torch.tensor([a.from_slot for a in acts], dtype=torch.long)
        for layer, kv in self.kv_caches.items():
            n, h, b, d = self.geometry(layer)
            if from_fmt.is_hot:
                blocks = kv.view(n, h, 2, b, d).index_select(0, src)  # [N, H, 2, B, D]
                k = blocks[:, :, 0].transpose(1, 2).contiguous()  # [N, B, H, D]
                v = blocks[:, :, 1].transpose(1, 2).contiguous()
            else:  # recompression: from the current slot (its loss is kept, not undone)
                k, v = self.read(layer, from_fmt, from_dst, from_slot)
            cb = compress_blocks(fmt, k, v, group_size=self.group_size, backend="torch")
            staged.append((self.pool(layer, fmt), cb))
        # Writes happen only after every layer compressed: a failure above leaves no partial slot.
        for p, cb in staged:
            self.dtypes[p.spec.fmt] = (cb.k_data.dtype, cb.v_data.dtype)
            p.k[slots] = (
                cb.k_data.contiguous().view(torch.uint8).reshape(len(slots), *p.k.shape[1:]))
            p.v[slots] = cb.v_data.contiguous().view(torch.uint8).reshape(len(slots), *p.v.shape[1:])
            for name, t in p.meta.items():
                t[slots] = getattr(cb, name).to(t.dtype)

    def take_report(self) -> ProximaReport | None:
        rep, self.report = self.report, ProximaReport()
        return rep if (rep.ok or rep.failed) else None

    # --- reader -----------------------------------------------------------------------------

    def read(self, layer: str, fmt: Format, dst: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decompress slots (dst, slot) of a layer: k_hat, v_hat [N, C, H, D] in the cache dtype."""
        p = self.pool(layer, fmt)
        idx = dst * fmt.pack_ratio + slot
        spec = p.spec
        kdt, vdt = self.dtypes[fmt]
        cb = CompressedBlocks(
            fmt, p.k.index_select(0, idx).view(kdt), p.v.index_select(0, idx).view(vdt), head_dim=spec.head_dim,
            dtype=self.kv_caches[layer].dtype, group_size=spec.group_size, source_tokens=spec.block_size,
            **{name: t.index_select(0, idx) for name, t in p.meta.items()},
        )
        kh, vh, _ = decompress_blocks(cb, backend="torch")
        return kh, vh


STORE = WorkerStore()
"""The worker process's store, shared by the connector (writer) and the attention backend (reader)."""
