"""The KV manager the product runs, driven through random request lifecycles (no engine).

A real vLLM `KVCacheManager` is built in-process on CPU and turned into Proxima's; hypothesis
plays the scheduler and the worker: admit, grow (prefill chunks, decode tokens), plan
(`build_plan`) and report each plan ok or failed (as a worker would, a step later or at once),
preempt, abort, finish. After every step the placement invariants (`proxima.placement.model`)
are checked against vLLM's own pool (`check_accounting`), and at the end every block is free.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from proxima.integration.vllm.plan import ProximaPlan, ProximaReport
from proxima.integration.vllm.scheduler.manager import ProximaKVCacheManager, install
from proxima.policy.loader import load_policy

ROOT = Path(__file__).resolve().parents[4]
B = 32
BLOCKS = 40  # 39 usable
POLICIES = {name: load_policy(ROOT / "proxima" / "policies" / f"{name}.yaml") for name in ("balanced", "aggressive")}


def _manager(policy_name: str) -> ProximaKVCacheManager:
    spec = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    m = install(KVCacheManager(cfg, max_model_len=2048, scheduler_block_size=B, hash_block_size=B,
                               enable_caching=False), POLICIES[policy_name])
    assert m is not None
    return m


# (kind, request, size): admissions and growth weighted up, so that most sequences reach pressure.
KINDS = ["admit"] * 3 + ["grow"] * 6 + ["preempt", "abort", "finish", "deferred_free"]
op = st.tuples(st.sampled_from(KINDS), st.integers(0, 7), st.integers(1, 2 * B))
# One engine step: the scheduler's hooks, then the plan and the worker's report: ok, failed,
# half and half, or late (with the next step's report, as under async scheduling).
step = st.tuples(st.lists(op, min_size=1, max_size=6), st.sampled_from(["ok", "ok", "failed", "late", "mixed"]))


class _Scheduler:
    """Just enough of vLLM's scheduler and worker to drive the manager's hooks in their order."""

    def __init__(self, m: ProximaKVCacheManager) -> None:
        self.m = m
        self.running: list[Request] = []
        self.scheduled: dict[str, int] = {}  # this step's tokens per request (allocated, not computed)
        self.late: list[ProximaPlan] = []  # plans whose report comes a step later (async scheduling)
        self.n = 0
        self.recompressions = 0

    def admit(self, _: int, size: int) -> None:
        blocks = 2 + size % 13
        self.n += 1
        req = Request(f"r{self.n}", list(range(1, blocks * B + 1)), SamplingParams(max_tokens=512), None)
        if self.m.allocate_slots(req, blocks * B) is not None:
            self.running.append(req)
            self.scheduled[req.request_id] = blocks * B  # the whole prompt in this step

    def grow(self, i: int, tokens: int) -> None:
        """Schedule `tokens` more tokens of a running request (one decode token, or several as
        with speculative decoding), as vLLM's scheduler allocates them before the forward."""
        if not self.running:
            return
        req = self.running[i % len(self.running)]
        if req.request_id in self.scheduled:
            return
        missing = req.num_computed_tokens + tokens - req.num_tokens
        if missing > 0:
            req.append_output_token_ids([7] * missing)
        if self.m.allocate_slots(req, tokens) is not None:
            self.scheduled[req.request_id] = tokens

    def step(self, outcome: str) -> None:
        """End of schedule (plan), the forward (scheduled tokens computed, one sampled), the report."""
        plan = self.m.build_plan(list(self.scheduled))
        self.recompressions += sum(not a.from_fmt.is_hot for a in plan.actions)
        self.m.check_accounting()
        for req in self.running:
            n = self.scheduled.pop(req.request_id, 0)
            if n:
                req.num_computed_tokens += n
                if req.num_computed_tokens >= req.num_tokens:
                    req.append_output_token_ids(7)
        self.scheduled.clear()
        if outcome == "late":
            self.late.append(plan)
            return
        for p in [*self.late, plan]:
            ids = [a.action_id for a in p.actions]
            if outcome == "ok":
                rep = ProximaReport(ok=ids)
            elif outcome == "failed":
                rep = ProximaReport(failed=ids, errors=["RuntimeError: injected"] if ids else [])
            else:
                rep = ProximaReport(ok=ids[::2], failed=ids[1::2])
            self.m.apply_report(rep)
            self.m.check_accounting()
        self.late = []

    def _take(self, i: int) -> Request | None:
        if not self.running:
            return None
        req = self.running.pop(i % len(self.running))
        self.scheduled.pop(req.request_id, None)
        return req

    def preempt(self, i: int, _: int = 0) -> None:
        if (req := self._take(i)) is not None:
            self.m.free(req)  # not finished: vLLM's recompute preemption

    def abort(self, i: int, _: int = 0) -> None:
        if (req := self._take(i)) is not None:
            req.status = RequestStatus.FINISHED_ABORTED
            self.m.free(req)

    def finish(self, i: int, _: int = 0) -> None:
        if (req := self._take(i)) is not None:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            self.m.free(req)

    def deferred_free(self, i: int, _: int = 0) -> None:
        """vLLM's async path: pop the request's blocks now, free them after the step."""
        if (req := self._take(i)) is not None:
            req.status = RequestStatus.FINISHED_STOPPED
            blocks = self.m.pop_blocks_for_free(req)
            self.m.block_pool.free_blocks(reversed(blocks))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(sorted(POLICIES)), steps=st.lists(step, min_size=20, max_size=40))
def test_accounting_holds_through_any_request_lifecycle(policy: str, steps: list[tuple[list[tuple], str]]) -> None:
    m = _manager(policy)
    s = _Scheduler(m)
    for ops, outcome in steps:
        for kind, i, size in ops:
            getattr(s, kind)(i, size)
            m.check_accounting()
        s.step(outcome)
    stats = m.px.stats
    event(f"committed: {min(stats.committed, 1)}, failed: {min(stats.failed, 1)}, "
          f"recompressed: {min(s.recompressions, 1)}, "
          f"preempted: {min(stats.preemptions, 1)}")  # (--hypothesis-show-statistics: what was reached)
    s.step("ok")  # the last plans report; then everything goes
    while s.running:
        s.finish(0)
    m.check_accounting()
    assert not m.px.ledger and not m.px.in_flight and not m.px.packer.owned()
    assert m.block_pool.get_num_free_blocks() == BLOCKS - 1  # nothing leaked


def test_the_sequences_reach_compression() -> None:
    """The property test is worth only what it exercises: a plain pressured lifecycle compresses,
    recompresses a block, and frees destinations through the scrub path."""
    m = _manager("balanced")
    s = _Scheduler(m)
    s.admit(0, 10)  # 12 blocks
    s.admit(0, 10)
    s.step("ok")
    for _ in range(6):
        s.grow(0, B)
        s.grow(1, B)
        s.step("ok")
    assert m.px.stats.committed > 0 and m.px.packer.owned()
    dests = m.px.packer.owned()
    s.finish(0)
    s.finish(0)
    assert set(m.build_plan([]).scrub) == dests
    m.check_accounting()
