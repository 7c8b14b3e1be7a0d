"""Per-sequence compression targets: "store this sequence's KV r times smaller, in bytes".

Pressure drives Proxima in serving; a target drives it for one sequence: the quality harness
(`ProximaCache.apply_policy(target_ratio=r)`) and a vLLM request that asks for it
(`SamplingParams(extra_args={"proxima_target_ratio": r})`, `integration/vllm/targets.py`). Both
reach a target the same way, with the functions here (pure: no torch, no vLLM):

1. the live policy's engine (`decide`) runs on a *virtual pool* holding only that sequence, sized
   so that its top band's `target_free` means a store r times smaller (`pool_for_ratio`), until
   it has nothing left to do;
2. pack ratios overstate bytes by the metadata (int4 packs 4x, holds 3.2x at group 32), so a
   trial that ends short is redone from the same start with the ask raised by the shortfall
   (`reach_ratio`, `BYTE_PASSES` + `REFINE_PASSES` trials at most). A raised ask can overshoot by
   a lot (formats differ in how much their pack ratio overstates their bytes: cluster(8)+int4
   packs 32x and holds about 20x), so when it does, the trials left bisect between the last ask
   that fell short and the one that reached; the reaching trial with the smallest ratio is kept
   (else the last trial).

A trial is the integration's: the HF cache compresses a fork of itself (the probe may refuse
blocks, and its bytes are the payloads'); the vLLM scheduler cannot compress and undo, so it
predicts the engine's formats (`simulate`) and their bytes (`held_ratio`) from the slot specs,
then plans the kept trial's formats at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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
REFINE_PASSES = 3
"""Trials beyond `BYTE_PASSES`: more raises while none has reached, then bisection after a raised
ask overshot the target by more than `CLOSE_ENOUGH`."""
CLOSE_ENOUGH = 1.02
"""A reaching trial at most 2% over the target is kept without refining: a block's format step
moves a short sequence's ratio by more than that anyway. (Asked for 8x, the `merge` candidate
landed at 9.4x on average before refining: quality paid for bytes nobody asked to save.)"""

T = TypeVar("T")


def used_blocks(formats: Sequence[Format]) -> float:
    """Physical blocks a sequence uses, amortised over packing: sum of 1 / pack ratio (a partial
    tail block counts as a whole hot block, as in vLLM's pool)."""
    return sum(1.0 / f.pack_ratio for f in formats)


@dataclass(frozen=True)
class VirtualPool:
    """The pool a target's engine runs on: `total_blocks` physical blocks holding only the
    sequence, and `pending_blocks` asked for by a virtual waiting allocation, so that the top
    band's `target_free` is met exactly when the sequence uses `budget` blocks at pack ratios.

    Free blocks are counted fractionally here (a real pool's are whole): the engine's need is then
    `used - budget`, continuous in the ask. With whole blocks the ask moved the budget in steps of
    one block, 25% of a 1k-token request at block 64, and a raise past a step compressed the whole
    request harder (asked for 4x, a 512-token context ended at 6x).

    The need is exact once the sequence fits the pool. A hot prompt asked for more than about
    1 / (1 - target_free) uses more blocks than the pool holds: free is 0 until then, and each
    engine call frees the top band's share of the pool, so `simulate` takes several calls
    (`MAX_ENGINE_STEPS` at most; aggressive at 16x on 256 blocks: 15) to reach the budget."""

    total_blocks: int
    pending_blocks: float
    budget: float


def pool_for_ratio(logical_blocks: int, policy: Policy, ratio: float) -> VirtualPool:
    """The smallest pool whose top band's target (`target_free` of it left free) leaves the
    sequence at least `logical_blocks / ratio` blocks (at pack ratios), with the difference asked
    for as pending blocks, so that the engine's target is that budget exactly."""
    if not ratio >= 1.0 or not math.isfinite(ratio):
        raise ValueError(f"a target ratio must be a finite number >= 1, got {ratio!r}")
    tf = policy.bands[-1].target_free
    budget = logical_blocks / ratio

    def room(t: int) -> int:
        return t - math.ceil(tf * t)

    total = max(1, math.floor(budget / (1 - tf)) - 2)
    while room(total) < budget - 1e-9:
        total += 1
    return VirtualPool(total, max(0.0, room(total) - budget), budget)


def engine_policy(policy: Policy, pool: int | VirtualPool) -> Policy:
    """The policy the engine runs on `pool`: as written on a real pool; on a target's virtual pool
    with every band entered at any pressure, so the top band (whose `target_free` the pool is
    sized for) always applies. Live pressure is what bands and their hysteresis are about; a
    virtual pool has none, and its pressure falls towards 1 - target_free as the sequence nears
    its budget: a second round of a vLLM target (after the probe refused blocks) started at 0.599,
    below aggressive's lowest band, and compressed nothing. Unvalidated copies on purpose (the
    schema refuses bands that enter at 0)."""
    if not isinstance(pool, VirtualPool):
        return policy
    bands = [b.model_copy(update={"enter": 0.0, "exit": 0.0}) for b in policy.bands]
    return policy.model_copy(update={"bands": bands})


def virtual_snapshot(seq: RequestBlocks, pool: int | VirtualPool, block_size: int,
                     probe_status: ProbeStatus = "ok") -> Snapshot:
    """The engine's view of a pool that holds only `seq`: a real pool of `pool` whole blocks (its
    free blocks are the whole blocks `seq`'s leave, at their pack ratios), or a target's
    `VirtualPool` (free blocks counted fractionally, its pending blocks waiting)."""
    used = used_blocks(seq.formats)
    if isinstance(pool, VirtualPool):
        total, pending = pool.total_blocks, pool.pending_blocks
        free: float = max(0.0, min(float(total), total - used))
    else:
        total, pending = pool, 0.0
        free = max(0, min(total, math.floor(total - used + 1e-9)))
    return Snapshot.build(total_blocks=total, free_blocks=free, block_size=block_size,
                          requests=[seq], pending_blocks=pending, probe_status=probe_status)


def simulate(seq: RequestBlocks, policy: Policy, pool: int | VirtualPool, block_size: int,
             state: EngineState | None = None, probe_status: ProbeStatus = "ok",
             caps: Mapping[int, Format] | None = None) -> list[Format]:
    """The formats the engine leaves `seq`'s blocks in on `pool` (`virtual_snapshot`), if
    every action it plans is written as planned (the engine offers only the moves a block's
    stored data allows, `Policy.can_recompress`). `caps`: block -> the harshest format the
    compression-time probe accepted for it; a move past its cap lands on the cap (as the vLLM
    manager plans it), and the block is not offered again."""
    formats = list(seq.formats)
    shared = list(seq.shared) if seq.shared is not None else [False] * len(formats)
    caps = caps or {}
    st = state or EngineState()
    policy = engine_policy(policy, pool)
    for _ in range(MAX_ENGINE_STEPS):
        cur = RequestBlocks(seq.request_id, seq.importance, formats, seq.tokens, seq.age, shared, seq.in_prefill)
        dec = decide(virtual_snapshot(cur, pool, block_size, probe_status), policy, st)
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
    its square when a raise changed nothing), until a trial reaches `target`, did nothing (a
    higher ask would not do more) or two raises in a row changed nothing (the ladder is spent).
    If a raised ask reached it with more than `CLOSE_ENOUGH` to spare, bisect the ask
    (geometrically) between the last short ask and the reaching one. At most `BYTE_PASSES` +
    `REFINE_PASSES` trials in all: raising may use the refine trials while none has reached (a
    raise by the shortfall under-corrects where the formats' bytes trail their pack ratios).
    Returns the reaching trial with the smallest ratio (the first of equals: the lowest ask), else
    the last trial."""
    most = BYTE_PASSES + REFINE_PASSES
    ask = target
    out = trial(ask)
    trials, last, flat = 1, 0.0, 0
    short_ask: float | None = None
    while trials < most:
        got = achieved(out)
        if got >= target * REACHED or not acted(out) or got <= 0:
            break
        raise_by = target / got
        if got <= last * (1 + 1e-9):
            # The last raise landed on the same step (the engine frees whole blocks): raising by
            # the same shortfall again would waste the trial; square it instead, and stop when
            # the squared raise changed nothing either.
            flat += 1
            if flat >= 2:
                break
            raise_by *= raise_by
        else:
            flat = 0
        last = got
        short_ask = ask
        ask *= raise_by
        out = trial(ask)
        trials += 1
    best_got = achieved(out)
    if short_ask is None or best_got < target * REACHED or best_got <= target * CLOSE_ENOUGH:
        return out
    # Invariant: trial(lo) fell short, trial(hi) reached; `out` is the best reaching trial so far.
    lo, hi = short_ask, ask
    while trials < most:
        mid = math.sqrt(lo * hi)
        cand = trial(mid)
        trials += 1
        got = achieved(cand)
        if got < target * REACHED:
            lo = mid
            continue
        hi = mid
        if got <= best_got:
            out, best_got = cand, got
        if best_got <= target * CLOSE_ENOUGH:
            break
    return out
