"""Physical placement of logical KV blocks: per-request packing of compressed slots.

A physical block of a compressed format `f` holds `f.pack_ratio` slots. Packing is *per request*:
each request has at most one partly filled destination block per format, so a finished request
frees whole physical blocks and no cross-request fragmentation can arise (DESIGN.md).

Compressing a block whose physical block holds nothing else is done *in place* (the block becomes
slot 0 of a new destination of the target format): no spare block is needed, which matters because
compression runs exactly when the pool is full. Otherwise the slot goes into the request's open
destination of that format, or into a newly taken free block.

This is bookkeeping only (no tensors): the simulator and the vLLM KV manager both drive it, and
both hand the resulting `Move`s to whoever moves the bytes.

Invariants (checked by `check()` and the tests):
- free + owned == total;
- a physical block's reference count equals the number of live slots pointing into it, and a
  block is in the free list exactly when that count is 0;
- every slot of a physical block holds data of that block's single format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxima.formats import HOT, Format

PhysId = int


class PoolExhausted(RuntimeError):
    """No free physical block; the caller must compress, wait or preempt."""


@dataclass(frozen=True)
class Placement:
    """Where one logical block lives."""

    phys: PhysId
    slot: int
    fmt: Format


@dataclass(frozen=True)
class Move:
    """One compression step for the data path: read `src`, write `dst` (same worker step)."""

    request_id: str
    logical: int
    src: Placement
    dst: Placement
    freed: tuple[PhysId, ...]
    """Physical blocks this move released (to be returned to the pool after the data moved)."""


@dataclass
class _Dest:
    phys: PhysId
    used: int


@dataclass
class _Request:
    blocks: list[Placement] = field(default_factory=list)
    open_dest: dict[Format, _Dest] = field(default_factory=dict)


class PackedPool:
    """Placement and reference counting for a pool of `total` physical blocks."""

    def __init__(self, total: int) -> None:
        if total <= 0:
            raise ValueError(f"total must be positive, got {total}")
        self.total = total
        # LIFO free list: a just-freed block is reused first (warm in cache on the worker).
        self._free: list[PhysId] = list(range(total - 1, -1, -1))
        self._refs = [0] * total
        self._fmt: list[Format | None] = [None] * total
        self._requests: dict[str, _Request] = {}

    # -- queries -------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def owned_blocks(self) -> int:
        return self.total - len(self._free)

    def blocks(self, request_id: str) -> list[Placement]:
        return list(self._requests[request_id].blocks)

    def num_logical(self, request_id: str) -> int:
        req = self._requests.get(request_id)
        return len(req.blocks) if req else 0

    def requests(self) -> list[str]:
        return list(self._requests)

    def fragmentation_blocks(self) -> float:
        """Allocated but unused capacity, in physical blocks (empty slots of open destinations)."""
        waste = 0.0
        for req in self._requests.values():
            for fmt, dest in req.open_dest.items():
                waste += (fmt.pack_ratio - dest.used) / fmt.pack_ratio
        return waste

    # -- allocation ------------------------------------------------------------------------------
    def _take(self, fmt: Format) -> PhysId:
        if not self._free:
            raise PoolExhausted("no free physical KV block")
        phys = self._free.pop()
        assert self._refs[phys] == 0, f"block {phys} in the free list with {self._refs[phys]} live slots"
        self._fmt[phys] = fmt
        return phys

    def _unref(self, phys: PhysId) -> bool:
        """Drop one slot reference; True if the block went back to the free list."""
        self._refs[phys] -= 1
        assert self._refs[phys] >= 0, f"double free of physical block {phys}"
        if self._refs[phys] == 0:
            self._fmt[phys] = None
            self._free.append(phys)
            return True
        return False

    def append_hot(self, request_id: str) -> Placement:
        """Allocate the request's next logical block, uncompressed."""
        req = self._requests.setdefault(request_id, _Request())
        phys = self._take(HOT)
        self._refs[phys] = 1
        pl = Placement(phys, 0, HOT)
        req.blocks.append(pl)
        return pl

    def free_request(self, request_id: str) -> list[PhysId]:
        """Release every slot of a finished, aborted or preempted request."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return []
        released = [pl.phys for pl in req.blocks if self._unref(pl.phys)]
        return released

    # -- compression -----------------------------------------------------------------------------
    def compress(self, request_id: str, logical: int, fmt: Format) -> Move:
        """Re-place one logical block in format `fmt`. Raises `PoolExhausted` if it needs a block."""
        req = self._requests[request_id]
        src = req.blocks[logical]
        if fmt.is_hot or fmt.pack_ratio <= src.fmt.pack_ratio:
            raise ValueError(f"{src.fmt.name} -> {fmt.name} does not shrink block {logical} of {request_id}")
        dest = req.open_dest.get(fmt)
        if dest is not None:
            dst = Placement(dest.phys, dest.used, fmt)
            self._refs[dest.phys] += 1
            dest.used += 1
        elif self._refs[src.phys] == 1:
            # In place: the source block becomes slot 0 of a new destination. Its refcount stays 1
            # (the source slot's reference passes to the destination slot), so nothing is freed.
            self._forget_dest(req, src.phys)  # it may have been the open destination of its old format
            self._fmt[src.phys] = fmt
            dst = Placement(src.phys, 0, fmt)
            dest = _Dest(src.phys, 1)
            req.open_dest[fmt] = dest
            req.blocks[logical] = dst
            self._close_if_full(req, fmt)
            return Move(request_id, logical, src, dst, ())
        else:
            phys = self._take(fmt)
            self._refs[phys] = 1
            dest = _Dest(phys, 1)
            req.open_dest[fmt] = dest
            dst = Placement(phys, 0, fmt)
        req.blocks[logical] = dst
        self._close_if_full(req, fmt)
        # The source slot is vacated; its physical block goes back only when no slot points into it.
        freed = (src.phys,) if self._unref(src.phys) else ()
        if freed:
            self._forget_dest(req, src.phys)
        return Move(request_id, logical, src, dst, freed)

    def _close_if_full(self, req: _Request, fmt: Format) -> None:
        dest = req.open_dest.get(fmt)
        if dest is not None and dest.used >= fmt.pack_ratio:
            del req.open_dest[fmt]

    def _forget_dest(self, req: _Request, phys: PhysId) -> None:
        for fmt, dest in list(req.open_dest.items()):
            if dest.phys == phys:
                del req.open_dest[fmt]

    # -- invariants ------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert every accounting invariant (cheap enough for tests and debug runs)."""
        refs = [0] * self.total
        for rid, req in self._requests.items():
            for i, pl in enumerate(req.blocks):
                refs[pl.phys] += 1
                if self._fmt[pl.phys] != pl.fmt:
                    raise AssertionError(f"{rid} block {i}: slot format {pl.fmt} in a block of {self._fmt[pl.phys]}")
                if not 0 <= pl.slot < pl.fmt.pack_ratio:
                    raise AssertionError(f"{rid} block {i}: slot {pl.slot} outside 0..{pl.fmt.pack_ratio - 1}")
        if refs != self._refs:
            bad = [p for p in range(self.total) if refs[p] != self._refs[p]][:5]
            raise AssertionError(f"reference counts drifted for physical blocks {bad}")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a physical block appears twice in the free list (double free)")
        for p in range(self.total):
            if (refs[p] == 0) != (p in free):
                raise AssertionError(f"physical block {p}: {refs[p]} live slots but free={p in free}")
        if self.free_blocks + self.owned_blocks != self.total:
            raise AssertionError("free + owned != total")
        slots_seen: dict[tuple[int, int], str] = {}
        for rid, req in self._requests.items():
            for pl in req.blocks:
                key = (pl.phys, pl.slot)
                if key in slots_seen:
                    raise AssertionError(f"slot {key} used twice ({slots_seen[key]} and {rid})")
                slots_seen[key] = rid
