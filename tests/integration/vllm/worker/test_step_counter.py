"""The worker's step counter (`worker/step_counter.py`): a sampled step of the real `apply` counts
what `bench/step_ops.py` counts for the same plan, one compressing step in `every` is measured,
nothing is measured when the switch is off, and the counts reach the scheduler's stats file."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench.step_ops import Shape, Workload, accepting_probe, without_probe
from proxima.integration.vllm.plan import ProximaReport, merge_reports
from proxima.integration.vllm.scheduler.stats import ProximaStats, step_counters
from proxima.integration.vllm.worker import step_counter
from proxima.integration.vllm.worker.step_counter import STEP_COUNTERS_ENV, StepCounter, StepSample
from proxima.integration.vllm.worker.store import WorkerStore
from proxima.integration.vllm.worker.timing import TIME_SPLIT_ENV
from proxima.policy.loader import load_policy

SHAPE = dict(heads=1, block_size=16, head_dim=32, blocks=32)


def _sampled_apply(work: Workload, g: int) -> list[dict[str, int]]:
    """Group g's plan as the connector runs it (`bind_connector_metadata`): the step starts, the
    apply runs in a region, the report carries the sample."""
    work.reset()
    store = work.store
    plan = work.plans[g]
    store.counter.start_step(bool(plan.actions))
    with store.counter.region(store.device):
        store.apply(plan)
    rep = store.take_report()
    assert rep is not None and not rep.failed, rep
    return rep.step_counts


@pytest.mark.parametrize("probe", [without_probe, accepting_probe])
def test_a_sampled_step_counts_what_step_ops_counts_for_the_same_plan(probe: Any) -> None:
    work = Workload(probe(load_policy("balanced")), Shape(layers=2, **SHAPE), "cpu", per_group=2, kernels="triton")
    work.store.counter = StepCounter(enabled=True, every=1)
    for g, (src, dst) in enumerate(work.groups):
        counted = work.apply_counted(g)  # bench/step_ops.py's number for this plan
        samples = _sampled_apply(work, g)
        want = {"launches": counted.device_kernels, "memcpys": counted.uploads, "syncs": counted.total_syncs}
        assert samples == [want], (src, dst, samples, want)
        assert counted.total_launches >= 1  # the Triton kernels ran, not the torch reference


def test_nothing_is_measured_when_the_switch_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIME_SPLIT_ENV, raising=False)
    monkeypatch.delenv(STEP_COUNTERS_ENV, raising=False)
    work = Workload(without_probe(load_policy("aggressive")), Shape(layers=2, **SHAPE), "cpu", per_group=1)
    assert not work.store.counter.enabled  # the store's own counter, as the engine builds it

    def never(*_: Any) -> None:
        raise AssertionError("measured with the switch off")

    monkeypatch.setattr(step_counter.OpCounter, "__enter__", never)
    monkeypatch.setattr(step_counter, "measure_cuda", never)
    for g in range(len(work.groups)):
        assert _sampled_apply(work, g) == []


def test_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STEP_COUNTERS_ENV, raising=False)
    monkeypatch.setenv(TIME_SPLIT_ENV, "1")
    assert WorkerStore().counter.enabled  # the benchmark's step split turns it on
    monkeypatch.setenv(STEP_COUNTERS_ENV, "0")
    assert not WorkerStore().counter.enabled  # ... unless turned off explicitly
    monkeypatch.delenv(TIME_SPLIT_ENV)
    monkeypatch.setenv(STEP_COUNTERS_ENV, "1")
    assert WorkerStore().counter.enabled


def test_one_compressing_step_in_every_is_sampled_never_the_first() -> None:
    c = StepCounter(enabled=True, every=64)
    sampled = []
    for step in range(400):
        compresses = step % 2 == 0  # steps that compress nothing are neither counted nor sampled
        if c.start_step(compresses):
            sampled.append(step)
            with c.region(None):
                torch.ones(2).add_(1)
    assert [s // 2 + 1 for s in sampled] == [2, 66, 130, 194]  # the compressing steps' numbers
    samples = c.take()
    assert len(samples) == 4 and all(s == {"launches": 2, "memcpys": 0, "syncs": 0} for s in samples)
    assert c.take() == []


def test_nested_regions_count_once_and_an_unsampled_step_nothing() -> None:
    c = StepCounter(enabled=True, every=1)
    c.start_step(True)
    with c.region(None):
        torch.ones(2).add_(1)
        with c.region(None):
            _ = torch.ones(2).sum().item()  # a would-be sync
    c.start_step(False)
    with c.region(None):
        torch.ones(3).mul_(2)
    assert c.take() == [{"launches": 4, "memcpys": 0, "syncs": 1}]


def test_the_counts_reach_the_stats_file_as_medians() -> None:
    a = ProximaReport(step_counts=[{"launches": 4, "memcpys": 1, "syncs": 0},
                                   {"launches": 9, "memcpys": 1, "syncs": 0}])
    b = ProximaReport(step_counts=[{"launches": 6, "memcpys": 1, "syncs": 2}])
    merged = merge_reports(a, b)  # tensor parallelism: per step, the busiest rank
    assert merged.step_counts == [{"launches": 6, "memcpys": 1, "syncs": 2}, {"launches": 9, "memcpys": 1, "syncs": 0}]
    assert merge_reports(b, a).step_counts == merged.step_counts
    stats = ProximaStats()
    stats.record_counts(merged.step_counts)
    stats.record_counts([StepSample(3, 2, 0).as_dict()])
    assert step_counters(stats.step_counts) == {"launches_per_step": 6, "memcpys_per_step": 1,
                                                "syncs_per_step": 0, "counted_steps": 3}
    assert step_counters([]) == {}  # no sampled step: the keys are absent (the step file says why)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: the profiler's CUDA kernels and sync warnings")
def test_on_cuda_kernels_copies_and_syncs_are_measured() -> None:
    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    c = StepCounter(enabled=True, every=1)
    c.start_step(True)
    previous = torch.cuda.get_sync_debug_mode()
    with c.region(x.device):
        y = x * 2 + 1
        _ = y.sum().item()  # a sync (and its device-to-host copy)
    assert torch.cuda.get_sync_debug_mode() == previous
    (s,) = c.take()
    assert s["launches"] >= 3 and s["memcpys"] >= 1 and s["syncs"] >= 1, s
