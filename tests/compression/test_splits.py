"""The split-count model of the decode kernel (pure Python)."""

import pytest

from proxima.compression.triton_attention import choose_splits


def _cost(programs: int, tiles: int, slots: int, sp: int) -> int:
    return -(-(programs * sp) // slots) * (-(-tiles // sp) + 2)


@pytest.mark.parametrize("programs", [1, 3, 8, 64, 256, 1024])
@pytest.mark.parametrize("tiles", [1, 7, 64, 512, 2048])
@pytest.mark.parametrize("slots", [132, 264, 396])
def test_choice_is_the_best_of_every_count_up_to_eight_waves(programs, tiles, slots):
    got = choose_splits(programs, tiles, slots)
    assert 1 <= got <= tiles
    best = min(_cost(programs, tiles, slots, sp) for sp in range(1, tiles + 1) if programs * (sp - 1) <= 8 * slots)
    assert _cost(programs, tiles, slots, got) == best


def test_one_full_wave_when_it_fits():
    # 8 sequences x 8 KV heads on 132 SMs x 3 programs: 6 splits fill 384 of 396 slots
    assert choose_splits(64, 512, 396) == 6
    # a lone sequence with little context: one split per tile at most
    assert choose_splits(8, 3, 396) == 3
