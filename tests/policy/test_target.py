"""Per-sequence targets (`proxima.policy.target`): the pool sizing, the engine trial, the bytes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from proxima.compression.spec import slot_spec
from proxima.formats import HOT, Format
from proxima.policy import target
from proxima.policy.engine import EngineState, decide
from proxima.policy.loader import load_policy
from proxima.policy.snapshot import RequestBlocks

ROOT = Path(__file__).resolve().parents[2]
AGGRESSIVE = load_policy(ROOT / "proxima" / "policies" / "aggressive.yaml")
B = 64


def _held(fmt: Format) -> float:
    """One block of SmolLM2's shape (3 KV heads, head_dim 64, one layer), data and metadata."""
    return slot_spec(fmt, block_size=B, head_dim=64, num_kv_heads=3).held_bytes_per_slot


def _seq(n: int, tail: int = 10) -> RequestBlocks:
    imp = [1.0 / (1 + i) for i in range(n)] + [1.0]
    return RequestBlocks("seq", imp, [HOT] * (n + 1), [B] * n + [tail])


@pytest.mark.parametrize("ratio", [1.5, 2.0, 4.0, 8.0])
def test_the_virtual_pool_makes_the_top_bands_target_the_ratio(ratio: float) -> None:
    """The smallest pool whose top band's target leaves the sequence room for `ratio` times
    smaller (in blocks); the rest of that room is asked for as pending blocks, so the engine's
    need is exactly the blocks over the budget, whatever the pool's whole-block steps."""
    n = 65
    pool = target.pool_for_ratio(n, AGGRESSIVE, ratio)
    tf = AGGRESSIVE.bands[-1].target_free

    def room(t: int) -> int:
        return t - math.ceil(tf * t)

    assert room(pool.total_blocks) >= n / ratio - 1e-9 > room(pool.total_blocks - 1)
    assert pool.budget == pytest.approx(n / ratio)
    assert pool.pending_blocks == pytest.approx(room(pool.total_blocks) - n / ratio)
    merged = Format.parse("cluster(2)+int4")  # n logical blocks, all but the tail merged: they fit the pool
    seq = _seq(n - 1)
    seq = RequestBlocks(seq.request_id, seq.importance, [merged] * (n - 1) + [HOT], seq.tokens)
    used = target.used_blocks(seq.formats)
    snap = target.virtual_snapshot(seq, pool, B)
    assert used <= snap.total_blocks
    need = decide(snap, target.engine_policy(AGGRESSIVE, pool), EngineState()).need_blocks
    assert need == pytest.approx(max(0.0, used - n / ratio))  # used - budget, to the fraction of a block
    # a real pool (whole blocks) keeps its free blocks whole
    assert target.virtual_snapshot(seq, pool.total_blocks, B).free_blocks == math.floor(pool.total_blocks - used)


def test_asks_a_fraction_of_a_block_apart_compress_differently() -> None:
    """With whole free blocks, every ask between two block steps gave the same formats (and a
    raise past a step compressed the whole request harder); the exact budget moves with the ask."""
    seq = _seq(7)  # a 512-token request at block 64: 8 logical blocks, the budget moves by 0.1-0.4 of one
    n = len(seq.formats)
    asks = (4.0, 4.3, 4.6, 5.0)
    pol = AGGRESSIVE
    assert pol.protect.sink_tokens == 0  # a hot sink block alone would hold 1/8 of this request

    def used(pool: int | target.VirtualPool) -> float:
        return target.used_blocks(target.simulate(seq, pol, pool, B))

    exact = [used(target.pool_for_ratio(n, pol, a)) for a in asks]
    assert all(u <= n / a + 1e-9 for u, a in zip(exact, asks, strict=True))
    assert len(set(exact)) >= 3
    # the same pools counted in whole free blocks: the last three asks land on one store
    whole = [used(target.pool_for_ratio(n, pol, a).total_blocks) for a in asks]
    assert len(set(whole)) < len(set(exact))


@pytest.mark.parametrize("bad", [0.5, -1.0, math.nan, math.inf])
def test_a_ratio_below_one_or_not_finite_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="finite number >= 1"):
        target.pool_for_ratio(10, AGGRESSIVE, bad)


def test_simulate_compresses_without_pressure_and_spares_the_protected_blocks() -> None:
    seq = _seq(40)
    # aggressive protects nothing but the tail; with 100 sink tokens its first two blocks stay hot
    pol = AGGRESSIVE.model_copy(update={"protect": AGGRESSIVE.protect.model_copy(update={"sink_tokens": 100})})
    pool = target.pool_for_ratio(41, pol, 3.0)
    formats = target.simulate(seq, pol, pool, B)
    assert formats[-1] == HOT  # the tail
    sinks = -(-pol.protect.sink_tokens // B)
    assert sinks == 2 and all(f == HOT for f in formats[:sinks])
    assert target.used_blocks(formats) <= 41 / 3.0 + 1  # the pool's target, in blocks at pack ratios
    assert sum(not f.is_hot for f in formats) > 20


def test_held_ratio_counts_metadata_and_hot_tokens() -> None:
    int4 = Format.parse("int4")
    assert target.held_ratio([HOT, HOT], [B, 10], B, _held) == pytest.approx(1.0)
    # int4 packs 4x; its scales and zero points make it 3.2x at group 32 (docs/compression.md)
    assert target.held_ratio([int4], [B], B, _held) == pytest.approx(16 / 5)
    mixed = target.held_ratio([int4, HOT], [B, B], B, _held)
    assert mixed == pytest.approx(2 * _held(HOT) / (_held(int4) + _held(HOT)))


def test_reach_ratio_raises_the_ask_by_the_shortfall_and_keeps_the_first_that_reaches() -> None:
    asks: list[float] = []

    def trial(ask: float) -> float:  # a store that reaches 80% of what it is asked for
        asks.append(ask)
        return 0.8 * ask

    got = target.reach_ratio(4.0, trial, achieved=lambda r: r, acted=lambda r: True)
    assert asks == pytest.approx([4.0, 5.0])  # 3.2 -> asked 4 x 4/3.2; 4.0 reached: stop
    assert got == pytest.approx(4.0)
    asks.clear()
    target.reach_ratio(4.0, lambda a: (asks.append(a), 1.0)[1], achieved=lambda r: r, acted=lambda r: False)
    assert asks == [4.0]  # a trial that did nothing is kept: asking for more would not help
    asks.clear()
    target.reach_ratio(4.0, lambda a: (asks.append(a), 2.0)[1], achieved=lambda r: r, acted=lambda r: True)
    # never reached: BYTE_PASSES trials, then the last; the second raise changed nothing, so the
    # third squares the shortfall (4 -> 8 -> 8 x 2^2)
    assert asks == pytest.approx([4.0, 8.0, 32.0])
    assert len(asks) == target.BYTE_PASSES
    asks.clear()

    def stepped(a: float) -> float:  # a step function: asks of 4 and 5.33 land on the same block step
        asks.append(a)
        return 3.0 if a < 6 else 4.2

    assert target.reach_ratio(4.0, stepped, achieved=lambda r: r, acted=lambda r: True) == 4.2
    hi = 16 / 3 * (4 / 3) ** 2
    assert asks[:3] == pytest.approx([4.0, 16 / 3, hi])
    # 4.2 is more than CLOSE_ENOUGH over 4: REFINE_PASSES bisection trials between 16/3 and hi,
    # none of which does better than 4.2 here (the third falls short)
    assert len(asks) == 3 + target.REFINE_PASSES
    assert asks[3] == pytest.approx((16 / 3 * hi) ** 0.5)
    assert all(16 / 3 < a < hi for a in asks[3:])


def test_raising_goes_on_into_the_refine_trials_while_nothing_has_reached() -> None:
    """A store whose bytes trail its asks (here ask^0.8) under-corrects every raise: 3.03, 3.78,
    3.96 after BYTE_PASSES trials, short; the next raise reaches 4. A store that cannot go
    further stops once a squared raise changed nothing either."""
    asks: list[float] = []

    def trailing(a: float) -> float:
        asks.append(a)
        return a**0.8

    got = target.reach_ratio(4.0, trailing, achieved=lambda r: r, acted=lambda r: True)
    assert got >= 4.0 * target.REACHED
    assert target.BYTE_PASSES < len(asks) <= target.BYTE_PASSES + target.REFINE_PASSES
    assert trailing(asks[target.BYTE_PASSES - 1]) < 4.0 * target.REACHED  # where the raises used to stop
    asks.clear()
    target.reach_ratio(4.0, lambda a: (asks.append(a), min(a, 3.0))[1], achieved=lambda r: r, acted=lambda r: True)
    assert asks == pytest.approx([4.0, 4.0 * 4 / 3, 4.0 * 4 / 3 * (4 / 3) ** 2])  # 3.0, 3.0 (squared), 3.0: stop


def test_an_overshooting_raise_is_refined_down_to_the_closest_reaching_trial() -> None:
    """Formats differ in how far their pack ratio overstates their bytes, so a raised ask can
    overshoot the target by a lot (aggressive's ladder, then the `merge` candidate, asked for 8x
    held 9.4x); bisecting between the last short ask and the reaching one keeps the reaching
    trial closest to the target."""
    asks: list[float] = []

    def steps(a: float) -> float:
        asks.append(a)
        return 3.0 if a < 5.5 else 4.1 if a < 8 else 6.0

    # 4 -> 3.0, 5.33 -> 3.0 (same step: the shortfall is squared), 9.48 -> 6.0: reached, 1.5x over
    got = target.reach_ratio(4.0, steps, achieved=lambda r: r, acted=lambda r: True)
    assert got == 4.1
    assert steps(asks[2]) == 6.0  # without refining, 6.0 would have been kept
    asks.clear()
    # a reaching trial within CLOSE_ENOUGH is kept at once
    assert target.reach_ratio(4.0, lambda a: (asks.append(a), 4.05 if a > 4.5 else 3.5)[1],
                              achieved=lambda r: r, acted=lambda r: True) == 4.05
    assert len(asks) == 2
    asks.clear()
    # the first trial reaching (no short ask to bisect from) is kept as it is, however far over
    assert target.reach_ratio(4.0, lambda a: (asks.append(a), 7.0)[1], achieved=lambda r: r,
                              acted=lambda r: True) == 7.0
    assert asks == [4.0]


def test_the_bytes_trials_reach_a_target_the_pack_ratios_alone_miss() -> None:
    """A single trial at the ask stops short in bytes (pack ratios overstate them); the raised ask
    reaches the target, and stops there instead of compressing everything."""
    seq = _seq(60)
    n = len(seq.formats)

    def trial(ask: float) -> list[Format]:
        return target.simulate(seq, AGGRESSIVE, target.pool_for_ratio(n, AGGRESSIVE, ask), B)

    def ratio(formats: list[Format]) -> float:
        return target.held_ratio(formats, seq.tokens, B, _held)

    once = ratio(trial(3.0))
    assert once < 3.0 * target.REACHED
    kept = ratio(target.reach_ratio(3.0, trial, achieved=ratio, acted=lambda f: True))
    assert 3.0 * target.REACHED <= kept < ratio(trial(8.0))


def test_a_capped_block_lands_on_its_cap_and_the_trials_ask_for_more_elsewhere() -> None:
    """The probe's caps (vLLM's `RequestEntry.caps`): a block capped at int4 is never predicted
    harsher, so the bytes trials raise the ask until the other blocks make up the difference."""
    seq = _seq(60)
    n, int4 = len(seq.formats), Format.parse("int4")
    # at 5x aggressive merges (at 3x int4 alone is enough, and there would be nothing to cap)
    free = target.simulate(seq, AGGRESSIVE, target.pool_for_ratio(n, AGGRESSIVE, 5.0), B)
    merged = [i for i, f in enumerate(free) if f.reduction is not None]
    caps = {i: int4 for i in merged[:10]}
    assert len(caps) == 10

    def trial(ask: float) -> list[Format]:
        return target.simulate(seq, AGGRESSIVE, target.pool_for_ratio(n, AGGRESSIVE, ask), B, caps=caps)

    def ratio(formats: list[Format]) -> float:
        return target.held_ratio(formats, seq.tokens, B, _held)

    kept = target.reach_ratio(5.0, trial, achieved=ratio, acted=lambda f: True)
    assert all(kept[i] in (HOT, int4) for i in caps)
    assert ratio(kept) >= 5.0 * target.REACHED


def test_a_virtual_pool_runs_the_top_band_whatever_its_pressure() -> None:
    """A sequence already merged to cluster(2)+int4 (but for its hot tail) and asked for 8x sits
    below aggressive's lowest band (0.60) on its virtual pool: as written the engine does nothing
    there; on the target's pool every band applies at any pressure, so the top band merges
    further (cluster(4)+int4 or cluster(8)+int4) down to the budget."""
    merged = Format.parse("cluster(2)+int4")
    base = _seq(40)
    seq = RequestBlocks("seq", base.importance, [merged] * 40 + [HOT], base.tokens)
    n = len(seq.formats)
    pool = target.pool_for_ratio(n, AGGRESSIVE, 8.0)
    assert target.virtual_snapshot(seq, pool, B).pressure < min(b.enter for b in AGGRESSIVE.bands)
    out = target.simulate(seq, AGGRESSIVE, pool, B)
    assert any(f.reduction_ratio > 2 for f in out) and target.used_blocks(out) <= pool.budget + 1e-9
    # the same pool in whole blocks under the policy as written: below every band, nothing moves
    assert target.simulate(seq, AGGRESSIVE, pool.total_blocks, B) == list(seq.formats)
    assert target.engine_policy(AGGRESSIVE, pool.total_blocks) is AGGRESSIVE
