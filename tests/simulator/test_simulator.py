import json
from pathlib import Path

import pytest

from proxima.policy.loader import load_policy
from proxima.simulator.report import compare
from proxima.simulator.sim import PoolConfig, SimulationError, Simulator
from proxima.simulator.workload import RequestSpec, TraceError, WorkloadConfig, load_trace, synthetic

CONFIGS = Path(__file__).parents[2] / "proxima" / "policies"
SMALL = PoolConfig(total_blocks=256, block_size=16)
WL = WorkloadConfig(num_requests=24, prompt_min=256, prompt_max=512, output_min=32, output_max=96)


def test_vanilla_accounting_and_completion() -> None:
    wl = synthetic(WL, seed=1)
    res = Simulator(SMALL, None).run(wl)  # run() checks accounting and leaks at the end
    assert res.finished == len(wl)
    # No compression: resident requests are bounded by what fits uncompressed.
    min_blocks = min((r.prompt_tokens + 1 + 15) // 16 for r in wl)
    assert res.peak_resident_requests <= SMALL.total_blocks // min_blocks


@pytest.mark.parametrize("name", ["conservative", "balanced", "aggressive"])
def test_policies_beat_vanilla(name: str) -> None:
    wl = synthetic(WL, seed=2)
    cmp = compare(SMALL, load_policy(CONFIGS / f"{name}.yaml"), wl, seed=2)
    assert cmp.policy.finished == cmp.baseline.finished == len(wl)
    assert cmp.policy.peak_resident_requests > cmp.baseline.peak_resident_requests
    assert cmp.policy.steps < cmp.baseline.steps
    assert sum(cmp.policy.decisions_by_format.values()) > 0


def test_off_policy_equals_vanilla() -> None:
    wl = synthetic(WL, seed=3)
    cmp = compare(SMALL, load_policy(CONFIGS / "off.yaml"), wl, seed=3)
    assert cmp.policy.summary() == cmp.baseline.summary()


def test_deterministic_for_a_seed() -> None:
    wl = synthetic(WL, seed=4)
    pol = load_policy(CONFIGS / "balanced.yaml")
    a = Simulator(SMALL, pol, seed=4).run(wl).summary()
    b = Simulator(SMALL, pol, seed=4).run(wl).summary()
    assert a == b


def test_request_larger_than_pool_is_an_error() -> None:
    with pytest.raises(SimulationError, match="needs 64 blocks"):
        Simulator(PoolConfig(total_blocks=10, block_size=16), None).run([RequestSpec("big", 0, 1000, 24)])


def test_trace_loading(tmp_path: Path) -> None:
    good = tmp_path / "t.jsonl"
    good.write_text(
        '{"arrival": 0, "prompt_tokens": 100, "output_tokens": 5}\n'
        "\n"
        '{"id": "x", "prompt_tokens": 7, "output_tokens": 1}\n'
    )
    reqs = load_trace(good)
    assert [(r.request_id, r.arrival, r.prompt_tokens) for r in reqs] == [("req-1", 0, 100), ("x", 0, 7)]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt_tokens": 1, "output_tokens": 1}\n{"prompt_tokens": "many", "output_tokens": 1}\n')
    with pytest.raises(TraceError, match=r"b.jsonl:2: field 'prompt_tokens' must be an integer"):
        load_trace(bad)
    bad.write_text('{"prompt_tokens": 1,\n')
    with pytest.raises(TraceError, match=r"b.jsonl:1:\d+: invalid JSON"):
        load_trace(bad)


def test_json_report_shape() -> None:
    cmp = compare(SMALL, load_policy(CONFIGS / "balanced.yaml"), synthetic(WL, 5), seed=5)
    data = json.loads(json.dumps(cmp.to_json()))
    for side in ("baseline", "policy"):
        assert {"peak_resident_requests", "mean_resident_requests", "steps"} <= set(data[side])


def test_placement_invariants_are_checked_every_step() -> None:
    """The simulator places compressed blocks with the vLLM manager's model and asserts its
    invariants after each step: a slot the simulator lost track of is caught at once."""
    wl = synthetic(WL, seed=6)
    sim = Simulator(SMALL, load_policy(CONFIGS / "balanced.yaml"), seed=6)
    sim.start(wl)
    while not any(r.slots for r in sim.running):
        sim.step()
    victim = next(r for r in sim.running if r.slots)
    # No in-place compression: every compressed block went to a destination, never to its source.
    assert all(b not in victim.hot for b, _ in victim.slots.values())
    victim.slots.popitem()
    with pytest.raises(AssertionError, match=f"request {victim.spec.request_id}: (live slots|destination)"):
        sim.step()


def test_admission_keeps_the_destination_reserve() -> None:
    """With a policy, a request is admitted only if `DEST_RESERVE_BLOCKS` stay free after it
    (the vLLM manager's rule); vanilla admits down to the last block."""
    from proxima.placement import DEST_RESERVE_BLOCKS

    pool = PoolConfig(total_blocks=10, block_size=16)
    two = [RequestSpec("a", 0, 16 * 4, 1), RequestSpec("b", 0, 16 * (6 - DEST_RESERVE_BLOCKS + 1), 1)]
    for policy, admitted in ((None, 2), (load_policy(CONFIGS / "balanced.yaml"), 1)):
        sim = Simulator(pool, policy)
        sim.start(two)
        sim.step()
        assert len(sim.running) == admitted
