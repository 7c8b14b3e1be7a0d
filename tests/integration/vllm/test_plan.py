"""The scheduler/worker messages on the wire: vLLM pickles the plan (scheduler output) and the
report (model runner output) through its shared-memory message queue, so both must survive
pickle with their formats as `Format` values, and the worker must act on a round-tripped plan."""

from __future__ import annotations

import pickle

import pytest
import torch

from proxima.formats import HOT, Format
from proxima.integration.vllm.plan import ActionId, CompressAction, ProximaPlan, ProximaReport
from proxima.integration.vllm.worker.store import WorkerStore

NB, H, B, D = 12, 3, 32, 64
INT8, INT4, C2 = Format.parse("int8"), Format.parse("int4"), Format.parse("cluster(2)+int4")


def _wire(obj: object) -> object:
    """What vLLM's message queue does to a message (`shm_broadcast.MessageQueue.enqueue`: pickle)."""
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def test_plan_and_report_round_trip_with_typed_formats() -> None:
    first = CompressAction(ActionId(0), "r", 0, src=1, dst=10, slot=0, fmt=INT8)
    again = CompressAction(ActionId(1), "r", 1, src=-1, dst=11, slot=0, fmt=C2, from_fmt=INT4, from_dst=9, from_slot=1)
    plan = ProximaPlan(actions=[first, again], revoked=[first], check_remap={"r": {0: [(INT8, 10, 0)]}})
    back = _wire(plan)
    assert isinstance(back, ProximaPlan) and back == plan
    assert back.actions[1].fmt == C2 and back.actions[1].from_fmt == INT4 and back.actions[0].from_fmt.is_hot
    assert {back.actions[1].fmt: 1}[C2] == 1  # hashes as the scheduler's own value (dict keys, sets)
    report = ProximaReport(ok=[ActionId(0)], rejected={ActionId(1): HOT, ActionId(2): INT8},
                           probe_errors=[(INT4, 0.3), (INT8, 0.01)])
    rep = _wire(report)
    assert isinstance(rep, ProximaReport) and rep == report and rep.rejected[ActionId(1)] is not None
    assert rep.rejected[ActionId(1)].is_hot and [f.name for f, _ in rep.probe_errors] == ["int4", "int8"]


def test_a_format_spelling_is_refused_on_the_wire() -> None:
    with pytest.raises(TypeError, match="Format values"):
        CompressAction(ActionId(0), "r", 0, src=1, dst=10, slot=0, fmt="int8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Format values"):
        CompressAction(ActionId(0), "r", 0, src=1, dst=10, slot=0, fmt=INT8, from_fmt="bf16")  # type: ignore[arg-type]


def test_the_worker_writes_what_a_round_tripped_plan_asks() -> None:
    """The plan as the worker process receives it: the same slots written as from the original."""
    torch.manual_seed(0)
    kv = torch.randn(NB, H, B, 2 * D).to(torch.bfloat16)
    outs = []
    for wire in (False, True):
        caches = {f"layer.{i}": kv.clone() for i in range(2)}
        st = WorkerStore()
        st.register(caches)
        plan = ProximaPlan(actions=[CompressAction(ActionId(i), "r", i, src=1 + i, dst=10, slot=i, fmt=INT4)
                                    for i in range(4)])
        st.apply(_wire(plan) if wire else plan)  # type: ignore[arg-type]
        rep = st.take_report()
        assert rep is not None and rep.ok == [0, 1, 2, 3] and not rep.failed, rep and rep.errors
        assert {i: e[0] for i, e in st.remap["r"].items()} == dict.fromkeys(range(4), INT4)
        outs.append(caches["layer.1"][10].view(torch.int16).clone())  # (packed bytes: NaN as bf16)
    assert torch.equal(outs[0], outs[1])
