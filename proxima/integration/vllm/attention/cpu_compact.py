"""Decode rows with compressed blocks on CPU: every stored entry attended once, where it lies.

The scratch (`cpu_scratch.py`) rebuilds a row as vLLM's kernel wants it: whole bf16 blocks, each
cluster centroid repeated by its count. Its work grows with the row's *tokens*, not with what is
stored: a cluster(8)+int4 block holds 4 centroids, yet the scratch decodes 32 tokens and the kernel
reads 32. On the CPU capacity workload that made the scratch fill 27% and Proxima's attention 39%
of the aggressive process (py-spy, `bench/results/capacity-cpu.md`, 2026-12-07).

A decode row has one query, which sees every token before it: no causal mask inside the row, so
the order of its entries does not matter. Per layer, numba kernels (`cpu_attend_kernels.py`) fold
a row's entries into one online softmax per query head: its hot blocks and tail read in vLLM's
pages, then each format group's slots decoded once per entry in the pool, each centroid's logit
plus log(count) (n copies of a key add n * exp(q.k) = exp(q.k + log n): the repetition's math at
the cost of the stored entries). No buffer, no copy of the hot blocks. Formats the kernels do not
decode (lean, rotated keys) go through the torch reference first and are attended as float32.

Prefill chunks over compressed blocks (causal within the chunk), and every row when numba is
missing, keep the scratch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from proxima.compression.spec import KIVI_KEYS, LEAN_BITS
from proxima.formats import Format
from proxima.integration.vllm.attention.cpu_scratch import (
    RawReader,
    RawSlots,
    Reader,
    ScratchRow,
    byte_lut,
    side_table,
)
from proxima.integration.vllm.worker.page_layout import PageLayout

try:  # numba is in the `cpu` extra; without it the scratch serves every row
    from proxima.integration.vllm.attention import cpu_attend_kernels as kernels
    from proxima.integration.vllm.worker.cpu_kernels import HALF_TO_FLOAT
except ImportError:  # pragma: no cover - exercised only where numba is absent
    kernels = None  # type: ignore[assignment]

AVAILABLE = kernels is not None


@dataclass(frozen=True)
class CompactGroup:
    """The compressed slots of one (scheduler's) format, all rows together, ordered by row."""

    fmt: Format
    dst: torch.Tensor  # long [N]
    slot: torch.Tensor  # long [N]
    slot_ptr: np.ndarray  # int64 [R + 1]: row r's slots are [slot_ptr[r], slot_ptr[r + 1])


@dataclass
class CompactPlan:
    rows: int
    blk_ptr: np.ndarray  # int64 [R + 1]: row r's bf16 blocks in vLLM's pages, [blk_ptr[r], blk_ptr[r + 1])
    blk_ids: np.ndarray  # int64: physical blocks (hot ones, then the tail's)
    blk_len: np.ndarray  # int64: tokens read from each (B, and the tail's count)
    groups: list[CompactGroup] = field(default_factory=list)


def plan_compact(rows: list[ScratchRow], block_size: int) -> CompactPlan:
    """Lay out decode rows (query_len 1): their bf16 blocks and their slots by format."""
    b = block_size
    blk_ids: list[int] = []
    blk_len: list[int] = []
    blk_ptr = [0]
    groups: dict[Format, tuple[list[int], list[int], list[int]]] = {}  # fmt -> (dst, slot, row of each)
    for r, row in enumerate(rows):
        if row.query_len != 1:
            raise ValueError(f"compact attention serves decode rows (1 query token), got {row.query_len}")
        last = (row.seq_len - 1) // b  # the block holding the query, and the tail
        bad = [j for j in row.remap if j >= last]
        if bad:  # the engine never compresses a block that receives queries (the hot tail)
            raise ValueError(f"blocks {bad} of a row are compressed but hold its query token: they must stay hot")
        for j in range(last):
            hit = row.remap.get(j)
            if hit is None:
                blk_ids.append(row.blocks[j])
                blk_len.append(b)
            else:
                g = groups.setdefault(hit[0], ([], [], []))
                g[0].append(hit[1])
                g[1].append(hit[2])
                g[2].append(r)
        blk_ids.append(row.blocks[last])
        blk_len.append(row.seq_len - last * b)
        blk_ptr.append(len(blk_ids))
    i64 = np.int64
    plan = CompactPlan(len(rows), np.array(blk_ptr, i64), np.array(blk_ids, i64), np.array(blk_len, i64))
    for fmt, (dsts, slots, owner) in groups.items():
        ptr = np.zeros(len(rows) + 1, i64)
        np.cumsum(np.bincount(np.array(owner, i64), minlength=len(rows)), out=ptr[1:])
        long = torch.long
        plan.groups.append(CompactGroup(fmt, torch.tensor(dsts, dtype=long), torch.tensor(slots, dtype=long), ptr))
    return plan


def no_counts() -> np.ndarray:
    """`attend_slots`' log-counts of slots without counts (float32, empty)."""
    return np.zeros((0, 1, 1), np.float32)


def _half(mode: int, bits: int, u8: np.ndarray | None = None, u16: np.ndarray | None = None,
          f32: np.ndarray | None = None, lut: np.ndarray | None = None, s32: np.ndarray | None = None,
          s16: np.ndarray | None = None, z16: np.ndarray | None = None) -> tuple[Any, ...]:
    """A `Half` tuple (see `cpu_attend_kernels`); the arrays its mode does not read are fresh
    placeholders, writable like the real ones: numba types a read-only array apart, and every mix
    would compile a kernel of its own (10-20 s each)."""

    def unused(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.zeros(shape, dtype)

    return (mode,
            u8 if u8 is not None else unused((1, 1, 1, 1), np.uint8),
            u16 if u16 is not None else unused((1, 1, 1, 1), np.uint16),
            f32 if f32 is not None else unused((1, 1, 1, 1), np.float32),
            lut if lut is not None else unused((256,), np.float32),
            s32 if s32 is not None else unused((1, 1, 1), np.float32),
            s16 if s16 is not None else unused((1, 1, 1, 1), np.uint16),
            z16 if z16 is not None else unused((1, 1, 1, 1), np.uint16),
            bits)


def _halves(slots: RawSlots) -> tuple[Any, Any]:
    """The kernels' `Half` tuples of a slot group as stored (see `cpu_attend_kernels`)."""
    q = slots.fmt.quant
    k, v = slots.k.numpy(), slots.v.numpy()
    if q == "bf16":
        return _half(kernels.BF16, 16, u16=k.view(np.uint16)), _half(kernels.BF16, 16, u16=v.view(np.uint16))
    if q == "fp8":  # (the byte tables copied: writable, see `_half`)
        kh = _half(kernels.LUT, 8, u8=k, lut=byte_lut(torch.float8_e4m3fn).copy(), s32=side_table(slots, "k_scale"))
    else:  # int8 / int4 / int2 keys: KIVI, per channel over token groups
        kh = _half(kernels.KIVI_CHANNEL, KIVI_KEYS[q], u8=k, s16=side_table(slots, "k_scale"),
                   z16=side_table(slots, "k_zero"))
    if q in ("fp8", "int8"):  # per-token values
        lut = byte_lut(torch.float8_e4m3fn if q == "fp8" else torch.int8).copy()
        vh = _half(kernels.LUT, 8, u8=v, lut=lut, s32=side_table(slots, "v_scale"))
    else:
        vh = _half(kernels.KIVI_GROUP, KIVI_KEYS[q], u8=v, s16=side_table(slots, "v_scale"),
                   z16=side_table(slots, "v_zero"))
    return kh, vh


def _decoded(kh: torch.Tensor, vh: torch.Tensor) -> tuple[Any, Any]:
    """`Half` tuples of slots decoded by the torch reference: float32 [N, C, H, D]."""
    return (_half(kernels.F32, 32, f32=kh.float().contiguous().numpy()),
            _half(kernels.F32, 32, f32=vh.float().contiguous().numpy()))


def _counts(slots: RawSlots) -> np.ndarray:
    """The group's log-counts side table (cluster slots), else `no_counts()`."""
    return slots.meta["log_count"].numpy() if slots.fmt.attention_uses_counts else no_counts()


def _pages(kv: torch.Tensor) -> np.ndarray:
    """vLLM's cache [N, H, B, 2D] bf16 as the kernels read it: uint16 pages [N, H, 2BD]."""
    return kv.view(kv.shape[0], kv.shape[1], -1).view(torch.int16).numpy().view(np.uint16)


def attend_compact(plan: CompactPlan, q: torch.Tensor, kv: torch.Tensor, layout: PageLayout, read: Reader,
                   raw: RawReader, scale: float) -> torch.Tensor:
    """Count-weighted attention of each decode row's query q [R, HQ, D] over its entries in one
    layer (cache `kv` [N, H, B, 2D] bf16): float32 [R, HQ, D]. Query head i reads KV head
    i // (HQ / H), as vLLM's kernels do."""
    h, b = kv.shape[1], kv.shape[2]
    qs = (q.float() * scale).contiguous().numpy()
    r, hq, d = qs.shape
    m = np.full((r, hq), -np.inf, np.float32)
    norm = np.zeros((r, hq), np.float32)
    acc = np.zeros((r, hq, d), np.float32)
    kernels.attend_pages(qs, _pages(kv), layout.key_pos.numpy(), layout.value_pos.numpy(), plan.blk_ptr, plan.blk_ids,
                         plan.blk_len, m, norm, acc)
    for g in plan.groups:
        slots = raw(g.fmt, g.dst, g.slot)  # this layer's format (a layer override may store another)
        if slots.fmt.quant in LEAN_BITS:  # rotated keys: decoded by the torch reference
            kd, vd, counts = read(g.fmt, g.dst, g.slot)
            kh, vh = _decoded(kd, vd)
            rows = np.arange(len(g.dst), dtype=np.int64)
            lc = counts.float().contiguous().numpy() if slots.fmt.attention_uses_counts else no_counts()
        else:
            kh, vh = _halves(slots)
            rows = slots.rows.numpy()
            lc = _counts(slots)
        kernels.attend_slots(qs, h, rows, g.slot_ptr, slots.fmt.kept_tokens(b), lc, kh, vh, slots.group_size,
                             HALF_TO_FLOAT, m, norm, acc)
    return torch.from_numpy(acc / norm[:, :, None])


def warm_up(kv: torch.Tensor, layout: PageLayout, stored: list[RawSlots]) -> None:
    """Compile, or load from numba's disk cache, the kernel variants a step will call, before the
    engine serves: a first compile takes 10-20 s, otherwise inside a step. `stored`: slot row 0
    of each stored format's pool (as `store_reader` returns it). Reads block 0 and those rows
    (whatever they hold) and drops the results."""
    h, d = kv.shape[1], kv.shape[3] // 2
    q = np.zeros((1, h, d), np.float32)
    m, norm, acc = np.full((1, h), -np.inf, np.float32), np.zeros((1, h), np.float32), np.zeros((1, h, d), np.float32)
    ptr, first, one = np.array([0, 1], np.int64), np.zeros(1, np.int64), np.ones(1, np.int64)
    kernels.attend_pages(q, _pages(kv), layout.key_pos.numpy(), layout.value_pos.numpy(), ptr, first, one, m, norm, acc)
    zeros = torch.zeros(1, 1, h, d)
    kd, vd = _decoded(zeros, zeros)  # what a lean group becomes, with and without counts
    calls = [(kd, vd, first, counts, 1) for counts in (no_counts(), np.zeros((1, 1, h), np.float32))]
    for slots in stored:
        if slots.fmt.quant not in LEAN_BITS:
            kh, vh = _halves(slots)
            calls.append((kh, vh, slots.rows.numpy(), _counts(slots), slots.group_size))
    for kh, vh, rows, counts, group in calls:
        kernels.attend_slots(q, h, rows, ptr, 1, counts, kh, vh, group, HALF_TO_FLOAT, m, norm, acc)
