"""Per-sequence compression targets: "store this sequence's KV r times smaller, in bytes".

Pressure drives Proxima in serving; a target drives it for one sequence: the quality harness
(`ProximaCache.apply_policy(target_ratio=r)`) and a vLLM request that asks for it
(`SamplingParams(extra_args={"proxima_target_ratio": r})`, `integration/vllm/targets.py`). Both
reach a target the same way, with the functions here (pure: no torch, no vLLM):

1. the live policy's engine (`decide`) runs on a *virtual pool* holding only that sequence, sized
   so that its top band's `target_free` means a store r times smaller (`pool_for_ratio`), until
   it has nothing left to do;
2. pack ratios overstate bytes by the metadata (int4 packs 4x, holds 3.2x at group 32), so a
   trial that ends short is redone from the same start with the ask raised by the shortfall, at
   most `BYTE_PASSES` trials (`reach_ratio`); the first trial that reaches r (else the last) is
   kept.

A trial is the integration's: the HF cache compresses a fork of itself (the probe may refuse
blocks, and its bytes are the payloads'); the vLLM scheduler cannot compress and undo, so it
predicts the engine's formats (`simulate`) and their bytes (`held_ratio`) from the slot specs,
then plans the kept trial's formats at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from proxima.formats import HOT, Format
from proxima.policy.engine import EngineState, decide
from proxima.policy.schema import Policy
from proxima.policy.snapshot import ProbeStatus, RequestBlocks, Snapshot

BYTE_PASSES = 3
"""Trials per target (the first asks for r itself)."""
MAX_ENGINE_STEPS = 32
"""Engine calls per trial (one usually suffices: a call may touch `budget.max_blocks_per_step` blocks)."""
REACHED = 1 - 1e-3
"""A trial within 0.1% of the target has reached it (byte counts are integers; ratios are not)."""

T = TypeVar("T")


def used_blocks(formats: Sequence[Format]) -> float:
    """Physical blocks a sequence uses, amortised over packing: sum of 1 / pack ratio (a partial
    tail block counts as a whole hot block, as in vLLM's pool)."""
    return sum(1.0 / f.pack_ratio for f in formats)


def pool_for_ratio(logical_blocks: int, policy: Policy, ratio: float) -> int:
    """A pool whose top band's target (`target_free` of it left free) leaves room for
    `logical_blocks / ratio` blocks (at pack ratios) and no more: the largest such pool at or
    below an estimate two blocks over the exact size."""
    if not ratio >= 1.0 or not math.isfinite(ratio):
        raise ValueError(f"a target ratio must be a finite number >= 1, got {ratio!r}")
    tf = policy.bands[-1].target_free
    budget = logical_blocks / ratio
    total = max(1, math.ceil(budget / (1 - tf)) + 2)
    while total > 1 and total - math.ceil(tf * total) > budget + 1e-9:
        total -= 1
    return total


def virtual_snapshot(seq: RequestBlocks, total_blocks: int, block_size: int,
                     probe_status: ProbeStatus = "ok") -> Snapshot:
    """The engine's view of a pool of `total_blocks` that holds only `seq` (its free blocks are
    what its blocks leave, at their pack ratios)."""
    free = max(0, min(total_blocks, math.floor(total_blocks - used_blocks(seq.formats) + 1e-9)))
    return Snapshot.build(total_blocks=total_blocks, free_blocks=free, block_size=block_size,
                          requests=[seq], probe_status=probe_status)


def simulate(seq: RequestBlocks, policy: Policy, total_blocks: int, block_size: int,
             state: EngineState | None = None, probe_status: ProbeStatus = "ok",
             caps: Mapping[int, Format] | None = None) -> list[Format]:
    """The formats the engine leaves `seq`'s blocks in on a virtual pool of `total_blocks`, if
    every action it plans is written as planned (the engine offers only the moves a block's
    stored data allows, `Policy.can_recompress`). `caps`: block -> the harshest format the
    compression-time probe accepted for it; a move past its cap lands on the cap (as the vLLM
    manager plans it), and the block is not offered again."""
    formats = list(seq.formats)
    shared = list(seq.shared) if seq.shared is not None else [False] * len(formats)
    caps = caps or {}
    st = state or EngineState()
    for _ in range(MAX_ENGINE_STEPS):
        cur = RequestBlocks(seq.request_id, seq.importance, formats, seq.tokens, seq.age, shared, seq.in_prefill)
        dec = decide(virtual_snapshot(cur, total_blocks, block_size, probe_status), policy, st)
        st = dec.state
        changed = False  # a move, or a capped block taken out of the offer: the next call differs
        for a in dec.actions:
            i, to = a.block_index, a.to_format
            cap = caps.get(i)
            if cap is not None and cap.pack_ratio < to.pack_ratio and not shared[i]:
                to, shared[i], changed = cap, True, True
            if to.pack_ratio > formats[i].pack_ratio and (formats[i].is_hot or policy.can_recompress(formats[i], to)):
                formats[i] = to
                changed = True
        if not changed:
            break
    return formats


def held_ratio(formats: Sequence[Format], tokens: Sequence[int], block_size: int,
               held_bytes: Callable[[Format], float]) -> float:
    """16-bit KV bytes of a sequence over the bytes it is held in (the ratio every table reports):
    a compressed block costs `held_bytes(fmt)` (data and metadata), a hot one its tokens at 16 bits.
    `held_bytes(HOT)` is a full hot block's bytes."""
    per_token = held_bytes(HOT) / block_size
    kv16 = per_token * sum(tokens)
    held = sum(per_token * n if f.is_hot else held_bytes(f) for f, n in zip(formats, tokens, strict=True))
    return 1.0 if held <= 0 else kv16 / held


def reach_ratio(target: float, trial: Callable[[float], T], achieved: Callable[[T], float],
                acted: Callable[[T], bool]) -> T:
    """Run `trial(ask)` from the same start with ask = target, then raised by each shortfall (by
    its square when a raise changed nothing), at most `BYTE_PASSES` times; return the first trial
    that reaches `target` (or did nothing: a higher ask would not do more), else the last."""
    ask = target
    out = trial(ask)
    last = 0.0
    for _ in range(BYTE_PASSES - 1):
        got = achieved(out)
        if got >= target * REACHED or not acted(out) or got <= 0:
            break
        raise_by = target / got
        if got <= last * (1 + 1e-9):
            # The last raise landed on the same step (the engine frees whole blocks): raising by
            # the same shortfall again would waste the trial; square it instead.
            raise_by *= raise_by
        last = got
        ask *= raise_by
        out = trial(ask)
    return out
