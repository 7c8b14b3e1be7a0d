"""The waiting queue's demand as the KV manager prices it (`scheduler/queue_demand.py`).

A stand-in scheduler with vLLM's two attributes the reader uses (`waiting`, iterable in queue
order; `max_num_running_reqs`); the binding to vLLM's real scheduler is checked end to end
(`test_vllm_e2e.py::test_the_waiting_queue_is_priced_in`)."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import pytest

from proxima.integration.vllm.scheduler.queue_demand import QueueDemand, binding_scheduler


@dataclass
class _Req:
    num_tokens: int


@dataclass
class _Sched:
    waiting: list[_Req] = field(default_factory=list)
    max_num_running_reqs: int = 8


def test_sums_the_prompts_blocks_behind_the_head() -> None:
    s = _Sched([_Req(100), _Req(64), _Req(1)])  # 4 + 2 + 1 blocks of 32
    q = QueueDemand(s)
    assert q.blocks(32, resident=0, limit=1000, head_counted=False) == 7
    assert q.blocks(32, resident=0, limit=1000, head_counted=True) == 3  # the head is in the pending need


def test_only_requests_that_can_still_get_a_slot_count() -> None:
    s = _Sched([_Req(32)] * 10, max_num_running_reqs=8)
    q = QueueDemand(s)
    assert q.blocks(32, resident=5, limit=1000, head_counted=False) == 3
    assert q.blocks(32, resident=5, limit=1000, head_counted=True) == 2  # the head takes one of the 3
    assert q.blocks(32, resident=8, limit=1000, head_counted=False) == 0


def test_the_sum_stops_at_the_limit() -> None:
    s = _Sched([_Req(32 * 50)] * 1000, max_num_running_reqs=10**6)
    assert QueueDemand(s).blocks(32, resident=0, limit=120, head_counted=False) == 120


def test_a_scheduler_gone_or_without_a_queue_asks_nothing() -> None:
    q = QueueDemand(_Sched([_Req(320)]))
    gc.collect()  # the only reference was the argument: held weakly, it is gone
    assert q.blocks(32, resident=0, limit=100, head_counted=False) == 0

    class _NoQueue:
        pass

    keep = _NoQueue()
    assert QueueDemand(keep).blocks(32, resident=0, limit=100, head_counted=False) == 0


def test_binding_scheduler_accepts_only_a_vllm_scheduler() -> None:
    from vllm.v1.core.sched.interface import SchedulerInterface

    class _Binder:
        def bind(self) -> object | None:
            return binding_scheduler()  # (depth 2: the caller of `bind` is `__init__` below)

    class _NotAScheduler:
        def __init__(self) -> None:
            self.found = _Binder().bind()

    assert _NotAScheduler().found is None

    class _Scheduler(SchedulerInterface):
        def __init__(self) -> None:
            self.found = _Binder().bind()

    _Scheduler.__abstractmethods__ = frozenset()  # a bare subclass: only its type is checked
    s = _Scheduler()
    assert s.found is s


if __name__ == "__main__":
    pytest.main([__file__])
