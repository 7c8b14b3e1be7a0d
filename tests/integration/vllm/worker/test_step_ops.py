"""The structure of one `WorkerStore.apply` (issue 37): what it dispatches does not grow with the
number of layers, and its compression reads nothing back to the host.

Counted with `bench/op_counter.py` around the product's `apply` (`bench/step_ops.py` builds the
caches as vLLM 0.32 allocates them: one backing tensor, a view per layer)."""

from __future__ import annotations

import pytest
import torch

from bench.op_counter import OpCounter
from bench.step_ops import Shape, Workload, accepting_probe, stacked_caches, without_probe
from proxima.compression.layer_stack import stack_view
from proxima.formats import Format
from proxima.integration.vllm.plan import CompressAction, ProximaPlan
from proxima.integration.vllm.worker.store import WorkerStore
from proxima.policy.loader import load_policy

INT4, C2_INT4, C8_INT4 = Format.parse("int4"), Format.parse("cluster(2)+int4"), Format.parse("cluster(8)+int4")

SHAPE = dict(heads=1, block_size=16, head_dim=32, blocks=32)


def test_the_counter_sees_ops_and_would_be_syncs() -> None:
    x = torch.arange(6.0)
    with OpCounter() as c:
        y = x * 2 + 1
        _ = y.sum().item()  # a read back
        _ = torch.tensor([1, 2])  # a host tensor sent to the device
        _ = y[y > 3]  # boolean mask: a value-dependent size
        _ = y.tolist()  # no dispatch on CPU, still a read back
        _ = y.cpu().tolist()  # one read back: the second is of a host tensor
    assert c.counts.ops["aten.mul"] == 1 and c.counts.ops["aten.add"] == 1
    assert c.counts.syncs["aten._local_scalar_dense"] == 1
    assert c.counts.syncs["aten.lift_fresh"] == 1
    assert c.counts.syncs["aten.index"] == 1 and c.counts.syncs["Tensor.tolist"] == 1
    assert c.counts.syncs["Tensor.cpu"] == 1
    with OpCounter() as quiet:
        _ = x.index_select(0, torch.zeros(2, dtype=torch.long))
    assert quiet.counts.total_syncs == 0 and quiet.counts.total_ops == 2  # zeros + index_select
    with OpCounter() as k:
        y = x.view(2, 3).t().unsqueeze(0)  # views: no kernel
        _ = torch.empty(4)  # an allocation: no kernel
        _ = (y * 2).contiguous()  # mul, then the copy of the transposed result: two kernels
    assert k.counts.total_ops >= 5 and dict(k.counts.kernels) == {"aten.mul": 1, "aten.clone": 1}
    assert k.counts.device_kernels == 2


def test_vllm_layout_caches_stack_into_one_view() -> None:
    caches = stacked_caches(Shape(layers=3, **SHAPE), "cpu")
    layers = list(caches.values())
    kv = stack_view(layers)
    assert kv is not None and kv.shape == (3, *layers[0].shape)
    assert all(kv[i].data_ptr() == t.data_ptr() for i, t in enumerate(layers))
    assert stack_view([t.clone() for t in layers]) is None  # separate allocations: one op per layer


def _work(policy: str, layers: int) -> Workload:
    return Workload(accepting_probe(load_policy(policy)), Shape(layers=layers, **SHAPE), "cpu", per_group=1)


@pytest.mark.parametrize("policy", ["conservative", "aggressive"])
def test_one_apply_dispatches_the_same_at_4_and_8_layers(policy: str) -> None:
    small, large = _work(policy, 4), _work(policy, 8)
    assert small.groups == large.groups and len(small.groups) >= 3
    for g, (src, dst) in enumerate(small.groups):
        a, b = small.apply_counted(g), large.apply_counted(g)
        assert (a.total_ops, a.total_launches) == (b.total_ops, b.total_launches), (src, dst, a.ops - b.ops)


def test_the_compression_reads_nothing_back() -> None:
    """A step's compression sends its action table in one upload (a pinned, non-blocking copy on
    a GPU) and reads nothing back, with the probe too: its errors are read a step later
    (`ProbeBatch`). A first merge uploads its blocks' token importance too (kept on the host)."""
    for probe in (without_probe, accepting_probe):
        work = Workload(probe(load_policy("aggressive")), Shape(layers=4, **SHAPE), "cpu", per_group=2)
        for g, (src, dst) in enumerate(work.groups):
            counts = work.apply_counted(g)
            assert dict(counts.syncs) == {}, (probe.__name__, work.groups[g], counts.syncs)
            first_merge = src.reduction is None and dst.reduction is not None
            # (the probe measures the written slots: no second compression, no second upload)
            want = 1 + first_merge
            assert counts.uploads == want, (probe.__name__, work.groups[g], counts.uploads)


def test_on_the_triton_kernels_a_group_is_a_few_launches_whatever_the_layers() -> None:
    """The Triton path (`WorkerStore.cpu_kernels`, the interpreter here; CUDA's path) runs the
    step kernels (`worker/step_groups.py`): a first compression is one launch over every layer
    (keys and values, read from the pages, written into the slots), a merge three (the sources'
    dequantization, the k-means, the quantization), the same at 2 and 4 layers, and nothing
    is read back."""
    policy = without_probe(load_policy("aggressive"))
    works = [Workload(policy, Shape(layers=n, **SHAPE), "cpu", per_group=2, kernels="triton") for n in (2, 4)]
    expected = {"bf16->int4": 1, "int4->cluster(2)+int4": 3, "cluster(2)+int4->cluster(4)+int4": 3,
                "cluster(4)+int4->cluster(8)+int4": 3}
    assert [f"{s.name}->{d.name}" for s, d in works[0].groups] == list(expected)
    for g, want in enumerate(expected.values()):
        a, b = (w.apply_counted(g) for w in works)
        assert (a.total_ops, a.ops, a.launches) == (b.total_ops, b.ops, b.launches), works[0].groups[g]
        assert a.total_launches == want, (works[0].groups[g], a.launches)
        assert a.launches["triton:_quant_step_kernel"] == 1
        assert a.launches["triton:_cluster_kernel"] == (want == 3)
        assert dict(a.syncs) == {}, (works[0].groups[g], a.syncs)


@pytest.mark.parametrize("policy", ["conservative", "balanced", "aggressive"])
def test_a_group_launches_at_most_4_device_kernels_whatever_the_layers(policy: str) -> None:
    """Issue 37's GPU budget, counted on CPU: the ops of one apply that would launch a CUDA kernel
    (`bench/op_counter.py`: every dispatched op but views and allocations) plus the Triton
    launches, <= 4 for every (source, target) group of the shipped policies with the probe off,
    the same at 4 and 8 layers, and no would-be sync (one upload: the step table; a first merge
    adds its blocks' importance)."""
    works = [Workload(without_probe(load_policy(policy)), Shape(layers=n, **SHAPE), "cpu", per_group=2,
                      kernels="triton") for n in (4, 8)]
    for g, (src, dst) in enumerate(works[0].groups):
        a, b = (w.apply_counted(g) for w in works)
        assert a.total_launches >= 1, (src, dst)  # the Triton kernels ran, not the torch reference
        assert a.device_kernels <= 4, (src, dst, dict(a.kernels), dict(a.launches))
        assert (a.kernels, a.launches) == (b.kernels, b.launches), (src, dst)
        assert a.total_syncs == 0 == b.total_syncs, (src, dst, a.syncs, b.syncs)


def _written(store: WorkerStore, plans: list[ProximaPlan]) -> dict[tuple[str, str], torch.Tensor]:
    """Every destination slot the plans wrote, in every layer: codes and side-table rows as bytes."""
    out: dict[tuple[str, str], torch.Tensor] = {}
    for plan in plans:
        for a in plan.actions:
            fmt = store.formats.stored(a.fmt)
            p = store.stack.pools[fmt]
            row = a.dst * fmt.pack_ratio + a.slot
            assert p.k_all is not None and p.v_all is not None
            out[(str(a.action_id), "k")], out[(str(a.action_id), "v")] = p.k_all[:, row], p.v_all[:, row]
            for name, t in p.meta.items():
                out[(str(a.action_id), name)] = t[:, row].contiguous().view(torch.uint8)
    return out


@pytest.mark.parametrize(("policy", "pins"), [("conservative", 0), ("aggressive", 0), ("aggressive", 2)])
def test_the_step_kernels_write_the_batch_paths_bytes(policy: str, pins: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The step kernels (`step_groups`) and the batch path (gather, `compress_blocks` on the same
    Triton kernels, scatter) write identical codes and side-table rows for every group, first
    compressions, recompressions and merges (with pinned rows too), and a hot block straight into
    every rung (the planner's write-once path: a first merge from pages)."""
    from proxima.integration.vllm.worker import step_groups

    pol = without_probe(load_policy(policy))
    if pins:
        pol = pol.model_copy(update={"protect": pol.protect.model_copy(update={"merged_tokens": pins})})
    written = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(step_groups, "fused", lambda *_: False)
        work = Workload(pol, Shape(layers=3, **SHAPE), "cpu", per_group=2, kernels="triton", direct=True)
        for g, plan in enumerate(work.plans):
            work.reset()
            work.store.apply(plan)
            rep = work.store.take_report()
            assert rep is not None and rep.ok == [a.action_id for a in plan.actions], (fused, work.groups[g], rep)
        written.append(_written(work.store, work.plans))
    assert written[0].keys() == written[1].keys()
    for key, got in written[0].items():
        assert torch.equal(got, written[1][key]), key


def test_stacked_and_per_layer_caches_write_the_same_bytes() -> None:
    """The one-view path (vLLM's allocation) and the per-layer path (separate tensors) compress
    and write identical slots, first compressions and merges alike."""
    caches = stacked_caches(Shape(layers=3, **SHAPE), "cpu")
    separate = {name: t.clone() for name, t in caches.items()}
    stores = []
    for cs in (caches, separate):
        st = WorkerStore()
        st.register(cs, without_probe(load_policy("aggressive")))
        stores.append(st)
    assert stores[0].stack.kv is not None and stores[1].stack.kv is None
    plans = [
        [CompressAction(1, "r", 0, src=1, dst=20, slot=0, fmt=INT4),
         CompressAction(2, "r", 1, src=2, dst=20, slot=1, fmt=INT4)],
        [CompressAction(3, "r", 0, src=-1, dst=21, slot=0, fmt=C2_INT4, from_fmt=INT4, from_dst=20,
                        from_slot=0)],
        [CompressAction(4, "r", 0, src=-1, dst=22, slot=0, fmt=C8_INT4, from_fmt=C2_INT4,
                        from_dst=21, from_slot=0)],
    ]
    for acts in plans:
        for st in stores:
            st.apply(ProximaPlan(actions=acts))
            rep = st.take_report()
            assert rep is not None and rep.ok == [a.action_id for a in acts], rep
    for name in caches:
        # as bytes: packed codes may read as NaN in bf16
        assert torch.equal(caches[name].view(torch.uint8), separate[name].view(torch.uint8))
        written = {"int4": [20 * 4, 20 * 4 + 1], "cluster(2)+int4": [21 * 8], "cluster(8)+int4": [22 * 32]}
        for fmt, rows in written.items():
            pa, pb = stores[0].pool(name, Format.parse(fmt)), stores[1].pool(name, Format.parse(fmt))
            assert pa.meta and set(pa.meta) == set(pb.meta)
            for field in pa.meta:  # the side tables' written rows (the rest is never-written memory)
                assert torch.equal(pa.meta[field][rows], pb.meta[field][rows]), (name, fmt, field)


@pytest.mark.parametrize("policy", ["conservative", "balanced", "aggressive"])
def test_a_group_dispatches_at_most_64_ops_and_launches(policy: str) -> None:
    """Issue 37's per-group budget, with the kernels a GPU runs (Triton; interpreted here) and the
    pools allocated as the engine's warm-up does: torch ops plus launches of one apply <= 64 for
    every (source, target) group of the shipped policies. (The compression-time probe is counted
    apart: it adds a reference attention over the observed layer.)"""
    work = Workload(without_probe(load_policy(policy)), Shape(layers=4, **SHAPE), "cpu", per_group=2,
                    kernels="triton")
    for g, (src, dst) in enumerate(work.groups):
        c = work.apply_counted(g)
        assert c.total_launches >= 1, (src, dst)  # the Triton kernels ran, not the torch reference
        assert c.total_ops + c.total_launches <= 64, (src, dst, c.total_ops, c.total_launches, c.ops.most_common(6))
