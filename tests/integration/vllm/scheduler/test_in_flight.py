"""The in-flight ledger (`scheduler/in_flight.py`) through random sequences of plan / send /
commit / fail / drop, against a plain model of what each action's state should be; and its
`check()` catching the inconsistencies it exists to prevent, in the type and in the KV manager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from proxima.formats import Format
from proxima.integration.vllm.plan import ActionId, CompressAction, ProximaReport
from proxima.integration.vllm.scheduler.in_flight import InFlight
from proxima.integration.vllm.scheduler.ledger import RequestEntry, RequestLedger
from proxima.integration.vllm.scheduler.manager import install
from proxima.placement import BlockId, SlotIndex
from proxima.policy.loader import load_policy

INT4 = Format.parse("int4")

ROOT = Path(__file__).resolve().parents[4]
REQUESTS = 3
BLOCKS = 4


def _entry(rid: str) -> RequestEntry:
    return RequestEntry(Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), None))


class _Model:
    """The in-flight ledger as plain sets, and the ledger it keeps in step, driven by the test."""

    def __init__(self) -> None:
        self.ledger = RequestLedger()
        self.fl = InFlight(self.ledger)
        self.pending: dict[ActionId, CompressAction] = {}
        self.sent: set[ActionId] = set()
        self.in_prefill: set[ActionId] = set()
        self.unsent_order: list[ActionId] = []
        self.revoked: list[CompressAction] = []
        self.dropped: list[str] = []
        self.ever_sent: set[ActionId] = set()
        self.ever: dict[ActionId, CompressAction] = {}

    def admit(self, r: int, _: int) -> None:
        rid = f"r{r}"
        if rid not in self.ledger:
            self.ledger[rid] = _entry(rid)

    def plan(self, r: int, b: int, in_prefill: bool) -> None:
        rid = f"r{r}"
        entry = self.ledger.get(rid)
        if entry is None:
            return
        aid = self.fl.next_id()
        assert aid not in self.ever  # ids are never reused
        ca = CompressAction(aid, rid, b, BlockId(10 + b), BlockId(100 + r), SlotIndex(b), INT4)
        if b in entry.in_flight:
            with pytest.raises(ValueError, match="already has action"):
                self.fl.plan(ca, in_prefill=in_prefill)
            return
        self.fl.plan(ca, in_prefill=in_prefill)
        self.pending[aid] = self.ever[aid] = ca
        self.unsent_order.append(aid)
        if in_prefill:
            self.in_prefill.add(aid)

    def send(self) -> None:
        out = self.fl.send()
        assert [a.action_id for a in out.actions] == self.unsent_order
        assert not {a.action_id for a in out.actions} & self.ever_sent  # never sent twice
        assert out.revoked == self.revoked and out.dropped == self.dropped
        self.sent.update(self.unsent_order)
        self.ever_sent.update(self.unsent_order)
        self.unsent_order, self.revoked, self.dropped = [], [], []

    def _pick(self, k: int) -> ActionId | None:
        """An action to report: one ever sent (pending or not: a late report), else none."""
        ids = sorted(self.ever_sent)
        return ids[k % len(ids)] if ids else None

    def _leave(self, aid: ActionId) -> None:
        self.pending.pop(aid, None)
        self.sent.discard(aid)
        self.in_prefill.discard(aid)
        if aid in self.unsent_order:
            self.unsent_order.remove(aid)

    def commit(self, k: int, _: int) -> None:
        aid = self._pick(k)
        if aid is None:
            return
        was = self.pending.get(aid)
        in_prefill = aid in self.in_prefill
        done = self.fl.commit(aid)
        if was is None:
            assert done is None
        else:
            assert done is not None and done.action is was and done.in_prefill == in_prefill
            assert was.index not in self.ledger[was.req_id].in_flight
        self._leave(aid)

    def fail(self, k: int, n: int) -> None:
        ids = [aid for i in range(n % 3 + 1) if (aid := self._pick(k + i)) is not None]
        expect = sorted({aid: self.pending[aid] for aid in ids if aid in self.pending}.values(),
                        key=lambda a: (a.dst, -a.slot))
        got = self.fl.fail(ids)
        assert got == expect
        for aid in ids:
            self._leave(aid)
        self.revoked.extend(got)

    def drop(self, r: int, _: int) -> None:
        entry = self.ledger.pop(f"r{r}", None)  # as `ProximaState.release`: the entry leaves first
        if entry is None:
            return
        self.fl.drop(entry)
        for a in entry.in_flight.values():
            self._leave(a.action_id)
        self.dropped.append(entry.request.request_id)

    def agree(self) -> None:
        """The invariant holds, and the type says what the model says."""
        self.fl.check()
        assert bool(self.fl) == bool(self.pending) and len(self.fl) == len(self.pending)
        assert [a.action_id for a in self.fl] == list(self.pending)
        assert all(self.fl.get(aid) is ca for aid, ca in self.pending.items())
        assert all(self.fl.get(aid) is None for aid in self.ever.keys() - self.pending.keys())
        assert self.sent <= self.pending.keys() and self.in_prefill <= self.pending.keys()


op = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, REQUESTS - 1), st.just(0)),
    st.tuples(st.just("plan"), st.integers(0, REQUESTS - 1), st.integers(0, BLOCKS - 1), st.booleans()),
    st.tuples(st.just("send")),
    st.tuples(st.just("commit"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("fail"), st.integers(0, 50), st.integers(0, 5)),
    st.tuples(st.just("drop"), st.integers(0, REQUESTS - 1), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(op, min_size=1, max_size=60))
def test_the_invariant_holds_through_any_sequence(ops: list[tuple]) -> None:
    m = _Model()
    for name, *args in ops:
        getattr(m, name)(*args)
        m.agree()
    m.send()  # what is left goes out; then every request leaves
    for r in range(REQUESTS):
        m.drop(r, 0)
    m.agree()
    assert not m.fl and not any(e.in_flight for e in m.ledger.values())


def test_plan_refuses_an_unknown_request_and_a_reused_id() -> None:
    ledger = RequestLedger(r0=_entry("r0"))
    fl = InFlight(ledger)
    ca = CompressAction(fl.next_id(), "r0", 0, BlockId(1), BlockId(2), SlotIndex(0), INT4)
    with pytest.raises(ValueError, match="r9 is not in the ledger"):
        fl.plan(CompressAction(fl.next_id(), "r9", 0, BlockId(1), BlockId(2), SlotIndex(0), INT4), in_prefill=False)
    fl.plan(ca, in_prefill=False)
    with pytest.raises(ValueError, match="already in flight"):
        fl.plan(CompressAction(ca.action_id, "r0", 1, BlockId(3), BlockId(2), SlotIndex(1), INT4), in_prefill=False)


def test_check_finds_a_ledger_view_out_of_step() -> None:
    """What `check` exists for: an in-flight entry written behind the type's back, one removed,
    and one filed under another block, each fail it."""
    ledger = RequestLedger(r0=_entry("r0"))
    fl = InFlight(ledger)
    ca = CompressAction(fl.next_id(), "r0", 0, BlockId(1), BlockId(2), SlotIndex(0), INT4)
    fl.plan(ca, in_prefill=True)
    fl.check()
    stray = CompressAction(fl.next_id(), "r0", 1, BlockId(3), BlockId(2), SlotIndex(1), INT4)
    ledger["r0"].in_flight[1] = stray
    with pytest.raises(AssertionError, match="in flight in the ledger but not pending"):
        fl.check()
    del ledger["r0"].in_flight[1]
    del ledger["r0"].in_flight[0]
    with pytest.raises(AssertionError, match="pending but not in the ledger"):
        fl.check()
    ledger["r0"].in_flight[3] = ca
    with pytest.raises(AssertionError, match="under request r0 block 3"):
        fl.check()


def test_the_managers_accounting_check_runs_it() -> None:
    """`check_accounting` (every step under PROXIMA_CHECK_ACCOUNTING=1) asserts the in-flight
    invariant too: a manager whose ledger lost an in-flight action's view fails it."""
    b = 32
    spec = FullAttentionSpec(block_size=b, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    m = install(KVCacheManager(cfg, max_model_len=2048, scheduler_block_size=b, hash_block_size=b,
                               enable_caching=False), load_policy("balanced"))
    assert m is not None
    req = Request("a", list(range(1, 12 * b + 1)), SamplingParams(max_tokens=64), None)
    assert m.allocate_slots(req, 12 * b) is not None
    req.num_computed_tokens = 12 * b
    plan = m.build_plan([])  # 12 of 15 usable blocks: pressure plans compressions
    assert plan.actions and m.px.in_flight
    m.check_accounting()
    entry = m.px.ledger["a"]
    lost = entry.in_flight.pop(plan.actions[0].index)
    with pytest.raises(AssertionError, match="pending but not in the ledger"):
        m.check_accounting()
    entry.in_flight[lost.index] = lost
    m.apply_report(ProximaReport(ok=[a.action_id for a in plan.actions]))
    m.check_accounting()
    assert not m.px.in_flight and len(entry.compressed) == len(plan.actions)
