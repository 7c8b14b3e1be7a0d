"""The persistent block table on the device: where every compressed logical block of every
running request lives, kept next to vLLM's own block table and updated in place each step.

Why: the CUDA attention used to rebuild this from the host maps in every step (`paged.plan_rows`
walks every block of every compressed row, with host syncs on the way), which costs more than
the attention and cannot run inside a CUDA graph. Here the table stays on the device; a step
sends only what changed (the step's new placements, revocations and dropped requests, and the
key blocks that moved) as one small host table, copied once without blocking and scattered in
place. Nothing is walked per block and nothing is read back.

Layout (int32, on the KV cache's device):

* `entries [R + 1, NB, 2]`: per table row (one per request with compressed blocks) and logical
  block, (format code, slot id). Code 0 is hot: the block is read from vLLM's own block table,
  the slot id is then unused. Code c > 0 is `formats[c - 1]`, as the worker remembers the block
  (`remap`: a `StoredFormat` keeps its override epoch), read in each layer from the pool of
  `WorkerStore.layer_format(layer, formats[c - 1])`; slot id = destination block * the
  scheduler's pack ratio + slot, the id the slot pools and the writer use. Row 0 is all hot and
  never assigned: a batch row of a request without compressed blocks reads it.
* `owner [num_blocks]`: physical block -> table row, for the key block of every scheduled
  request that has a row (0 elsewhere). The key block is the block receiving the request's first
  query token this step (`ProximaPlan.key_blocks`, exclusively owned), so a batch row finds its
  table row on the device as `owner[slot_mapping[query_start_loc[r]] // block_size]`
  (`rows_of_batch`), from vLLM's own per-step slot mapping: no request ids and no host lookup
  in the attention metadata.

* `importance [R + 1, NB, H]` float32 (`imp_owner [num_blocks]`, `imp_rows`): the observed
  layer's per-block attention mass, an exponential average kept on the device for every
  scheduled request (not only those with compressed blocks, hence its own rows and owner map,
  kept like `entries`' ones). The one-pass decode writes it (`mixed_decode.update_block_importance`);
  NaN = never observed. A freed row is reset to NaN in the same update.

Invariant relied on: `owner` (and `imp_owner`) holds exactly the current step's key blocks of requests with a row
(blocks of the previous step's map that are not key blocks any more are cleared in the same
update), so a block reused by another request never points at a stale row.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from proxima.compression.mixed_decode_pools import MAX_CODES
from proxima.formats import Format

if TYPE_CHECKING:  # (an annotation only: the table imports without vLLM, e.g. bench/one_pass_decode.py)
    from proxima.integration.vllm.plan import CompressAction

ONE_PASS_ENV = "PROXIMA_ONE_PASS_DECODE"
"""On (the default on CUDA, or `1`): uniform single-token decode batches run `mixed_decode` (one
launch per layer, every row, from this table; two in the observed layer) instead of vLLM's kernel
plus the per-format split, and the attention builder declares CUDA-graph support for them, so
decode steps replay from vLLM's full graphs. `0`: the split path for every batch, graphs NEVER
(attention eager). Why on by default: on the H100 (8B shape, block 32, capacity quick run,
2026-12-06) it served 205.8 / 305.2 tokens/s for balanced / aggressive, the split path 51.9 /
63.5, although its kernel reads compressed blocks slower than the split path's (the split path's
host planning and eager attention cost more). Off by default on a CPU (the CPU backend does not
read the table). Here, not in `attention/`, because the connector reads it too (imports flow
attention -> connector -> worker)."""


def one_pass_decode(device: torch.device | None = None) -> bool:
    """Whether the one-pass decode is on for a KV cache on `device` (None: this process's default
    device, CUDA if it has one). `PROXIMA_ONE_PASS_DECODE` set to 1 or 0 decides; unset, it is on
    on CUDA."""
    value = os.environ.get(ONE_PASS_ENV, "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise ValueError(f"{ONE_PASS_ENV}={value!r}: use 1 (one-pass decode with CUDA graphs, the default on "
                         "CUDA) or 0 (the split path, attention eager)")
    if device is not None:
        return torch.device(device).type == "cuda"
    return torch.cuda.is_available()


Placement = tuple[Format, int, int]
"""(format as the worker remembers it, destination block, slot), as in `WorkerStore.remap`."""

HOT_CODE = 0
NO_ROW = 0


class BlockTableFull(RuntimeError):
    """More requests with compressed blocks, or longer ones, than the table was sized for."""


class TooManyFormats(BlockTableFull):
    """A format needs a code while every code the decode kernel reads holds a format still in use."""


class DeviceBlockTable:
    def __init__(self, max_requests: int, max_blocks: int, num_physical_blocks: int,
                 device: torch.device | str, *, kv_heads: int = 1, max_batch: int | None = None,
                 max_codes: int = MAX_CODES - 1) -> None:
        if min(max_requests, max_blocks, num_physical_blocks) < 1:
            raise ValueError(f"DeviceBlockTable needs positive sizes, got {max_requests} requests, "
                             f"{max_blocks} blocks per request, {num_physical_blocks} physical blocks")
        self.device = torch.device(device)
        self.max_blocks = max_blocks
        self.entries = torch.zeros(max_requests + 1, max_blocks, 2, dtype=torch.int32, device=self.device)
        self.owner = torch.zeros(num_physical_blocks, dtype=torch.int32, device=self.device)
        self.formats: list[Format] = []
        """Format of code c at index c - 1. A code goes back when no entry holds it any more (and
        no write of it is in flight: `release_unused`) and is handed to the next new format: a
        long-lived engine meets a new format at every policy change that changes the layer
        overrides (`layer_formats.py`), more than the kernel's codes."""
        self._codes: dict[Format, int] = {}
        self.max_codes = max_codes
        self._uses: dict[int, int] = {}
        """code -> entries that hold it now (host mirror of `entries`' codes)."""
        self._row_codes: dict[int, dict[int, int]] = {}
        """table row -> {logical block: code} of its compressed entries (what a write or a freed row releases)."""
        self._free_codes: list[int] = []
        self.formats_version = 0
        """Bumped whenever a code gets a format (new or reused): the descriptor tables follow it."""
        self.rows: dict[str, int] = {}
        """request -> its table row (assigned at its first compressed block, freed when dropped)."""
        self._free = list(range(max_requests, 0, -1))  # pop() hands out the lowest row first
        self._owned: dict[int, int] = {}
        """The key blocks `owner` maps now -> their row (what the next update diffs against)."""
        self.updates = 0
        """Host-to-device copies made so far (one per update that changed anything)."""
        self.max_batch = max_batch or max_requests
        """Most batch rows of one step (vLLM's max_num_seqs): the observed layer's scratch size."""
        self.importance = torch.full((max_requests + 1, max_blocks, kv_heads), float("nan"), device=self.device)
        self.imp_owner = torch.zeros(num_physical_blocks, dtype=torch.int32, device=self.device)
        self.imp_rows: dict[str, int] = {}
        """request -> its importance row (every scheduled request while a row is free: advisory,
        a request without one is simply not observed on the device)."""
        self._imp_free = list(range(max_requests, 0, -1))
        self._imp_owned: dict[int, int] = {}
        self.observed: int | None = None
        """Set by the metadata builder for a step whose observed layer updates `importance` on
        the device (to the blocks of the step's longest request); read back and reset by the
        connector at the step's end (`device_importance.py`)."""
        self.descriptors: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}
        """Per layer: (formats described, persistent pool descriptor table) for the one-pass decode
        (refreshed in place by the metadata builder, outside any CUDA graph)."""
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def observe_scratch(self, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The observed layer's per-block and per-row log-sum-exp buffers, [max_batch, NB, Hq] and
        [max_batch, Hq] float32, allocated once (fixed addresses for a CUDA graph)."""
        if self._scratch is None or self._scratch[1].shape[1] != num_q_heads:
            self._scratch = (torch.empty(self.max_batch, self.max_blocks, num_q_heads, device=self.device),
                             torch.empty(self.max_batch, num_q_heads, device=self.device))
        return self._scratch

    def code_of(self, fmt: Format) -> int:
        """`fmt`'s code, assigned now if it has none (a freed code first); TooManyFormats when
        every code holds a format in use (`refusal` lets the worker refuse such a compression first)."""
        if fmt.is_hot:
            return HOT_CODE
        code = self._codes.get(fmt)
        if code is None:
            if self._free_codes:
                code = self._free_codes.pop()
                self.formats[code - 1] = fmt
            elif len(self.formats) < self.max_codes:
                self.formats.append(fmt)
                code = len(self.formats)
            else:
                raise TooManyFormats(f"{len(self._codes)} formats in use, the one-pass decode kernel reads "
                                     f"{self.max_codes}")
            self._codes[fmt] = code
            self.formats_version += 1
        return code

    def coded(self) -> dict[Format, int]:
        """The formats that hold a code now -> their code."""
        return dict(self._codes)

    def refusal(self, fmt: Format) -> str | None:
        """None if a block may be written in `fmt` (it has a code, or one is assigned to it now,
        kept while a write of it is in flight: `release_unused`); else why not."""
        try:
            self.code_of(fmt)
        except TooManyFormats as e:
            return (f"{e} (each change of the policy's layer_overrides makes new formats); the blocks stay where "
                    "they are until a code is free")
        return None

    def release_unused(self, in_flight: Iterable[Format] = ()) -> None:
        """Give back the codes no entry holds, except those of formats whose writes are still in
        flight (blocks measured by the probe, placed when their verdict is read). Safe to reuse at
        once: every kernel that read the old format's entries was queued before the update that
        cleared them (one stream), and the descriptors are rewritten before the next forward."""
        keep = set(in_flight)
        for fmt, code in list(self._codes.items()):
            if self._uses.get(code, 0) == 0 and fmt not in keep:
                del self._codes[fmt]
                self._free_codes.append(code)

    def _hold(self, row: int, index: int, code: int) -> None:
        """Host mirror of one entry write (HOT_CODE: the entry is cleared)."""
        codes = self._row_codes.setdefault(row, {})
        old = codes.pop(index, HOT_CODE)
        if old != HOT_CODE:
            self._uses[old] -= 1
        if code != HOT_CODE:
            codes[index] = code
            self._uses[code] = self._uses.get(code, 0) + 1

    def _drop_row(self, row: int) -> None:
        for code in self._row_codes.pop(row, {}).values():
            self._uses[code] -= 1

    def _row_for(self, req_id: str) -> int:
        row = self.rows.get(req_id)
        if row is None:
            if not self._free:
                raise BlockTableFull(f"proxima: the device block table has no row left for request {req_id!r} "
                                     f"({len(self.rows)} requests hold rows)")
            row = self.rows[req_id] = self._free.pop()
        return row

    def update(self, placed: Iterable[tuple[str, int, Placement | None]], dropped: Iterable[str],
               key_blocks: Mapping[int, str]) -> None:
        """Apply one step: `placed` (request, logical block, where it lives now; None = hot again)
        for the blocks this step's plan touched, `dropped` requests (their rows are cleared and
        freed first), and the step's `key_blocks` (physical block -> request, every scheduled
        request). Host work is proportional to what changed plus one pass over the key blocks."""
        dropped = list(dropped)  # read twice: entry rows, importance rows
        freed = [self.rows.pop(rid) for rid in dropped if rid in self.rows]
        self._free.extend(reversed(freed))
        for row in freed:
            self._drop_row(row)
        writes: list[tuple[int, int, int]] = []  # (flat entry index, code, slot id)
        for rid, index, place in placed:
            if index < 0 or index >= self.max_blocks:
                raise BlockTableFull(f"proxima: request {rid!r} block {index} is past the device block table's "
                                     f"{self.max_blocks} blocks per request")
            if place is None:
                hot_row = self.rows.get(rid)
                if hot_row is None:  # never compressed here (or dropped): already hot
                    continue
                writes.append((hot_row * self.max_blocks + index, HOT_CODE, 0))
                self._hold(hot_row, index, HOT_CODE)
                continue
            fmt, dst, slot = place
            row, code = self._row_for(rid), self.code_of(fmt)
            writes.append((row * self.max_blocks + index, code, dst * fmt.pack_ratio + slot))
            self._hold(row, index, code)
        owned = {blk: r for blk, rid in key_blocks.items() if (r := self.rows.get(rid)) is not None}
        moved = [(blk, r) for blk, r in owned.items() if self._owned.get(blk) != r]
        moved += [(blk, NO_ROW) for blk in self._owned.keys() - owned.keys()]
        self._owned = owned
        imp_freed, imp_moved = self._follow_importance_rows(dropped, key_blocks)
        if not (freed or writes or moved or imp_freed or imp_moved):
            return
        # One host table: [freed rows | entry writes (3 ints each) | owner changes (2 ints each)
        #                  | freed importance rows | importance owner changes (2 ints each)].
        host = torch.tensor(freed + [x for w in writes for x in w] + [x for m in moved for x in m]
                            + imp_freed + [x for m in imp_moved for x in m], dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        nf, nw = len(freed), len(writes)
        if nf:
            self.entries.index_fill_(0, dev[:nf], 0)
        if nw:
            w = dev[nf : nf + 3 * nw].view(nw, 3)
            self.entries.view(-1, 2).index_copy_(0, w[:, 0], w[:, 1:].to(torch.int32))
        at = nf + 3 * nw
        if moved:
            m = dev[at : at + 2 * len(moved)].view(-1, 2)
            self.owner.index_copy_(0, m[:, 0], m[:, 1].to(torch.int32))
        at += 2 * len(moved)
        if imp_freed:
            self.importance.index_fill_(0, dev[at : at + len(imp_freed)], float("nan"))
        at += len(imp_freed)
        if imp_moved:
            m = dev[at:].view(-1, 2)
            self.imp_owner.index_copy_(0, m[:, 0], m[:, 1].to(torch.int32))
        self.updates += 1

    def _follow_importance_rows(self, dropped: Iterable[str], key_blocks: Mapping[int, str]
                                ) -> tuple[list[int], list[tuple[int, int]]]:
        """Importance rows: freed for dropped requests, assigned to every scheduled request while
        rows last; returns (freed rows, importance owner changes) for the step's host table."""
        freed = [self.imp_rows.pop(rid) for rid in dropped if rid in self.imp_rows]
        self._imp_free.extend(reversed(freed))
        for rid in key_blocks.values():
            if rid not in self.imp_rows and self._imp_free:
                self.imp_rows[rid] = self._imp_free.pop()
        owned = {blk: row for blk, rid in key_blocks.items() if (row := self.imp_rows.get(rid)) is not None}
        moved = [(blk, row) for blk, row in owned.items() if self._imp_owned.get(blk) != row]
        moved += [(blk, NO_ROW) for blk in self._imp_owned.keys() - owned.keys()]
        self._imp_owned = owned
        return freed, moved


def rows_of_batch(owner: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """int32 [R]: the table row of each batch row (R = len(query_start_loc) - 1), on the device.

    Reference of what the decode kernel computes per program; padding rows (a slot of -1, or a
    query start past the slot mapping) read row 0 (all hot)."""
    starts = query_start_loc[:-1].long().clamp_max(max(slot_mapping.shape[0] - 1, 0))
    first = slot_mapping.index_select(0, starts) if slot_mapping.numel() else starts
    blk = torch.where(first >= 0, first // block_size, torch.zeros_like(first))
    return torch.where(first >= 0, owner.index_select(0, blk.long()), torch.zeros_like(blk, dtype=torch.int32))


def step_placements(actions: Iterable[CompressAction], remap: Mapping[str, Mapping[int, Placement]]
                    ) -> list[tuple[str, int, Placement | None]]:
    """The blocks a plan's actions (and revocations) touched, each where the worker's map says it
    lives after the plan ran (`remap` is the truth: a failed or refused action left its block as
    it was, so rewriting it changes nothing). O(actions), no walk over a request's blocks."""
    return [(a.req_id, a.index, remap.get(a.req_id, {}).get(a.index)) for a in actions]


def table_for(kv_caches: Mapping[str, torch.Tensor], max_requests: int, max_model_len: int | None
              ) -> DeviceBlockTable | None:
    """A table sized for the engine: rows for twice the running requests (a finished request's
    row is freed by the plan after the one that admits its successor), a logical block per
    `block_size` tokens of the longest request (without a model length: one per physical block).
    None without caches."""
    if not kv_caches:
        return None
    kv = next(iter(kv_caches.values()))
    nb, b = int(kv.shape[0]), int(kv.shape[2])
    blocks = -(-max_model_len // b) if max_model_len else nb
    return DeviceBlockTable(2 * max_requests, blocks, nb, kv.device, kv_heads=int(kv.shape[1]),
                            max_batch=max_requests)


__all__ = ["HOT_CODE", "BlockTableFull", "DeviceBlockTable", "rows_of_batch", "step_placements", "table_for"]
