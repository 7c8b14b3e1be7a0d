"""The worker's live policy and its compression-time probe, on a fake vLLM CPU KV tensor (no engine: fast)."""

from __future__ import annotations

import torch

from proxima.compression.attention import attention_error
from proxima.compression.blocks import compress_blocks
from proxima.formats import HOT, Format
from proxima.integration.vllm.plan import CompressAction, ProximaPlan, ProximaReport
from proxima.integration.vllm.worker.layer_formats import StoredFormat
from proxima.integration.vllm.worker.store import WorkerStore
from proxima.policy.loader import parse_policy
from proxima.policy.schema import Policy

INT8, INT4, INT2, FP8 = Format.parse("int8"), Format.parse("int4"), Format.parse("int2"), Format.parse("fp8")

NB, H, B, D, HQ = 12, 3, 32, 64, 9
TOL = {"int8": 0.02, "fp8": 0.08, "int4": 0.2}

BASE = """
schema_version: 1
name: t
bands:
  - {name: always, enter: 0.02, exit: 0.01, target_free: 0.99, ladder: [int2, int8]}
protect: {sink_tokens: 0, recent_tokens: 0}
"""
OVERRIDE = "layer_overrides:\n  - layers: [0]\n    substitute: {int8: fp8}\n"


def _policy(extra: str = "") -> Policy:
    return parse_policy(BASE + extra)


def _store(policy: Policy) -> tuple[WorkerStore, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    caches = {f"layer.{i}": torch.randn(NB, H, B, 2 * D).to(torch.bfloat16) for i in range(2)}
    st = WorkerStore()
    st.register(caches, policy)
    return st, caches


def _rel(st: WorkerStore, kv: torch.Tensor, layer: str, fmt: Format, dst: int, slot: int, src: int) -> float:
    kh, _ = st.read(layer, fmt, torch.tensor([dst]), torch.tensor([slot]))
    assert st.layout is not None
    k = st.layout.read_blocks(kv, torch.tensor([src]))[0][0].float()
    return float((kh[0].float() - k).norm() / k.norm())


def test_policy_sent_with_the_plan_is_applied_before_its_work() -> None:
    st, _ = _store(_policy("importance: {observation_window: 32}\n"))
    assert st.observation_window == 32 and st.policy_version == 0
    new = _policy("importance: {observation_window: 8, ema_decay: 0.5, aggregate: mean}\n")
    st.apply(ProximaPlan(policy_version=3, policy=new))
    assert (st.observation_window, st.ema_decay, st.aggregate, st.policy_version) == (8, 0.5, "mean", 3)
    assert st.recent_queries.window == 8
    st.apply(ProximaPlan(policy_version=3))  # later plans carry only the version
    assert st.policy is new


def test_removing_a_layer_override_live_keeps_old_blocks_readable_and_recompressible() -> None:
    """Blocks written while layer 0 substituted fp8 for int8 keep that encoding; new blocks use
    the new table; recompressing an old block reads it with the table it was written with."""
    st, caches = _store(_policy(OVERRIDE + "probes: {compression: {enabled: false}}\n"))
    before = {k: v.clone() for k, v in caches.items()}
    st.apply(ProximaPlan(actions=[CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=INT8)]))
    live = _policy("probes: {compression: {enabled: false}}\n")  # the override is gone
    st.apply(ProximaPlan(policy_version=2, policy=live,
                         actions=[CompressAction(1, "r", 1, src=2, dst=10, slot=1, fmt=INT8)]))
    rep = st.take_report()
    assert rep is not None and rep.ok == [0, 1] and not rep.failed
    old, new = st.remap["r"][0][0], st.remap["r"][1][0]
    assert old == INT8 and isinstance(new, StoredFormat) and new.name == "int8"
    assert st.layer_format("layer.0", old) == FP8 and st.layer_format("layer.0", new).name == "int8"
    for layer, kv in before.items():
        # fp8 is lossier than int8: the old block in layer 0 reads back as fp8 (at fp8's error).
        err_old = _rel(st, kv, layer, old, 10, 0, 1)
        assert err_old < TOL["fp8" if layer == "layer.0" else "int8"], (layer, err_old)
        assert _rel(st, kv, layer, new, 10, 1, 2) < TOL["int8"]
    assert _rel(st, before["layer.0"], "layer.0", old, 10, 0, 1) > TOL["int8"]  # it really is fp8
    # Recompress both into int4: the worker reads each with its own table.
    st.apply(ProximaPlan(actions=[
        CompressAction(2, "r", 0, src=-1, dst=11, slot=0, fmt=INT4, from_fmt=INT8, from_dst=10, from_slot=0),
        CompressAction(3, "r", 1, src=-1, dst=11, slot=1, fmt=INT4, from_fmt=INT8, from_dst=10, from_slot=1),
    ]))
    rep = st.take_report()
    assert rep is not None and sorted(rep.ok) == [2, 3] and not rep.failed, rep.errors
    for layer, kv in before.items():
        for index, src in ((0, 1), (1, 2)):
            fmt, dst, slot = st.remap["r"][index]
            assert _rel(st, kv, layer, fmt, dst, slot, src) < TOL["int4"]


def _queries(st: WorkerStore, rid: str, n: int = 16) -> torch.Tensor:
    q = torch.randn(n, HQ, D).to(torch.bfloat16)
    st.recent_queries.add(rid, q, D ** -0.5)
    return q


def test_probe_refuses_a_format_over_its_bound_and_names_the_milder_one() -> None:
    st, caches = _store(_policy())
    q = _queries(st, "r")
    _queries(st, "s")
    before = {k: v.clone() for k, v in caches.items()}
    acts = [CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=INT2),
            CompressAction(1, "s", 0, src=2, dst=11, slot=0, fmt=INT8),
            CompressAction(2, "new", 0, src=3, dst=11, slot=1, fmt=INT8)]  # no queries yet: deferred
    st.apply(ProximaPlan(actions=acts))
    rep = st.take_report()
    assert rep is not None
    # r: int2 over the bound, int8 within; new: not measurable yet, so not written (planned again).
    assert rep.rejected == {0: INT8, 2: INT8} and rep.ok == [1] and not rep.failed
    assert "r" not in st.remap and "s" in st.remap and "new" not in st.remap
    # The refused block was written (its errors are read after the step's work, `ProbeBatch`)
    # but never installed: attention reads its source, which the scheduler keeps.
    assert all(torch.equal(before[k][1], caches[k][1]) for k in caches) and not st.probing
    assert rep.probe_measured == 2 and rep.probe_refused == 1 and rep.probe_seconds > 0
    errs = {f.name: e for f, e in rep.probe_errors}
    bound = st.policy.probes.compression  # type: ignore[union-attr]
    assert errs["int2"] > bound.bound(INT2) and errs["int8"] < bound.bound(INT8)
    # Only the chosen formats are measured (r: int2, s: int8): r's int8 is measured when it is planned.
    assert [f.name for f, _ in rep.probe_errors] == ["int2", "int8"]
    # The number is the one implementation's: attention_error over the observed layer's block.
    assert st.layout is not None and st.observe_layer == "layer.1"
    k, v = st.layout.read_blocks(before["layer.1"], torch.tensor([1]))
    cb = compress_blocks(INT2, k.contiguous(), v.contiguous(), backend="torch")
    assert abs(errs["int2"] - attention_error(q, k[0], v[0], cb, sm_scale=D ** -0.5)) < 1e-4


def test_probe_can_leave_a_block_hot_and_reports_merge_across_ranks() -> None:
    st, _ = _store(_policy("probes: {compression: {max_error: {int8: 1.0e-6}, default_max_error: 1.0e-6}}\n"))
    _queries(st, "r")
    _queries(st, "s")
    st.apply(ProximaPlan(actions=[CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=INT2),
                                  CompressAction(1, "s", 0, src=2, dst=11, slot=0, fmt=INT8)]))
    rep = st.take_report()
    # Both over the bound: int2 steps one rung down the ladder (int8, measured when planned), int8
    # has no milder format left, so its block stays hot. One measurement each.
    assert rep is not None and rep.rejected == {0: INT8, 1: HOT} and not rep.ok
    assert rep.probe_refused == 2 and [f.name for f, _ in rep.probe_errors] == ["int2", "int8"]
    merged = ProximaReport(ok=[1, 2], rejected={0: HOT}).aggregate(ProximaReport(ok=[0, 1], rejected={2: INT8}))
    assert isinstance(merged, ProximaReport)
    assert merged.ok == [1] and merged.rejected == {0: HOT, 2: INT8}


def test_the_probe_measures_the_slots_as_written(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The probe reads the observed layer's destination slots back as the step wrote them: a
    writer that stores wrong codes there is refused, though a fresh compression of the same
    block would pass (the probe compressed a second time until 2026-12-08, so it checked its own
    compression, not what attention reads)."""
    st, _ = _store(_policy())
    _queries(st, "r")
    assert st.observe_layer is not None
    row = st.stack.index[st.observe_layer]
    compress = WorkerStore._compress

    def scribbling(self, fmt, from_fmt, acts, table):  # type: ignore[no-untyped-def]
        compress(self, fmt, from_fmt, acts, table)
        k8, _ = self.slot_pool(self.layer_format(self.observe_layer, fmt)).layer(row)
        for a in acts:  # the written slot's key codes in the observed layer (the others' stay right)
            k8[a.dst * fmt.pack_ratio + a.slot].copy_(torch.randint_like(k8[0], 0, 255))

    monkeypatch.setattr(WorkerStore, "_compress", scribbling)
    st.apply(ProximaPlan(actions=[CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=INT8)]))
    rep = st.take_report()
    assert rep is not None and rep.rejected == {0: HOT} and rep.ok == [] and "r" not in st.remap
    monkeypatch.undo()
    st.apply(ProximaPlan(actions=[CompressAction(1, "r", 0, src=1, dst=11, slot=0, fmt=INT8)]))
    rep = st.take_report()
    assert rep is not None and rep.ok == [1] and not rep.rejected  # the same block, written right


def test_recent_queries_keep_the_newest_window() -> None:
    st, _ = _store(_policy("importance: {observation_window: 4}\n"))
    a = torch.arange(3 * HQ * D, dtype=torch.float32).view(3, HQ, D)
    st.recent_queries.add("r", a, 0.1)
    st.recent_queries.add("r", a[:2] + 1000, 0.1)
    got = st.recent_queries.get("r")
    assert got is not None and torch.equal(got, torch.cat([a[1:], a[:2] + 1000])[-4:])
    st.apply(ProximaPlan(dropped=["r"]))
    assert st.recent_queries.get("r") is None


def test_a_measured_block_is_installed_only_when_its_verdict_is_read() -> None:
    """No read back in the step: the probe's errors are read when the step's report is taken (or
    at the next step); until then the block map keeps the source, which attention reads."""
    st, _ = _store(_policy())
    _queries(st, "s")
    st.apply(ProximaPlan(actions=[CompressAction(1, "s", 0, src=2, dst=11, slot=0, fmt=INT8)]))
    assert "s" not in st.remap and len(st.probing) == 1
    rep = st.take_report()
    assert rep is not None and rep.ok == [1] and st.remap["s"][0][1:] == (11, 0) and not st.probing
    assert [a.action_id for a in st.settled] == [1]  # for the device block table at the next plan
    # A request dropped before its verdict is read: neither installed nor reported.
    _queries(st, "t")
    st.apply(ProximaPlan(actions=[CompressAction(2, "t", 0, src=3, dst=12, slot=0, fmt=INT8)]))
    st.apply(ProximaPlan(dropped=["t"]))
    rep = st.take_report()
    assert "t" not in st.remap and not st.probing
    assert rep is None or (2 not in rep.ok and 2 not in rep.rejected and not rep.probe_measured_ids)


def test_windows_of_different_lengths_measure_as_each_alone() -> None:
    """A request with fewer recent queries than another (padding, masked out of both norms)
    measures the same as when its batch holds full windows only (one stack, no padding)."""
    def errors(windows: dict[str, int]) -> dict[str, float]:
        st, _ = _store(_policy())
        for rid, n in windows.items():
            q = torch.randn(n, HQ, D, generator=torch.Generator().manual_seed(len(rid)))
            st.recent_queries.add(rid, q, D ** -0.5)
        src = {"r": 1, "ss": 2}  # each request's block, whatever the batch
        acts = [CompressAction(i, rid, 0, src=src[rid], dst=10, slot=i, fmt=INT8) for i, rid in enumerate(windows)]
        st.apply(ProximaPlan(actions=acts))
        rep = st.take_report()
        assert rep is not None and rep.probe_measured == len(acts)
        return {rid: e for rid, (_f, e) in zip(windows, rep.probe_errors, strict=True)}

    mixed = errors({"r": 32, "ss": 5})
    alone = errors({"r": 32}) | errors({"ss": 5})
    assert mixed.keys() == alone.keys()
    for rid in mixed:
        assert abs(mixed[rid] - alone[rid]) <= 1e-5 * max(1.0, alone[rid]), (rid, mixed, alone)
