"""What the decision engine sees: a columnar snapshot of the KV pool, as plain data.

Why columnar (one numpy array per attribute over all logical blocks) rather than a list of block
objects: the engine must decide over 10k blocks in under a millisecond, which only vectorised
code can do in Python. `Snapshot.build` takes the friendlier per-request form
(`RequestBlocks`) and is what integrations and tests call.

Block positions are logical: block `i` of a request covers tokens `[i*B, i*B + tokens[i])`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from proxima.formats import HOT, Format

ProbeStatus = Literal["ok", "failing"]


def pool_pressure(free_blocks: float, pending_blocks: float, total_blocks: int) -> float:
    """Used fraction of a pool of `total_blocks`, counting the `pending_blocks` that waiting
    allocations need as used, in [0, 1] (an empty pool: 0). The one definition: the engine's
    snapshot and the live API's stats both report it."""
    if total_blocks == 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - (free_blocks - pending_blocks) / total_blocks))


@dataclass(frozen=True)
class RequestBlocks:
    """One request's logical blocks, as the KV manager knows them."""

    request_id: str
    importance: Sequence[float]
    """Per block: EMA of attention mass received (higher = more important)."""
    formats: Sequence[Format]
    """Per block: current format (HOT for uncompressed)."""
    tokens: Sequence[int]
    """Per block: tokens stored (B for full blocks; the tail may be partial)."""
    age: Sequence[int] | None = None
    """Per block: engine steps since the block was filled (older first on ties). Default: by position."""
    shared: Sequence[bool] | None = None
    """Per block: True if the block is shared with other requests (prefix cache)."""
    in_prefill: bool = False
    """True while the request's prompt is still being prefilled: none of its blocks is touched."""


@dataclass(frozen=True)
class Snapshot:
    """The pool and every resident request's blocks, flattened into parallel arrays."""

    total_blocks: int
    free_blocks: float
    """Whole blocks in a real pool; a target's virtual pool counts them fractionally
    (`target.VirtualPool`)."""
    block_size: int
    request_ids: tuple[str, ...]
    formats: tuple[Format, ...]
    """Format table; `block_format` indexes into it. formats[0] is always HOT."""
    block_request: np.ndarray  # int32 [N]: index into request_ids
    block_index: np.ndarray  # int32 [N]: logical position within its request
    block_importance: np.ndarray  # float64 [N]
    block_format: np.ndarray  # int16 [N]: index into formats
    block_tokens: np.ndarray  # int32 [N]
    block_age: np.ndarray  # int64 [N]
    block_shared: np.ndarray  # bool [N]
    request_tokens: np.ndarray  # int64 [R]: total tokens per request
    request_blocks: np.ndarray  # int32 [R]: logical blocks per request
    request_prefill: np.ndarray  # bool [R]
    pending_blocks: float = 0
    """Blocks that allocations waiting this step need (a compression can make room for them)."""
    queued_blocks: float = 0
    """Blocks the requests queued behind those need (not pressure yet): the demand still to come
    this episode, which the engine's settled price anticipates (`engine.settled_price`)."""
    probe_status: ProbeStatus = "ok"

    def __post_init__(self) -> None:
        if not 0 <= self.free_blocks <= self.total_blocks:
            raise ValueError(f"free_blocks must be in [0, total_blocks={self.total_blocks}], got {self.free_blocks}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not self.formats or not self.formats[0].is_hot:
            raise ValueError("formats[0] must be the hot (bf16) format")
        n = len(self.block_request)
        for name in ("block_index", "block_importance", "block_format", "block_tokens", "block_age", "block_shared"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, expected {n} (one per block)")

    @property
    def num_blocks(self) -> int:
        return len(self.block_request)

    @property
    def pressure(self) -> float:
        """Used fraction of the pool, counting blocks that waiting allocations need (`pool_pressure`)."""
        return pool_pressure(self.free_blocks, self.pending_blocks, self.total_blocks)

    @classmethod
    def build(
        cls,
        *,
        total_blocks: int,
        free_blocks: float,
        block_size: int,
        requests: Sequence[RequestBlocks],
        pending_blocks: float = 0,
        queued_blocks: float = 0,
        probe_status: ProbeStatus = "ok",
    ) -> Snapshot:
        fmt_index: dict[Format, int] = {HOT: 0}
        req_col, idx_col, imp_col, fmt_col, tok_col, age_col, sh_col = [], [], [], [], [], [], []
        req_tokens, req_blocks, req_prefill = [], [], []
        for r, req in enumerate(requests):
            n = len(req.importance)
            if len(req.formats) != n or len(req.tokens) != n:
                raise ValueError(
                    f"request {req.request_id}: importance, formats and tokens must have one entry per block "
                    f"(got {n}, {len(req.formats)}, {len(req.tokens)})"
                )
            for f in req.formats:
                fmt_index.setdefault(f, len(fmt_index))
            req_col.append(np.full(n, r, dtype=np.int32))
            idx_col.append(np.arange(n, dtype=np.int32))
            imp_col.append(np.asarray(req.importance, dtype=np.float64))
            fmt_col.append(np.fromiter((fmt_index[f] for f in req.formats), dtype=np.int16, count=n))
            tok_col.append(np.asarray(req.tokens, dtype=np.int32))
            age = req.age if req.age is not None else range(n - 1, -1, -1)
            age_col.append(np.asarray(age, dtype=np.int64))
            sh_col.append(np.asarray(req.shared if req.shared is not None else [False] * n, dtype=bool))
            req_tokens.append(int(sum(req.tokens)))
            req_blocks.append(n)
            req_prefill.append(req.in_prefill)

        def cat(cols: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(cols) if cols else np.zeros(0, dtype=dtype)

        return cls(
            total_blocks=total_blocks,
            free_blocks=free_blocks,
            block_size=block_size,
            request_ids=tuple(r.request_id for r in requests),
            formats=tuple(fmt_index),
            block_request=cat(req_col, np.int32),
            block_index=cat(idx_col, np.int32),
            block_importance=cat(imp_col, np.float64),
            block_format=cat(fmt_col, np.int16),
            block_tokens=cat(tok_col, np.int32),
            block_age=cat(age_col, np.int64),
            block_shared=cat(sh_col, bool),
            request_tokens=np.asarray(req_tokens, dtype=np.int64),
            request_blocks=np.asarray(req_blocks, dtype=np.int32),
            request_prefill=np.asarray(req_prefill, dtype=bool),
            pending_blocks=pending_blocks,
            queued_blocks=queued_blocks,
            probe_status=probe_status,
        )
