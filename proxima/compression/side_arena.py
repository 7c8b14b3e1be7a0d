"""One side-table buffer shared by several stored formats: a pool block's metadata costs the
largest format's, not the sum of all.

Why: the worker's side tables (scales, zero points, log-counts) cover every slot of every pool
block. One table per stored format allocated the policy's formats side by side, so a ladder of
four formats paid four times (at the 8B shape, block 32: `aggressive` 2.47x the KV pool's bytes
beside it, `balanced` 1.23x; issue 41). But a pool block is the destination of one format at a
time: its KV bytes already hold the slots of exactly one format (every format's slot view
aliases the same KV tensor), and the metadata can follow the same rule. Here every format of an
arena lays its slots' metadata over the same per-block region of `M` bytes, M the largest
format's need (`aggressive` 1.16x, `balanced` 0.50x, `conservative` 0.25x).

Layout (per layer, per pool block, `M` bytes; uint8 `[L, N, M]`): format f with pack ratio r
gives each of its r slots a region of M / r bytes, slot j of block b at byte
`b * M + j * M / r` = `slot * M / r` for slot id `b * r + j` (the id every reader and writer
uses, `layout.py`). Inside a slot's region the format's fields follow one another, each
16-byte aligned, each `[C_f, H, ...]` contiguous as `CompressedBlocks` shapes them. So each
field is one strided view `[L, N * r, C_f, H, ...]` whose slot stride is M / r (instead of the
field's own size): every reader takes its strides from the tensor (the step kernels, the
one-pass and split decodes, the CPU kernels, torch's indexing), so no reader changes.

Invariant relied on: a pool block holds the slots of at most one format of an arena at a time
(the scheduler opens a destination block for one format and frees it before reuse; the KV
bytes rely on the same). Formats met later that are not in the arena (a policy changed at run
time to a heavier format) get an arena of their own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from proxima.compression.spec import SlotSpec

META_DTYPES = {"float32": torch.float32, "float16": torch.float16}
ALIGN = 16
"""Field and slot alignment in bytes (vector loads; every metadata element type divides it)."""


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def field_offsets(spec: SlotSpec) -> tuple[dict[str, int], int]:
    """(field -> byte offset inside a slot's region, the region's aligned size) for `spec`."""
    offsets: dict[str, int] = {}
    at = 0
    for f in spec.meta_fields():
        offsets[f.name] = at
        at += _round_up(f.bytes_per_head() * spec.num_kv_heads, ALIGN)
    return offsets, at


def block_bytes(specs: Iterable[SlotSpec]) -> int:
    """M: the bytes per pool block and layer an arena of these formats needs (0 without
    metadata): the largest format's slots, each region a multiple of ALIGN for every format's
    pack ratio (so M / r is an aligned whole number of bytes)."""
    specs = list(specs)
    need = max((s.fmt.pack_ratio * field_offsets(s)[1] for s in specs), default=0)
    if need == 0:
        return 0
    unit = math.lcm(*(ALIGN * s.fmt.pack_ratio for s in specs))
    return _round_up(need, unit)


@dataclass
class SideArena:
    """The buffer of one arena and the formats laid over it."""

    buffer: torch.Tensor
    """uint8 [L, N, M]."""
    specs: tuple[SlotSpec, ...]

    @classmethod
    def allocate(cls, specs: Iterable[SlotSpec], layers: int, num_blocks: int,
                 device: torch.device) -> SideArena:
        specs = tuple(specs)
        m = block_bytes(specs)
        return cls(torch.empty((layers, num_blocks, m), dtype=torch.uint8, device=device), specs)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def views(self, spec: SlotSpec) -> dict[str, torch.Tensor]:
        """`spec`'s side tables as views of the buffer: name -> [L, N * r, C_f, H, ...]."""
        layers, n, _m = self.buffer.shape
        r = spec.fmt.pack_ratio
        return {name: t.unflatten(0, (layers, n * r)) for name, t in
                field_views(self.regions(spec).flatten(0, 1), spec).items()}

    def regions(self, spec: SlotSpec) -> torch.Tensor:
        """`spec`'s slot regions: uint8 [L, N * r, M / r] (a view). Gathering slots' rows of it
        is one op for every field of those slots (`field_views` then reads the fields)."""
        if spec not in self.specs:
            raise KeyError(f"{spec.fmt} is not laid out in this side arena")
        layers, n, m = self.buffer.shape
        r = spec.fmt.pack_ratio
        return self.buffer.view(layers, n * r, m // r)


def field_views(regions: torch.Tensor, spec: SlotSpec) -> dict[str, torch.Tensor]:
    """The fields of slot regions uint8 [S, R] (rows of `SideArena.regions`, or a gather of them,
    whose rows are contiguous): name -> [S, C_f, H, ...] views with slot stride R."""
    s = regions.shape[0]
    h = spec.num_kv_heads
    offsets, _size = field_offsets(spec)
    if regions.stride(1) != 1 or regions.stride(0) % ALIGN or regions.storage_offset() % ALIGN:
        raise ValueError(f"slot regions must have contiguous rows aligned to {ALIGN} bytes")
    typed: dict[torch.dtype, torch.Tensor] = {}  # one reinterpretation per element type (host ops count)
    out: dict[str, torch.Tensor] = {}
    for f in spec.meta_fields():
        dtype = META_DTYPES[f.dtype]
        e = f.itemsize
        shape = (f.shape[0], h, *f.shape[1:])  # CompressedBlocks puts heads second
        inner = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * shape[i + 1]
        t = typed.get(dtype)
        if t is None:
            t = typed[dtype] = regions.view(dtype)  # [S, R / e]: R is a multiple of ALIGN
        out[f.name] = t.as_strided((s, *shape), (regions.stride(0) // e, *inner),
                                   t.storage_offset() + offsets[f.name] // e)
    return out


__all__ = ["ALIGN", "META_DTYPES", "SideArena", "block_bytes", "field_offsets", "field_views"]
