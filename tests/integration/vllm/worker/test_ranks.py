"""Tensor parallelism without an engine: the product's KV manager plans for several worker stores,
each holding its shard of the KV heads; their reports go through vLLM's own `KVOutputAggregator`
(the executor's merge) and back to the manager, as in a `tensor_parallel_size` N engine.

The engine runs are in `test_vllm_tp.py`; this module covers what an engine run rarely reaches:
a write that succeeded on one rank and failed on another."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from proxima.formats import HOT, Format
from proxima.integration.vllm.plan import NO_BLOCK, CompressAction, ProximaPlan, ProximaReport, merge_reports, settle
from proxima.integration.vllm.scheduler.live import LiveControl
from proxima.integration.vllm.scheduler.manager import ProximaKVCacheManager, install
from proxima.integration.vllm.worker.faults import FAULT_ENV, FaultInjector, parse_fault
from proxima.integration.vllm.worker.ranks import check_remap
from proxima.integration.vllm.worker.store import WorkerStore
from proxima.policy.loader import load_policy, parse_policy

INT8, INT4, INT2, FP8 = Format.parse("int8"), Format.parse("int4"), Format.parse("int2"), Format.parse("fp8")

HERE = Path(__file__).parents[1]
B, D, H_TOTAL, NB = 32, 64, 4, 24


def _merged(reports: list[ProximaReport | None]) -> ProximaReport | None:
    """What the scheduler receives: the ranks' outputs merged by vLLM's executor aggregator."""
    outs = []
    for rep in reports:
        out = ModelRunnerOutput(req_ids=[], req_id_to_index={})
        out.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=rep)
        outs.append(out)
    merged = KVOutputAggregator(expected_finished_count=len(reports)).aggregate(outs)  # type: ignore[arg-type]
    assert merged is not None and merged.kv_connector_output is not None
    rep = merged.kv_connector_output.kv_connector_worker_meta
    assert rep is None or isinstance(rep, ProximaReport)
    return rep


def test_vllms_aggregator_merges_reports_all_or_nothing() -> None:
    nan = float("nan")
    r0 = ProximaReport(ok=[1, 2, 3], errors=["InjectedFault: x"], kernel_seconds=0.5,
                       importance={"a": [1.0, nan, 0.2], "b": [0.5]})
    r1 = ProximaReport(ok=[1, 3], failed=[2], errors=["InjectedFault: x"], kernel_seconds=0.25,
                       importance={"a": [0.5, 0.7, nan, 0.1]})
    r2 = ProximaReport(ok=[1], failed=[], kernel_seconds=0.25)  # did not confirm 3 (nor fail it)
    rep = _merged([r0, r1, r2])
    assert rep is not None
    assert rep.ok == [1] and rep.failed == [2, 3] and rep.ranks == 3
    assert rep.kernel_seconds == 1.0  # every rank's compression time, summed
    assert rep.errors == ["InjectedFault: x"]  # the same fault on two ranks, said once
    # Each rank saw its own heads: the block's mass is the larger one; NaN (not seen) loses.
    assert rep.importance["a"] == [1.0, 0.7, 0.2, 0.1] and rep.importance["b"] == [0.5]
    with pytest.raises(TypeError, match="cannot merge a ProximaReport with a"):
        r0.aggregate(object())  # type: ignore[arg-type]


MEAN_FOLD = """
schema_version: 1
name: mean-fold
bands:
  - {name: always, enter: 0.02, exit: 0.01, target_free: 0.99, ladder: [int8]}
importance: {aggregate: AGGREGATE}
"""


@pytest.mark.parametrize("aggregate", ["max", "mean"])
def test_merged_importance_is_the_fold_over_every_ranks_heads(aggregate: str) -> None:
    """The ranks' reports, each folded over its own KV heads by the worker, merge into the number
    a single rank holding every head reports, for either `importance.aggregate`, in vLLM's fold
    ((r0 + r1) + r2) and in the other grouping (r0 + (r1 + r2))."""
    heads, tokens = 6, 5 * B // 2  # 2.5 blocks; block 1 not seen (compressed)
    policy = parse_policy(MEAN_FOLD.replace("AGGREGATE", aggregate))
    torch.manual_seed(0)
    mass = torch.rand(tokens, heads)
    mass[B:2 * B] = float("nan")

    def reports(ranks: int) -> list[ProximaReport]:
        h, out = heads // ranks, []
        for r in range(ranks):
            st = WorkerStore(rank=r)
            st.register({"model.layers.0.self_attn.attn": torch.zeros(NB, h, B, 2 * D).bfloat16()}, policy)
            st.observe("a", mass[:, r * h:(r + 1) * h].contiguous(), reset=True)
            rep = st.take_report()
            assert rep is not None and rep.importance_fold == aggregate
            out.append(rep)
        return out

    (one,) = reports(1)
    want = one.importance["a"]
    assert len(want) == 3 and math.isnan(want[1])
    for ranks in (2, 3):
        reps = reports(ranks)
        merged = [_merged(list(reps))]
        if ranks == 3:
            merged.append(merge_reports(reps[0], merge_reports(reps[1], reps[2])))
        for rep in merged:
            assert rep is not None and rep.ranks == ranks and rep.importance_fold == aggregate
            assert rep.importance["a"] == pytest.approx(want, rel=1e-6, nan_ok=True)
            assert settle(rep, ranks).importance_fold == aggregate  # (what the scheduler commits)
    # The two folds differ here (the hottest head is not the mean head): the merge followed the fold.
    if aggregate == "mean":
        assert want[0] < max(r.importance["a"][0] for r in reports(3))


def test_mean_importance_weighs_the_ranks_that_observed_a_block() -> None:
    """Fold "mean": a block's merged importance is the mean over the ranks that observed it (a NaN
    side weighs nothing, the longer list's tail is kept), whatever the grouping and rank order."""
    nan = float("nan")
    r0 = ProximaReport(importance={"a": [0.25, nan, 0.5], "b": [1.0]}, importance_fold="mean")
    r1 = ProximaReport(importance={"a": [0.5, 0.25]}, importance_fold="mean")
    r2 = ProximaReport(importance={"a": [0.75, 0.5, nan, 0.125]}, importance_fold="mean")
    groupings = [merge_reports(merge_reports(r0, r1), r2), merge_reports(r0, merge_reports(r1, r2)),
                 merge_reports(merge_reports(r2, r0), r1), merge_reports(r1, merge_reports(r2, r0))]
    for rep in [*groupings, _merged([r0, r1, r2])]:
        assert rep is not None and rep.ranks == 3 and rep.importance_fold == "mean"
        assert rep.importance == {"a": [0.5, 0.375, 0.5, 0.125], "b": [1.0]}
        assert rep.importance_ranks == {"a": [3, 2, 1, 1], "b": [1]}
    assert math.isnan(merge_reports(ProximaReport(importance={"a": [nan]}, importance_fold="mean"),
                                    ProximaReport(importance={"a": [nan]}, importance_fold="mean")).importance["a"][0])
    # Any values, four ranks, every grouping of vLLM's pairwise merge: the mean of the observed values.
    torch.manual_seed(0)
    vals = torch.rand(4, 16).double()
    vals[torch.rand(4, 16) < 0.3] = nan
    reps = [ProximaReport(importance={"a": v.tolist()}, importance_fold="mean") for v in vals]
    want = vals.nanmean(0).tolist()
    m = merge_reports
    for rep in (m(m(m(reps[0], reps[1]), reps[2]), reps[3]), m(m(reps[0], reps[1]), m(reps[2], reps[3])),
                m(reps[0], m(reps[1], m(reps[2], reps[3]))), m(m(reps[3], reps[1]), m(reps[0], reps[2]))):
        assert rep.importance["a"] == pytest.approx(want, rel=1e-12, nan_ok=True)
        assert rep.importance_ranks["a"] == (~vals.isnan()).sum(0).tolist()


def test_importance_of_different_folds_does_not_merge() -> None:
    """The ranks of one engine run one policy: a "max" and a "mean" report cannot be one number. A
    report without importance says nothing about heads and takes the other side's fold."""
    mean = ProximaReport(importance={"a": [1.0]}, importance_fold="mean")
    with pytest.raises(ValueError, match="cannot merge importance folded with 'mean' and with 'max'"):
        merge_reports(mean, ProximaReport(importance={"a": [0.5]}))
    silent = ProximaReport(kernel_seconds=0.5)
    for rep in (merge_reports(mean, silent), merge_reports(silent, mean)):
        assert rep.importance_fold == "mean" and rep.importance == {"a": [1.0]}


def test_drift_samples_survive_the_merge_once() -> None:
    """Drift samples come from the engine's logits, the same on every rank that sees them: the
    merge keeps one rank's, never none and never twice."""
    sample = [("req-1", 3, -0.25, 1.5)]
    assert _merged([ProximaReport(drift=sample), ProximaReport(drift=sample)]).drift == sample  # type: ignore[union-attr]
    assert _merged([ProximaReport(), ProximaReport(drift=sample)]).drift == sample  # type: ignore[union-attr]
    assert _merged([ProximaReport(), ProximaReport()]).drift == []  # type: ignore[union-attr]


def test_a_report_missing_a_rank_commits_nothing() -> None:
    """vLLM leaves a rank without a report out of the merge; its writes are unproven."""
    rep = _merged([ProximaReport(ok=[4], importance={"a": [1.0]}), None])
    assert rep is not None and rep.ranks == 1
    settled = settle(rep, ranks=2)
    assert settled.ok == [] and settled.failed == [4] and "1 of 2 ranks sent no report" in settled.errors[-1]
    assert settled.importance == {"a": [1.0]}
    assert settle(rep, ranks=1) is rep
    assert settle(ProximaReport(importance={"a": [1.0]}), ranks=2).importance == {"a": [1.0]}
    with pytest.raises(RuntimeError, match="merged 2 rank reports, but the engine has 1"):
        settle(merge_reports(ProximaReport(), ProximaReport()), ranks=1)


def test_a_fault_can_hit_one_rank_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_fault("compress@3,rank=1", "x") == 3
    for bad in ("compress,rank=", "compress,rank=-1", "compress,node=1"):
        with pytest.raises(ValueError, match="x: unknown fault option"):
            parse_fault(bad, "x")
    monkeypatch.setenv(FAULT_ENV, "compress,rank=1")
    hit, spared = FaultInjector(rank=1), FaultInjector(rank=0)
    hit.refresh()
    spared.refresh()
    assert hit.every == 1 and spared.every is None


# --- the manager and N worker stores ------------------------------------------------------------


def _manager(ranks: int) -> ProximaKVCacheManager:
    spec = FullAttentionSpec(block_size=B, num_kv_heads=H_TOTAL // ranks, head_size=D, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])
    m = install(KVCacheManager(cfg, max_model_len=2048, scheduler_block_size=B, hash_block_size=B,
                               enable_caching=False), load_policy(HERE / "force-int8.yaml"), ranks=ranks)
    assert m is not None
    m.px.check = True  # what PROXIMA_CHECK_ACCOUNTING=1 sets: plans carry the scheduler's slots
    return m


def _ranks(ranks: int, monkeypatch: pytest.MonkeyPatch, fault: str) -> tuple[list[WorkerStore], torch.Tensor]:
    """One store per rank over its heads of one full KV tensor [layer][N, H, B, 2D] (vLLM's CPU
    layout), so that rank r's view is exactly heads [r * H/N, (r + 1) * H/N)."""
    monkeypatch.setenv(FAULT_ENV, fault)
    torch.manual_seed(0)
    full = torch.randn(2, NB, H_TOTAL, B, 2 * D).bfloat16()
    h = H_TOTAL // ranks
    stores = []
    for r in range(ranks):
        st = WorkerStore(rank=r)
        st.register({f"model.layers.{i}.self_attn.attn": full[i, :, r * h:(r + 1) * h].clone() for i in range(2)})
        stores.append(st)
    return stores, full


def _step(m: ProximaKVCacheManager, stores: list[WorkerStore], scheduled: list[str]) -> tuple[ProximaPlan,
                                                                                             ProximaReport | None]:
    """One engine step: the plan goes to every rank unchanged; the merged report is committed."""
    plan = m.build_plan(scheduled)
    for st in stores:
        st.apply(plan)
    rep = _merged([st.take_report() for st in stores])
    if rep is not None:
        m.apply_report(settle(rep, m.px.meta.ranks))
    m.check_accounting()
    return plan, rep


def _admit(m: ProximaKVCacheManager, name: str, blocks: int) -> Request:
    req = Request(name, list(range(1, blocks * B + 1)), SamplingParams(max_tokens=64), None)
    assert m.allocate_slots(req, blocks * B) is not None
    req.num_computed_tokens = blocks * B
    req.append_output_token_ids([7])
    assert m.allocate_slots(req, 1) is not None
    return req


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_write_failed_on_one_rank_is_undone_on_every_rank(ranks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _manager(ranks)
    stores, full = _ranks(ranks, monkeypatch, "compress,rank=1")
    reqs = [_admit(m, f"r{i}", 8) for i in range(2)]
    ids = [r.request_id for r in reqs]
    free_before = m.block_pool.get_num_free_blocks()
    plan, rep = _step(m, stores, ids)
    assert plan.actions and rep is not None
    # Rank 1 failed every write, so no write counts, although the other ranks made theirs.
    assert rep.ok == [] and sorted(rep.failed) == sorted(a.action_id for a in plan.actions)
    assert stores[0].remap and not stores[1].remap
    assert m.px.stats.committed == 0 and m.block_pool.get_num_free_blocks() == free_before
    assert all(not e.compressed for e in m.px.ledger.values())
    # The next plan revokes them first: rank 0 reads its hot blocks again, and its map agrees
    # with the scheduler's (the plan's check), which would have raised otherwise.
    monkeypatch.setenv(FAULT_ENV, "")
    for st in stores:
        st.faults.refresh()
    plan2 = m.build_plan(ids)
    assert {a.action_id for a in plan2.revoked} == {a.action_id for a in plan.actions}
    assert plan2.check_remap is not None
    with pytest.raises(AssertionError, match="proxima rank 0: request r"):
        check_remap(stores[0].remap, plan2.check_remap, 0)  # before the revocation
    for st in stores:
        st.apply(plan2)
    assert all(not st.remap.get(rid) for st in stores for rid in ids)
    m.apply_report(settle(_merged([st.take_report() for st in stores]) or ProximaReport(), ranks))
    # Without the fault (once the backoff lets int8 be planned again) the same blocks compress on
    # every rank and commit; each rank holds its own heads of them, and every plan's check passes.
    for _ in range(8):
        plan3, _rep = _step(m, stores, ids)
        if plan3.actions:
            break
    assert plan3.actions and m.px.stats.committed == len(plan3.actions)
    assert m.px.stats.freed_blocks == len(plan3.actions)  # each source went back to vLLM
    h = H_TOTAL // ranks
    a = plan3.actions[0]
    for r, st in enumerate(stores):
        kh, _ = st.read("model.layers.0.self_attn.attn", a.fmt, torch.tensor([a.dst]),
                        torch.tensor([a.slot]))
        assert st.layout is not None
        k, _ = st.layout.read_blocks(full[0, :, r * h:(r + 1) * h], torch.tensor([a.src]))
        assert (kh[0].float() - k[0].float()).norm() / k[0].float().norm() < 0.02
    _step(m, stores, ids)


def _recompressed_store() -> tuple[WorkerStore, CompressAction, CompressAction]:
    """A worker store with block 0 of request r compressed to int8 (`first`), then recompressed
    to int4 (`again`)."""
    st = WorkerStore(rank=0)
    torch.manual_seed(0)
    st.register({"l0": torch.randn(NB, 2, B, 2 * D).bfloat16()})
    first = CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=INT8)
    again = CompressAction(1, "r", 0, src=-1, dst=11, slot=0, fmt=INT4, from_fmt=INT8, from_dst=10, from_slot=0)
    st.apply(ProximaPlan(actions=[first]))
    st.apply(ProximaPlan(actions=[again]))
    return st, first, again


def test_a_failed_recompression_points_back_to_the_old_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    st, first, again = _recompressed_store()
    assert st.remap["r"][0] == (INT4, 11, 0)
    st.apply(ProximaPlan(revoked=[again, CompressAction(9, "gone", 0, src=1, dst=12, slot=0, fmt=INT8)]))
    assert st.remap["r"][0] == (INT8, 10, 0)
    st.apply(ProximaPlan(revoked=[again]))  # twice, or on a rank that failed it too: nothing to undo
    assert st.remap["r"][0] == (INT8, 10, 0)
    st.apply(ProximaPlan(revoked=[first]))
    assert 0 not in st.remap["r"]


def test_a_revoke_the_worker_cannot_match_is_logged_and_counted_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    """A broken invariant (the replaced entry is not the revoked action's) stopped the engine with
    an AssertionError; now the block points where the scheduler keeps it, and the metric counts it."""
    st, _, again = _recompressed_store()
    st.replaced["r"].clear()  # the entry it replaced is lost
    with caplog.at_level("ERROR", logger="proxima.vllm"):
        st.apply(ProximaPlan(revoked=[again]))
    assert st.remap["r"][0] == (INT8, 10, 0)  # the scheduler's view: the old slot
    assert "holds the revoked recompression 1" in caplog.text
    rep = st.take_report()
    assert rep is not None and rep.revoke_mismatches == 1
    assert merge_reports(rep, rep).revoke_mismatches == 2  # every rank's count
    m = _manager(1)
    live = LiveControl(m, m.px.policy, "", 0)
    live.before_plan()
    m.build_plan([])
    live.after_plan()
    live.commit(rep)  # the step's report, as the connector hands it over
    counter = live.controller.metrics.compression_errors.labels(reason="revoke_mismatch")
    assert counter._value.get() == 1


def test_stats_count_every_ranks_side_table() -> None:
    one, four = _manager(1), _manager(4)
    assert four.px.meta.per_slot(INT4) == one.px.meta.per_slot(INT4)
    assert four.px.meta.block_bytes == one.px.meta.block_bytes  # 4 ranks of 1 head = 1 rank of 4
    assert four.summary()["ranks"] == 4 and one.summary()["ranks"] == 1


# --- the merge's verdicts: one engine, not N ---------------------------------------------------


def test_a_refusal_keeps_the_mildest_verdict_of_every_rank() -> None:
    """A compression is only as good as its worst rank: of the ranks' verdicts on a refused action
    the merge keeps the mildest (fewest slots per block; HOT = stays hot), whatever the rank order."""
    r0 = ProximaReport(ok=[4], rejected={1: INT4, 2: HOT, 3: INT4, 5: INT8})
    r1 = ProximaReport(ok=[5], rejected={1: INT8, 2: INT4, 3: INT8, 4: INT8})
    r2 = ProximaReport(ok=[1, 4, 5], rejected={2: INT8, 3: INT8})
    want = {1: INT8, 2: HOT, 3: INT8, 4: INT8, 5: INT8}
    for order in ([r0, r1, r2], [r2, r1, r0], [r1, r0, r2]):
        rep = _merged(order)
        assert rep is not None and rep.rejected == want and rep.ok == [] and rep.failed == []
    # (Say action 3 is an int4 compression: rank 0 deferred it, not measurable yet, in its own
    # format; rank 1 measured int4 over the bound and accepted int8: int8 is the cap everywhere.)


def _probe_ranks(policy_text: str) -> tuple[list[WorkerStore], torch.Tensor]:
    """Two ranks of 2 KV heads over one KV tensor in which block 1 is hard to quantize (random)
    in heads 0-1 and nearly constant in heads 2-3, and block 2 the other way round."""
    torch.manual_seed(0)
    full = torch.randn(2, NB, H_TOTAL, B, 2 * D)
    for blk, easy in ((1, slice(2, 4)), (2, slice(0, 2))):
        full[:, blk, easy] = 1 + 1e-3 * torch.randn_like(full[:, blk, easy])
    full = full.bfloat16()
    policy = parse_policy(policy_text)
    stores = []
    for r in range(2):
        st = WorkerStore(rank=r)
        st.register({f"model.layers.{i}.self_attn.attn": full[i, :, 2 * r:2 * r + 2].clone() for i in range(2)},
                    policy)
        stores.append(st)
    return stores, full


PROBED = """
schema_version: 1
name: probed
bands:
  - {name: always, enter: 0.02, exit: 0.01, target_free: 0.99, ladder: [int2, int8]}
protect: {sink_tokens: 0, recent_tokens: 0}
probes: {compression: {max_error: {int2: 0.05, int8: 0.05}}}
"""


def test_probe_counts_are_the_engines_distinct_blocks() -> None:
    """Rank 0 refuses block 1 (its heads of it are random) and rank 1 block 2: the engine measured
    two blocks and refused two (each once), not max(1, 1)."""
    stores, _full = _probe_ranks(PROBED)
    for st in stores:
        torch.manual_seed(1)
        for rid in ("r", "s"):
            st.recent_queries.add(rid, torch.randn(8, 4, D).bfloat16(), D ** -0.5)
    plan = ProximaPlan(actions=[CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=INT2),
                                CompressAction(1, "s", 0, src=2, dst=11, slot=0, fmt=INT2),
                                CompressAction(2, "new", 0, src=3, dst=11, slot=1, fmt=INT2)])  # deferred
    for st in stores:
        st.apply(plan)
    reps = [st.take_report() for st in stores]
    assert all(r is not None for r in reps)
    assert [r.rejected for r in reps if r is not None] == [{0: INT8, 2: INT2}, {1: INT8, 2: INT2}]
    assert [(r.probe_measured, r.probe_refused) for r in reps if r is not None] == [(2, 1), (2, 1)]
    rep = _merged(list(reps))
    assert rep is not None
    assert rep.rejected == {0: INT8, 1: INT8, 2: INT2} and rep.ok == []
    assert rep.probe_measured == 2 and rep.probe_refused == 2
    assert rep.probe_refused <= rep.probe_measured  # the invariant the fallback ladder's fraction needs
    assert len(rep.probe_errors) == sum(len(r.probe_errors) for r in reps if r is not None)
    assert rep.probe_seconds == sum(r.probe_seconds for r in reps if r is not None)  # summed, like kernel time


OVERRIDDEN = """
schema_version: 1
name: overridden
bands:
  - {name: always, enter: 0.02, exit: 0.01, target_free: 0.99, ladder: [int4, int8]}
protect: {sink_tokens: 0, recent_tokens: 0}
probes: {compression: {enabled: false}}
"""
FP8_IN_LAYER_0 = "layer_overrides:\n  - layers: [0]\n    substitute: {int8: fp8}\n"


def _step_ranks(stores: list[WorkerStore], plan: ProximaPlan) -> ProximaReport:
    for st in stores:
        st.apply(plan)
    rep = _merged([st.take_report() for st in stores])
    assert rep is not None
    return settle(rep, len(stores))


def test_a_recompression_undone_on_one_rank_keeps_its_override_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block written while layer 0 stored fp8 for int8 (override epoch 1) is recompressed into
    int4 after the override was removed live (epoch 2); rank 1 fails the recompression, rank 0
    wrote it. Undone on rank 0, the block must read with the table it was written with, as on
    rank 1 (which never moved it), not with the startup table (layer 0 would be read as int8)."""
    stores, full = _probe_ranks(OVERRIDDEN)
    layer0 = "model.layers.0.self_attn.attn"
    monkeypatch.setenv(FAULT_ENV, "")
    first = CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=INT8)
    rep = _step_ranks(stores, ProximaPlan(actions=[first], policy_version=1,
                                          policy=parse_policy(OVERRIDDEN + FP8_IN_LAYER_0)))
    assert rep.ok == [0]
    written = stores[0].remap["r"][0]
    assert stores[0].layer_format(layer0, written[0]) == FP8
    monkeypatch.setenv(FAULT_ENV, "compress,rank=1")
    again = CompressAction(1, "r", 0, src=NO_BLOCK, dst=11, slot=0, fmt=INT4, from_fmt=INT8, from_dst=10,
                           from_slot=0)
    rep = _step_ranks(stores, ProximaPlan(actions=[again], policy_version=2, policy=parse_policy(OVERRIDDEN)))
    assert rep.failed == [1] and rep.ok == []
    assert stores[0].remap["r"][0][0].name == "int4" and stores[0].remap["r"][0][1:] == (11, 0)  # rank 0 wrote it
    assert stores[1].remap["r"][0] == written
    monkeypatch.setenv(FAULT_ENV, "")
    # What the scheduler sends next: the revocation, and the same recompression planned again
    # into the slot it released (every rank reads the block where it is, then writes it).
    retry = CompressAction(2, "r", 0, src=NO_BLOCK, dst=11, slot=0, fmt=INT4, from_fmt=INT8, from_dst=10,
                           from_slot=0)
    for st in stores:
        st.apply(ProximaPlan(revoked=[again]))
    assert [st.remap["r"][0] for st in stores] == [written, written]
    for r, st in enumerate(stores):
        kh, _ = st.read(layer0, written[0], torch.tensor([10]), torch.tensor([0]))
        assert st.layout is not None
        k, _ = st.layout.read_blocks(full[0, :, 2 * r:2 * r + 2], torch.tensor([1]))
        assert (kh[0].float() - k[0].float()).norm() / k[0].float().norm() < 0.08  # fp8's error, not garbage
    rep = _step_ranks(stores, ProximaPlan(actions=[retry]))
    assert rep.ok == [2]
    for r, st in enumerate(stores):
        fmt, dst, slot = st.remap["r"][0]
        kh, _ = st.read(layer0, fmt, torch.tensor([dst]), torch.tensor([slot]))
        assert st.layout is not None
        k, _ = st.layout.read_blocks(full[0, :, 2 * r:2 * r + 2], torch.tensor([1]))
        assert (kh[0].float() - k[0].float()).norm() / k[0].float().norm() < 0.2  # int4's error
