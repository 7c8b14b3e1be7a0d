"""The request ledger: what Proxima knows about each resident request's logical blocks (plain data).

vLLM keeps each request's physical blocks (`req_to_blocks`); the ledger keeps what vLLM does not:
which logical blocks are compressed and where their slot is, which are being compressed (in
flight, between plan and report), and the attention mass the worker last observed per block.
It is moved, unchanged in meaning, out of the KV manager (`_ReqState` there) so that admission,
stats and pool usage can read it without the manager.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.v1.request import Request

from proxima.formats import Format
from proxima.integration.vllm.plan import CompressAction, SlotKey
from proxima.placement import BlockId, SlotIndex

UNMEASURED_IMPORTANCE = 1.0
"""Importance of a block the worker has not observed yet: all of its head's attention mass, so the
engine compresses measured blocks first (measured masses are fractions of 1)."""


class CompressedSlot(NamedTuple):
    """Where a committed compressed logical block lives."""

    fmt: Format
    block: BlockId
    slot: SlotIndex


@dataclass
class RequestEntry:
    request: Request
    compressed: dict[int, CompressedSlot] = field(default_factory=dict)
    """Logical block index -> its committed compressed slot (written through `commit`)."""
    formats: Counter[Format] = field(default_factory=Counter)
    """`compressed`'s formats counted (kept by `commit`): admission and the side-table charge
    read them at every scheduling step, in time that does not grow with the blocks."""
    in_flight: dict[int, CompressAction] = field(default_factory=dict)
    """Logical block index -> the compression planned for it, not yet reported (written only by
    `in_flight.InFlight`, which keeps it equal to its pending actions)."""
    importance: list[float] = field(default_factory=list)
    """Attention mass of each logical block, as the worker last observed it (NaN: never)."""
    caps: dict[int, Format] = field(default_factory=dict)
    """Logical block index -> the harshest format the compression-time probe accepted for it
    (`bf16`: none, the block stays hot); the manager plans no harsher one."""
    target: float | None = None
    """The bytes ratio this request asked its prompt to be stored at (`targets.py`), while it is
    still to be planned; None: no target, or done."""
    target_rounds: int = 0
    """Planning rounds that planned something (a round after the first replans refused blocks)."""
    target_tries: int = 0
    """Steps the target was tried in (`targets.MAX_TRIES`)."""
    target_blocks: int = 0
    """The prompt's logical blocks when the target was first planned (what its ratio is over)."""

    def commit(self, index: int, slot: CompressedSlot) -> None:
        """Logical block `index` now lives in `slot` (a recompression replaces its old slot)."""
        old = self.compressed.get(index)
        if old is not None:
            self.formats[old.fmt] -= 1
            if not self.formats[old.fmt]:
                del self.formats[old.fmt]
        self.compressed[index] = slot
        self.formats[slot.fmt] += 1

    def live_slots(self) -> Iterator[tuple[BlockId, SlotIndex]]:
        """Slots this request holds in its destinations: committed, and reserved by in-flight actions."""
        for c in self.compressed.values():
            yield c.block, c.slot
        for a in self.in_flight.values():
            yield BlockId(a.dst), SlotIndex(a.slot)

    def importance_of(self, n: int) -> list[float]:
        """Importance of the first `n` logical blocks for the engine (unmeasured ones count fully)."""
        out = [UNMEASURED_IMPORTANCE] * n
        for i, x in enumerate(self.importance[:n]):
            if not math.isnan(x):
                out[i] = x
        return out

    def observe(self, importance: list[float]) -> None:
        """The worker's observation; a block it could not see this step (NaN) keeps its last value."""
        old = self.importance
        self.importance = [old[i] if math.isnan(x) and i < len(old) else x for i, x in enumerate(importance)]


class RequestLedger(dict[str, RequestEntry]):
    """Request id -> its entry, for every request holding blocks in vLLM's pool."""

    def compressed_slots(self) -> Iterator[CompressedSlot]:
        for entry in self.values():
            yield from entry.compressed.values()

    def formats(self) -> Counter[Format]:
        """Committed compressed blocks per format, over every resident request."""
        out: Counter[Format] = Counter()
        for entry in self.values():
            out.update(entry.formats)
        return out

    def live_slots(self) -> dict[str, list[tuple[BlockId, SlotIndex]]]:
        return {rid: list(e.live_slots()) for rid, e in self.items()}


def expected_remap(ledger: RequestLedger) -> dict[str, dict[int, list[SlotKey]]]:
    """Per request and logical block, the slots a rank's block map may point to: the committed one
    and the target of an action in flight (a rank may have written it before the others report)."""
    out: dict[str, dict[int, list[SlotKey]]] = {}
    for rid, entry in ledger.items():
        blocks: dict[int, list[SlotKey]] = {}
        for index, c in entry.compressed.items():
            blocks.setdefault(index, []).append((c.fmt, int(c.block), int(c.slot)))
        for index, a in entry.in_flight.items():
            blocks.setdefault(index, []).append((a.fmt, int(a.dst), int(a.slot)))
        if blocks:
            out[rid] = blocks
    return out
