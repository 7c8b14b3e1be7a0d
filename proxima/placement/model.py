"""Per-request packing of compressed slots into destination blocks, over an abstract block source.

A physical block holding compressed data of format `f` is a *destination*: it has `f.pack_ratio`
slots, each holding one compressed logical block. Packing is per request (DESIGN.md): a request
fills its own destinations, so finishing, aborting or preempting it frees whole physical blocks
and no cross-request fragmentation can arise.

**No in-place compression.** A compressed copy always goes into a destination other than its
source, and the source is freed only after the copy was written (the vLLM worker reports success
one step later: two-phase commit). A failed compression must leave the source readable, which
rules out overwriting it in place. So compressing needs a free block whenever the request has no
open destination of the target format, and a pool filled to its last block could never compress
its way out: admission keeps `DEST_RESERVE_BLOCKS` free while anything is resident. The simulator
follows the same rule, so its numbers describe what vLLM does.

Invariants (stated here once; `SlotPacker.check` and `check_pool` assert them, and both users
call them: the vLLM manager's `check_accounting`, the simulator after every step):

1. Per request, at most one *open* (partly handed out) destination per format: a new destination
   of a format is taken only when the open one is full.
2. A destination returns to the pool only when no live slot (committed or in flight) remains in
   it, and only through `BlockSource.give_back` (the one path: the data path scrubs the block,
   then the pool frees it). Conversely a held destination has a live slot or is the open one.
3. free + owned == total: every block is either free or owned (hot by a request, or a
   destination), never both, and no block is owned twice.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NewType, Protocol

from proxima.formats import Format

BlockId = NewType("BlockId", int)
"""A physical block of the KV pool (vLLM's `KVCacheBlock.block_id`)."""
SlotIndex = NewType("SlotIndex", int)
"""A slot inside a destination block, 0 .. pack_ratio - 1."""

DEST_RESERVE_BLOCKS = 2
"""Free blocks that admitting a new request may not take while any request is resident: a
compression needs a fresh destination block (no in-place compression, see the module doc)."""


class BlockSource(Protocol):
    """Where destination blocks come from and go back to."""

    def num_free(self) -> int: ...

    def take(self) -> BlockId:
        """One free block (the caller checked `num_free() > 0`)."""
        ...

    def give_back(self, blocks: list[BlockId], *, free_now: bool = True) -> None:
        """Return destinations: scrub them (their packed bytes are garbage to a new owner), then
        free them now, or leave freeing to the caller (vLLM's deferred-free path) when not
        `free_now`."""
        ...


@dataclass
class Destination:
    """A physical block holding up to `fmt.pack_ratio` compressed slots of one request."""

    block: BlockId
    fmt: Format
    next_slot: int = 0
    """Slots handed out so far; the destination is open while this is below `fmt.pack_ratio`."""
    live: set[SlotIndex] = field(default_factory=set)
    """Slots holding a committed or in-flight compressed block."""

    @property
    def full(self) -> bool:
        return self.next_slot >= self.fmt.pack_ratio


@dataclass
class _RequestDests:
    dests: dict[BlockId, Destination] = field(default_factory=dict)
    open: dict[Format, Destination] = field(default_factory=dict)


class SlotPacker:
    """The destinations of every request, and the only code that takes or gives them back."""

    def __init__(self, source: BlockSource) -> None:
        self.source = source
        self._reqs: dict[str, _RequestDests] = {}

    # -- queries -----------------------------------------------------------------------------------
    def destinations(self, request_id: str) -> list[Destination]:
        req = self._reqs.get(request_id)
        return list(req.dests.values()) if req else []

    def all_destinations(self) -> Iterator[Destination]:
        for req in self._reqs.values():
            yield from req.dests.values()

    def owned(self) -> set[BlockId]:
        return {d.block for d in self.all_destinations()}

    def fragmentation_blocks(self) -> float:
        """Allocated but unused capacity, in physical blocks: slots of held destinations that hold
        nothing (not handed out yet, or vacated by a recompression)."""
        return sum((d.fmt.pack_ratio - len(d.live)) / d.fmt.pack_ratio for d in self.all_destinations())

    # -- slots -------------------------------------------------------------------------------------
    def reserve(self, request_id: str, fmt: Format) -> tuple[BlockId, SlotIndex] | None:
        """A slot of format `fmt` for one of the request's blocks: in its open destination, or in a
        newly taken block (None when the source has none)."""
        req = self._reqs.setdefault(request_id, _RequestDests())
        dest = req.open.get(fmt)
        if dest is None or dest.full:
            if self.source.num_free() < 1:
                if not req.dests:
                    del self._reqs[request_id]
                return None
            dest = Destination(self.source.take(), fmt)
            req.dests[dest.block] = dest
            req.open[fmt] = dest  # invariant 1: the previous open one (if any) is full
        slot = SlotIndex(dest.next_slot)
        dest.next_slot += 1
        dest.live.add(slot)
        return dest.block, slot

    def release(self, request_id: str, block: BlockId, slot: SlotIndex, *, undo: bool = False) -> None:
        """The slot no longer holds a live block (its compression failed, or the block was
        recompressed elsewhere). `undo`: a failed reservation; if it was the open destination's
        latest slot, the destination takes it back (release failed slots latest first)."""
        req = self._reqs[request_id]
        dest = req.dests[block]
        dest.live.remove(slot)
        if undo and req.open.get(dest.fmt) is dest and dest.next_slot - 1 == slot:
            dest.next_slot -= 1
        if not dest.live and (dest.full or dest.next_slot == 0):
            # Invariant 2: no live slot remains, and none will be handed out again.
            del req.dests[block]
            if req.open.get(dest.fmt) is dest:
                del req.open[dest.fmt]
            self.source.give_back([block])

    def release_request(self, request_id: str, *, free_now: bool = True) -> list[BlockId]:
        """Every destination of a finished, aborted or preempted request goes back (its slots die
        with it); returns them (the caller frees them itself when not `free_now`)."""
        req = self._reqs.pop(request_id, None)
        blocks = list(req.dests) if req else []
        if blocks:
            self.source.give_back(blocks, free_now=free_now)
        return blocks

    # -- invariants --------------------------------------------------------------------------------
    def check(self, live_slots: Mapping[str, Iterable[tuple[BlockId, SlotIndex]]]) -> None:
        """Assert invariants 1 and 2 against the user's own record of each request's live slots
        (committed and in flight): the two must agree exactly."""
        for rid in set(live_slots) | set(self._reqs):
            req = self._reqs.get(rid, _RequestDests())
            seen: dict[BlockId, set[SlotIndex]] = {}
            for block, slot in live_slots.get(rid, ()):
                if slot in seen.setdefault(block, set()):
                    raise AssertionError(f"request {rid}: slot {slot} of block {block} holds two blocks")
                seen[block].add(slot)
            for block, slots in seen.items():
                dest = req.dests.get(block)
                if dest is None or dest.live != slots:
                    raise AssertionError(
                        f"request {rid}: live slots {sorted(slots)} in block {block}, the packer has "
                        f"{sorted(dest.live) if dest else 'no such destination'}")
            for block, dest in req.dests.items():
                is_open = req.open.get(dest.fmt) is dest
                if dest.live and block not in seen:
                    raise AssertionError(f"request {rid}: destination {block} has live slots nobody holds")
                if not dest.live and not is_open:
                    raise AssertionError(f"request {rid}: destination {block} held with no live slot")
                if not is_open and not dest.full:
                    raise AssertionError(f"request {rid}: two partly filled {dest.fmt.name} destinations")
            for fmt, dest in req.open.items():
                if dest.fmt != fmt or req.dests.get(dest.block) is not dest:
                    raise AssertionError(f"request {rid}: open {fmt.name} destination not held")


def check_pool(total: int, free: Collection[BlockId], num_free: int, hot: Iterable[BlockId],
               packer: SlotPacker) -> None:
    """Invariant 3: free + owned == total; no block both free and owned, hot and a destination,
    or a destination twice. `free`: the blocks the pool lists as free (their count must be
    `num_free`, the pool's own counter); `hot`: blocks requests hold uncompressed (a block shared
    by several requests, e.g. a prefix-cache hit, is owned once)."""
    hot_set = set(hot)
    dests = list(packer.all_destinations())
    dest_set = {d.block for d in dests}
    owned = hot_set | dest_set
    problems = []
    if len(dest_set) != len(dests):
        problems.append("a destination held twice")
    if hot_set & dest_set:
        problems.append(f"hot and destination: {sorted(hot_set & dest_set)[:10]}")
    if owned & set(free):
        problems.append(f"owned and free: {sorted(owned & set(free))[:10]}")
    if len(set(free)) != num_free:
        problems.append(f"{len(set(free))} blocks listed free, the pool counts {num_free}")
    if len(owned) + num_free != total:
        problems.append(f"owned {len(owned)} + free {num_free} != total {total}")
    if problems:
        raise AssertionError("placement accounting broken: " + "; ".join(problems))


class CounterPool:
    """A pool of `total` interchangeable blocks (the simulator's `BlockSource`): a free list."""

    def __init__(self, total: int) -> None:
        if total <= 0:
            raise ValueError(f"total must be positive, got {total}")
        self.total = total
        # LIFO: the most recently freed block is reused first, as vLLM's free queue does for
        # blocks without a prefix-cache hash.
        self._free: list[BlockId] = [BlockId(i) for i in range(total - 1, -1, -1)]
        self._is_free = [True] * total

    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[BlockId]:
        return list(self._free)

    def take(self) -> BlockId:
        if not self._free:
            raise RuntimeError("no free block: the caller must check num_free() first")
        b = self._free.pop()
        self._is_free[b] = False
        return b

    def free(self, blocks: Iterable[BlockId]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise AssertionError(f"double free of block {b}")
            self._is_free[b] = True
            self._free.append(b)

    def give_back(self, blocks: list[BlockId], *, free_now: bool = True) -> None:
        # Nothing to scrub: the simulator holds no bytes.
        assert free_now, "the simulator has no deferred-free path"
        self.free(blocks)
