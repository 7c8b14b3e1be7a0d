"""Per-sequence targets (`proxima.policy.target`): the pool sizing, the engine trial, the bytes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from proxima.compression.spec import slot_spec
from proxima.formats import HOT, Format
from proxima.policy import target
from proxima.policy.loader import load_policy
from proxima.policy.snapshot import RequestBlocks

ROOT = Path(__file__).resolve().parents[2]
AGGRESSIVE = load_policy(ROOT / "configs" / "aggressive.yaml")
B = 64


def _held(fmt: Format) -> float:
    """One block of SmolLM2's shape (3 KV heads, head_dim 64, one layer), data and metadata."""
    return slot_spec(fmt, block_size=B, head_dim=64, num_kv_heads=3).held_bytes_per_slot


def _seq(n: int, tail: int = 10) -> RequestBlocks:
    imp = [1.0 / (1 + i) for i in range(n)] + [1.0]
    return RequestBlocks("seq", imp, [HOT] * (n + 1), [B] * n + [tail])


@pytest.mark.parametrize("ratio", [1.5, 2.0, 4.0, 8.0])
def test_the_virtual_pool_makes_the_top_bands_target_the_ratio(ratio: float) -> None:
    """At the pool's size, the top band's target leaves room for the sequence `ratio` times
    smaller (in blocks) and no more than a block over; one block more would leave more room."""
    n = 65
    total = target.pool_for_ratio(n, AGGRESSIVE, ratio)
    tf = AGGRESSIVE.bands[-1].target_free

    def room(t: int) -> int:
        return t - math.ceil(tf * t)

    assert n / ratio - 1 < room(total) <= n / ratio + 1e-9
    assert room(total + 1) >= room(total)


@pytest.mark.parametrize("bad", [0.5, -1.0, math.nan, math.inf])
def test_a_ratio_below_one_or_not_finite_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="finite number >= 1"):
        target.pool_for_ratio(10, AGGRESSIVE, bad)


def test_simulate_compresses_without_pressure_and_spares_the_protected_blocks() -> None:
    seq = _seq(40)
    total = target.pool_for_ratio(41, AGGRESSIVE, 3.0)
    formats = target.simulate(seq, AGGRESSIVE, total, B)
    assert formats[-1] == HOT  # the tail
    sinks = -(-AGGRESSIVE.protect.sink_tokens // B)
    assert all(f == HOT for f in formats[:sinks])
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
    assert asks == pytest.approx([4.0, 16 / 3, 16 / 3 * (4 / 3) ** 2])


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
    free = target.simulate(seq, AGGRESSIVE, target.pool_for_ratio(n, AGGRESSIVE, 3.0), B)
    merged = [i for i, f in enumerate(free) if f.reduction is not None]
    caps = {i: int4 for i in merged[:10]}

    def trial(ask: float) -> list[Format]:
        return target.simulate(seq, AGGRESSIVE, target.pool_for_ratio(n, AGGRESSIVE, ask), B, caps=caps)

    def ratio(formats: list[Format]) -> float:
        return target.held_ratio(formats, seq.tokens, B, _held)

    kept = target.reach_ratio(3.0, trial, achieved=ratio, acted=lambda f: True)
    assert all(kept[i] in (HOT, int4) for i in caps)
    assert ratio(kept) >= 3.0 * target.REACHED
