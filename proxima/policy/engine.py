"""The decision engine: `decide(snapshot, policy, state) -> Decision`, a pure function.

Given the pool (a `Snapshot`), the live `Policy` and the engine's `EngineState` (active band,
fallback level), it returns which blocks to (re)compress into which format, and the next state.
No I/O, no tensors, no clocks: the same inputs always give the same decision.

The choice is a multiple-choice knapsack: every eligible block may take one format from the
active band's ladder; a format with pack ratio r frees (1/r_now - 1/r) of a physical block and
costs importance x (damage(new) - damage(now)). We want at least `need` blocks freed at the least
total cost, touching at most `budget` blocks. The engine solves it greedily in two phases:

1. each block's most *efficient* option (least cost per block freed) is ranked, and blocks are
   taken in that order until the need is met or the budget is spent; a block is offered the
   rung the pool's price puts it on (`settled_price`: its present savings, this step's need and
   the queue's demand) where that is harsher, so a cold block is written once rather than
   climbing the ladder one rung per step;
2. if the need is still unmet, chosen blocks are upgraded to higher-ratio formats, cheapest
   increment (extra cost per extra block freed) first.

Both phases are vectorised with numpy (no Python loop over blocks). At 10k blocks
the whole call takes well under a millisecond (`bench/engine_speed.py`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from proxima.formats import Format
from proxima.policy.schema import Band, Policy
from proxima.policy.snapshot import Snapshot

# Blocks with no measured importance must still cost something to damage, or every format would
# look free and the engine would jump straight to the harshest one.
_IMPORTANCE_FLOOR_FRACTION = 0.05
_IMPORTANCE_FLOOR_ABS = 1e-9
_PRICE_BISECTIONS = 48
"""Halvings of the settled price's bracket: 2^-48 of the top price, below any importance step."""


@dataclass(frozen=True)
class EngineState:
    """What the engine remembers between steps (kept by the caller, replaced by each decision)."""

    active_band: int | None = None
    """Index into `policy.bands` of the band in force, or None below every band."""
    fallback_level: int = 0
    """Index into `policy.fallback.levels`, set by the fallback ladder."""
    step: int = 0


@dataclass(frozen=True)
class Action:
    """Recompress one logical block of one request."""

    request_id: str
    block_index: int
    from_format: Format
    to_format: Format
    freed: float
    """Physical blocks this action frees, amortised over packing (1/r_from - 1/r_to)."""
    predicted_damage: float


@dataclass(frozen=True)
class Decision:
    """The engine's answer for one step."""

    state: EngineState
    pressure: float
    band: str | None
    need_blocks: float
    """Physical blocks to free to reach the band's target (0 when none is needed)."""
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Chosen blocks, as row indices into the snapshot's block arrays."""
    target_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per chosen row, the index into `ladder` of the format to compress it into."""
    ladder: tuple[Format, ...] = ()
    freed: np.ndarray = field(default_factory=lambda: np.zeros(0))
    damage: np.ndarray = field(default_factory=lambda: np.zeros(0))
    reason: str = ""
    snapshot: Snapshot | None = field(default=None, repr=False, compare=False)

    @property
    def targets(self) -> tuple[Format, ...]:
        """Per chosen row, the format to compress it into."""
        return tuple(self.ladder[int(i)] for i in self.target_ids)

    @property
    def expected_freed(self) -> float:
        return float(self.freed.sum())

    @property
    def predicted_damage(self) -> float:
        return float(self.damage.sum())

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def actions(self) -> list[Action]:
        """The decision as a list of `Action`s (built on demand; the arrays are the fast form)."""
        snap = self.snapshot
        if snap is None:
            return []
        return [
            Action(
                request_id=snap.request_ids[int(snap.block_request[row])],
                block_index=int(snap.block_index[row]),
                from_format=snap.formats[int(snap.block_format[row])],
                to_format=fmt,
                freed=float(fr),
                predicted_damage=float(dm),
            )
            for row, fmt, fr, dm in zip(self.rows, self.targets, self.freed, self.damage, strict=True)
        ]

    def counts_by_format(self) -> dict[str, int]:
        ids, counts = np.unique(self.target_ids, return_counts=True)
        return {self.ladder[int(i)].name: int(c) for i, c in zip(ids, counts, strict=True)}


def select_band(bands: list[Band], pressure: float, active: int | None) -> int | None:
    """Hysteresis: rise to the highest band entered; fall one band at a time below `exit`."""
    rising = None
    for i, band in enumerate(bands):
        if pressure >= band.enter:
            rising = i
    if active is not None and active >= len(bands):
        active = len(bands) - 1  # the policy lost bands in a live swap
    if active is None or (rising is not None and rising > active):
        return rising
    cur: int | None = active
    while cur is not None and pressure < bands[cur].exit:
        cur = cur - 1 if cur > 0 else None
    return cur


def eligible_mask(snap: Snapshot, policy: Policy) -> np.ndarray:
    """Blocks the engine may touch: DESIGN.md's invariants, as one boolean array over blocks.

    Per request the eligible positions form one range [lo, hi): `lo` skips the attention sinks
    (a block starting before `sink_tokens`), `hi` stops before the recent window and the hot tail
    block (both counted in computed tokens); a request still in prefill has an empty range unless
    `protect.prefilling` is off (chunked prefill: its finished chunks are eligible). The range is
    computed per request and gathered per block, cheaper than testing every block's token span.
    """
    b = snap.block_size
    lo = -(-policy.protect.sink_tokens // b)  # first block that starts at or after the sinks
    hi = np.minimum(snap.request_blocks - 1, (snap.request_tokens - policy.protect.recent_tokens) // b)
    if policy.protect.prefilling:
        hi = np.where(snap.request_prefill, 0, hi)  # a prompt still being written is not touched
    idx = snap.block_index
    return (
        (idx >= lo)
        & (idx < hi[snap.block_request])
        & ~snap.block_shared  # prefix-cache blocks serve other requests: never in place
        & (snap.block_tokens == b)  # only full blocks
    )


def mild_mask(snap: Snapshot, policy: Policy) -> np.ndarray:
    """Blocks in a request's `protect.recent_mild_tokens` window (any of their tokens among the
    request's last N): they may take only the ladder's mildest rung. One bool per block."""
    n = policy.protect.recent_mild_tokens
    if n == 0:
        return np.zeros(len(snap.block_index), dtype=bool)
    end = (snap.block_index.astype(np.int64) + 1) * snap.block_size
    return end > (snap.request_tokens - n)[snap.block_request]


def decide(snap: Snapshot, policy: Policy, state: EngineState) -> Decision:
    """Choose this step's compression actions. Pure and deterministic."""
    pressure = snap.pressure
    next_state = replace(state, step=state.step + 1)
    if policy.is_off:
        return Decision(replace(next_state, active_band=None), pressure, None, 0.0, reason="policy off")

    band_idx = select_band(policy.bands, pressure, state.active_band)
    next_state = replace(next_state, active_band=band_idx)
    if band_idx is None:
        return Decision(next_state, pressure, None, 0.0, reason="below every band")
    band = policy.bands[band_idx]

    target_free = math.ceil(band.target_free * snap.total_blocks)
    need = float(max(0, target_free - (snap.free_blocks - snap.pending_blocks)))
    if need <= 1e-9:  # (free blocks are fractional on a target's virtual pool: rounding leftovers)
        return Decision(next_state, pressure, band.name, 0.0, reason="target reached")
    if snap.probe_status == "failing":
        return Decision(next_state, pressure, band.name, need, reason="quality probes failing: holding")

    levels = policy.fallback.levels
    level = levels[min(state.fallback_level, len(levels) - 1)]
    ladder = [f for f in band.ladder if level.permits(f)]
    if not ladder:
        return Decision(next_state, pressure, band.name, need, reason=f"fallback level {level.name!r} allows none")

    return _choose(snap, policy, ladder, need, next_state, band.name, pressure)


def _choose(
    snap: Snapshot,
    policy: Policy,
    ladder: list[Format],
    need: float,
    state: EngineState,
    band_name: str,
    pressure: float,
) -> Decision:
    # Everything about an option except the block's importance depends only on (current format,
    # target format), so it is tabulated once per call over the few formats in play; per block
    # there is then one gather and one multiply. Importance scales every option of a block alike,
    # so a block's most efficient option is a property of its current format alone.
    dmg = policy.damage
    inv_f = np.array([1.0 / f.pack_ratio for f in snap.formats])  # [F]
    dmg_f = np.array([dmg.of(f) for f in snap.formats])  # [F]
    inv_l = np.array([1.0 / f.pack_ratio for f in ladder])  # [L]
    dmg_l = np.array([dmg.of(f) for f in ladder])  # [L]
    s_tab = inv_f[:, None] - inv_l[None, :]  # [F, L] physical blocks freed by the move
    # A move exists only if the block's stored data can become the target (a merged block merges
    # further, it cannot be sparsified or un-merged): `Policy.can_recompress`, the rule the
    # integrations' stores and kernels enforce, so that no integration has to substitute.
    reach = np.array([[policy.can_recompress(f, t) for t in ladder] for f in snap.formats], dtype=bool).reshape(
        len(snap.formats), len(ladder))
    valid = (s_tab > 1e-12) & reach
    d_tab = np.where(valid, np.maximum(dmg_l[None, :] - dmg_f[:, None], 0.0), np.inf)  # [F, L] extra damage
    with np.errstate(divide="ignore", invalid="ignore"):
        eff_tab = np.where(valid, d_tab / np.where(valid, s_tab, 1.0), np.inf)
    # Among equally efficient options prefer the one that frees more (fewer actions for the need).
    # A block in the recent-mild window (`mild_mask`) is offered the mildest rung only: its
    # options are a second copy of the tables, every other rung invalid, addressed as format
    # F + its format, so every step below stays one gather per block.
    valid_m = valid & (np.arange(len(ladder)) == 0)[None, :]
    d_tab = np.vstack([d_tab, np.where(valid_m, d_tab, np.inf)])
    eff_tab = np.vstack([eff_tab, np.where(valid_m, eff_tab, np.inf)])
    s_tab, valid = np.vstack([s_tab, s_tab]), np.vstack([valid, valid_m])
    best_l = np.argmin(eff_tab - 1e-12 * np.where(valid, s_tab, 0.0), axis=1)  # [2F]
    best_eff_f = eff_tab[np.arange(len(eff_tab)), best_l]  # [2F]
    shrinkable = np.asarray(valid.any(axis=1))  # [2F]
    block_fid = snap.block_format + len(inv_f) * mild_mask(snap, policy)

    rows = np.flatnonzero(eligible_mask(snap, policy) & shrinkable[block_fid])
    if len(rows) == 0:
        return Decision(state, pressure, band_name, need, reason="no eligible block")
    fid = block_fid[rows]
    imp = snap.block_importance[rows]
    floor = _IMPORTANCE_FLOOR_FRACTION * float(imp.mean()) + _IMPORTANCE_FLOOR_ABS
    imp = imp + floor
    best_eff = imp * best_eff_f[fid]

    k = min(policy.budget.max_blocks_per_step, len(rows))
    part = np.sort(np.argpartition(best_eff, k - 1)[:k]) if k < len(rows) else np.arange(len(rows))
    # Deterministic order: efficiency, then older blocks; lexsort is stable, so remaining ties
    # keep snapshot order (request, then position).
    order = part[np.lexsort((-snap.block_age[rows[part]], best_eff[part]))]
    # Write once: each offered block goes straight to the rung the pool's price puts it on
    # (`settled_price`: its present savings, this step's need and the queue's demand), not one
    # rung per step; the prefix that meets the need is then shorter.
    price = settled_price(snap, policy, ladder, floor, need)
    first = best_l[fid[order]]
    settled = settled_choice(imp[order], fid[order], price, s_tab, d_tab, valid)
    offer = np.where(s_tab[fid[order], settled] > s_tab[fid[order], first], settled, first)
    cum = np.cumsum(s_tab[fid[order], offer])
    take = int(np.searchsorted(cum, need - 1e-9) + 1) if cum[-1] >= need - 1e-9 else len(order)
    chosen = order[:take]
    choice = offer[:take].copy()
    total = float(cum[take - 1])

    saving = s_tab[fid[chosen]]  # [C, L]
    cost = imp[chosen, None] * d_tab[fid[chosen]]  # [C, L]
    if total < need - 1e-9:
        total = _upgrade(choice, saving, cost, need, total)

    idx = np.arange(len(chosen))
    return Decision(
        state=state,
        pressure=pressure,
        band=band_name,
        need_blocks=need,
        rows=rows[chosen].astype(np.int64),
        target_ids=choice,
        ladder=tuple(ladder),
        freed=saving[idx, choice],
        damage=cost[idx, choice],
        reason="target reachable" if total >= need - 1e-9 else "budget or eligible blocks exhausted",
        snapshot=snap,
    )


def _upgrade(choice: np.ndarray, saving: np.ndarray, cost: np.ndarray, need: float, total: float) -> float:
    """Phase 2: move chosen blocks to harsher formats, cheapest extra cost per extra block first.

    Vectorised in rounds: each round offers every chosen block its best single upgrade, ranks
    them by extra cost per extra block freed, and applies the shortest prefix that meets the
    need. A ladder of L formats needs at most L - 1 rounds.
    """
    n_opts = saving.shape[1]
    rows = np.arange(len(choice))
    for _ in range(n_opts - 1):
        s_now = saving[rows, choice]
        c_now = cost[rows, choice]
        ds = saving - s_now[:, None]  # [C, L]
        dc = cost - c_now[:, None]
        ok = ds > 1e-12
        if not ok.any():
            break
        with np.errstate(divide="ignore", invalid="ignore"):
            eff = np.where(ok, dc / np.where(ok, ds, 1.0), np.inf)
        up = np.argmin(eff - 1e-12 * ds, axis=1)
        up_eff = eff[rows, up]
        cand = np.flatnonzero(np.isfinite(up_eff))
        if len(cand) == 0:  # every harsher option is closed (unreachable, or a recent-mild block)
            break
        cand = cand[np.lexsort((cand, up_eff[cand]))]
        gain = np.cumsum(ds[cand, up[cand]])
        if total + gain[-1] >= need - 1e-9:
            k = int(np.searchsorted(gain, need - total - 1e-9) + 1)
            cand = cand[:k]
            choice[cand] = up[cand]
            return total + float(gain[k - 1])
        choice[cand] = up[cand]
        total += float(gain[-1])
    return total


def settled_price(snap: Snapshot, policy: Policy, ladder: list[Format], floor: float, need: float = 0.0) -> float:
    """The damage per physical block freed that the pool will pay once this episode's demand is
    met, as if its blocks were compressed from scratch: the least price `p` at which giving every
    eligible block the format minimising `importance x damage - p x freed` (over hot and the
    ladder, freed counted from hot) frees what the eligible blocks free now, plus this step's
    `need`, plus the blocks the queue still asks for (`Snapshot.queued_blocks`). Queued blocks are
    not in the pool yet: they are counted as blocks of the eligible blocks' importance
    distribution, which free as much per block as the eligible ones at `p` once admitted (so the
    goal is met at `(1 + queued / eligible) x freed(p) >= freed now + need + queued`). A pool with
    nothing compressed, no need and no queue pays 0.

    This is what makes a cold block's first compression its last: the old engine priced each step
    by that step's need alone, the cheapest move being hot -> the mildest rung, so on aggressive's
    four-rung ladder a block climbed one rung per step of rising pressure (3.1 compressions per
    compressed block in `proxima simulate`); pricing the pool's present savings alone still let
    blocks compressed early in a burst climb as the queue filled the pool (2.4). With the need and
    the queue in the price a new block is put where its importance places it at the depth the
    episode will reach. A falling importance or rising pressure beyond the queue's raises its
    settled rung later: it is recompressed then, and only then.
    """
    rows = np.flatnonzero(eligible_mask(snap, policy))
    if len(rows) == 0:
        return 0.0
    imp = snap.block_importance[rows] + floor
    inv_f = np.array([1.0 / f.pack_ratio for f in snap.formats])
    queued = max(0.0, float(snap.queued_blocks))
    goal = float(np.sum(1.0 - inv_f[snap.block_format[rows]])) + max(0.0, need) + queued
    scale = 1.0 + queued / len(rows)
    hull_s, slopes = _hull(ladder, policy)
    if len(slopes) == 0 or goal <= 0:
        return 0.0
    # A block at price p sits past hull vertex k exactly when importance <= p / slope_k (slopes
    # increase), so the freed total is sum_k (freed_k+1 - freed_k) x #{importance <= p / slope_k}:
    # with the importances sorted once, each evaluation is K binary searches. It is a step
    # function of p, increasing: bisect p (to float resolution; the price need not be a step).
    imp_sorted = np.sort(imp)
    gains = np.diff(hull_s) * scale

    def freed_at(p: float) -> float:
        with np.errstate(divide="ignore"):  # a damage-free rung (slope 0): every block passes it
            return float(gains @ np.searchsorted(imp_sorted, p / slopes, side="right"))

    hi = float(imp_sorted[-1] * slopes[-1])
    if hi <= 0.0 or freed_at(hi) < goal - 1e-9:
        return hi  # the ladder cannot free that much: everything at its harshest
    lo = 0.0  # invariant: freed_at(hi) >= goal
    for _ in range(_PRICE_BISECTIONS):
        mid = 0.5 * (lo + hi)
        if freed_at(mid) >= goal - 1e-9:
            hi = mid
        else:
            lo = mid
    return hi


def settled_choice(imp: np.ndarray, fid: np.ndarray, price: float, s_tab: np.ndarray, d_tab: np.ndarray,
                   valid: np.ndarray) -> np.ndarray:
    """Per block (importance `imp`, current format `fid`), the ladder index reachable from its
    format that minimises `importance x extra damage - price x blocks freed` at `price`."""
    score = imp[:, None] * d_tab[fid] - price * s_tab[fid]
    return np.argmin(np.where(valid[fid], score, np.inf), axis=1)


def _hull(ladder: list[Format], policy: Policy) -> tuple[np.ndarray, np.ndarray]:
    """The lower convex hull of (blocks freed from hot, damage) over hot and the ladder: the
    freed amount at each hull vertex (hot first) and the slope entering each vertex after hot
    (damage per block freed, increasing). The formats a price-minimising block ever takes."""
    pts = sorted({(1.0 - 1.0 / f.pack_ratio, policy.damage.of(f)) for f in ladder if f.pack_ratio > 1.0})
    hull = [(0.0, 0.0)]
    for s, d in pts:
        if s <= hull[-1][0] + 1e-12:
            continue  # (sorted by freed: only equal-freed points with more damage get here)
        while len(hull) >= 2 and (d - hull[-2][1]) * (hull[-1][0] - hull[-2][0]) <= (hull[-1][1] - hull[-2][1]) * (
                s - hull[-2][0]):
            hull.pop()
        hull.append((s, d))
    freed = np.array([h[0] for h in hull])
    slopes = np.array([(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(hull)])
    return freed, slopes
