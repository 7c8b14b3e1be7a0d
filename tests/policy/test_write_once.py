"""A cold block is written once on a burst too (issue 37 item 4): the engine's settled price counts
this step's need and the queue's demand (`Snapshot.queued_blocks`), so a block compressed early
in a burst is put where the episode will end rather than climbing as the queue fills the pool.

"Before" is the same `decide` with the price fed neither (the present savings alone, as the
engine priced until 2026-12-06): the comparison on the code the product runs."""

import dataclasses

import pytest

from proxima.policy import engine
from proxima.policy.loader import load_policy
from proxima.simulator.sim import PoolConfig, RunResult, Simulator
from proxima.simulator.workload import RequestSpec

_settled_price = engine.settled_price


def _present_savings_only(snap, policy, ladder, floor, need=0.0):  # type: ignore[no-untyped-def]
    return _settled_price(dataclasses.replace(snap, queued_blocks=0), policy, ladder, floor, 0.0)


def _throughput(policy: str, before: bool, monkeypatch: pytest.MonkeyPatch) -> RunResult:
    """The 8B throughput workload's shape (bench/capacity_runs.py): 16 requests of 2,048 + 1,024
    tokens at once on a pool of two full requests."""
    if before:
        monkeypatch.setattr(engine, "settled_price", _present_savings_only)
    wl = [RequestSpec(f"r{i}", 0, 2048, 1024) for i in range(16)]
    res = Simulator(PoolConfig(total_blocks=2 * 3072 // 16, block_size=16), load_policy(policy), 0).run(wl)
    monkeypatch.undo()
    return res


def test_aggressive_writes_each_block_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    now = _throughput("aggressive", False, monkeypatch)
    before = _throughput("aggressive", True, monkeypatch)
    assert now.compressions / now.blocks_compressed <= 1.3, now.summary()
    assert before.compressions / before.blocks_compressed > 1.3, before.summary()  # what this changed
    # The same capacity; the damage of a settled pool, not more than a few percent above.
    assert now.peak_resident_requests == before.peak_resident_requests
    assert now.mean_resident_requests >= before.mean_resident_requests * 0.99
    assert now.predicted_damage <= before.predicted_damage * 1.05


@pytest.mark.parametrize("policy", ["conservative", "balanced"])
def test_milder_policies_keep_their_capacity(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Conservative and balanced hold as many requests as before, within 2%, and finish no later."""
    now = _throughput(policy, False, monkeypatch)
    before = _throughput(policy, True, monkeypatch)
    assert now.mean_resident_requests >= before.mean_resident_requests * 0.98, (now.summary(), before.summary())
    assert now.peak_resident_requests >= before.peak_resident_requests
    assert now.steps <= before.steps * 1.02
    assert now.compressions / now.blocks_compressed <= before.compressions / before.blocks_compressed + 1e-9
