"""The executor's groups run once before serving (`worker/step_warm_up.py`), touching only vLLM's
null block; and the step kernels' compiled variants do not depend on a step's action count."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench.step_ops import Shape, accepting_probe, stacked_caches, without_probe
from proxima.formats import HOT, Format
from proxima.integration.vllm.worker.step_warm_up import NULL_BLOCK, step_groups_of, warm_up_step_groups
from proxima.integration.vllm.worker.store import WorkerStore
from proxima.policy.loader import load_policy

SHAPE = Shape(layers=3, heads=1, block_size=16, head_dim=32, blocks=8)


def _store(policy: str, kernels: str, probe: bool = False) -> WorkerStore:
    store = WorkerStore()
    store.cpu_kernels = kernels  # type: ignore[assignment]
    p = accepting_probe(load_policy(policy)) if probe else without_probe(load_policy(policy))
    store.register(stacked_caches(SHAPE, "cpu"), p)
    store.adopt(p, 1)
    for stored in store.stored_formats():  # as the backend's warm-up does: every pool allocated
        store.slot_pool(stored)
    for kv in store.kv_caches.values():  # recognisable bytes everywhere
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(3)).to(kv.dtype))
    return store


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (side tables are `torch.empty`: NaN bytes compare equal here)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_the_groups_are_every_first_compression_then_every_recompression() -> None:
    store = _store("aggressive", "torch")
    groups = step_groups_of(store)
    names = [f"{s.name}->{d.name}" for s, d in groups]
    assert names[:4] == ["bf16->int4", "bf16->cluster(2)+int4", "bf16->cluster(4)+int4", "bf16->cluster(8)+int4"]
    assert set(names[4:]) == {"int4->cluster(2)+int4", "int4->cluster(4)+int4", "int4->cluster(8)+int4",
                              "cluster(2)+int4->cluster(4)+int4", "cluster(2)+int4->cluster(8)+int4",
                              "cluster(4)+int4->cluster(8)+int4"}
    store.policy = None
    assert step_groups_of(store) == []


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_warm_up_writes_only_the_null_block_and_reports_nothing(kernels: str) -> None:
    """Every group runs (the fused step kernels on the Triton path, the batch path for a first
    merge); no KV block but the null block and no side-table row but its slots' changes, nothing
    enters the block map and the step's report stays empty."""
    store = _store("aggressive", kernels)
    kv_before = {n: t.clone() for n, t in store.kv_caches.items()}
    pools = {f: store.slot_pool(f) for f in store.stored_formats()}
    meta_before = {(f, k): t.clone() for f, sp in pools.items() for k, t in sp.meta.items()}
    assert len(pools) == 4 and meta_before
    done = warm_up_step_groups(store)
    assert done == step_groups_of(store) and len(done) == 10
    for name, kv in store.kv_caches.items():
        assert _same(kv[NULL_BLOCK + 1:], kv_before[name][NULL_BLOCK + 1:]), name
    changed = False
    for (f, k), before in meta_before.items():
        after = pools[f].meta[k]
        r = f.pack_ratio
        rows = after.shape[1]  # [L, slot rows, ...]: rows of the null block are 0 .. r - 1
        assert _same(after[:, r:rows], before[:, r:rows]), (f, k)
        changed |= not _same(after[:, :r], before[:, :r])
    assert changed  # the groups did write (into the null block's slots)
    assert store.remap == {} and store.take_report() is None
    assert {f for f in store.dtypes} >= {d for _s, d in done if _s == HOT}


def test_with_the_probe_on_the_warm_up_runs_its_reads_of_the_observed_layer(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The probe reads one layer (the observed one) of the sources and of the written slots: other
    kernel variants than a group's, compiled before serving too; still only the null block."""
    store = _store("aggressive", "triton", probe=True)
    assert store.probes_compressions and store.observe_layer is not None
    kv_before = {n: t.clone() for n, t in store.kv_caches.items()}
    seen: list[Format] = []
    written = WorkerStore.written

    def counting(self, layer, fmt_l, table):  # type: ignore[no-untyped-def]
        seen.append(fmt_l)
        return written(self, layer, fmt_l, table)

    monkeypatch.setattr(WorkerStore, "written", counting)
    done = warm_up_step_groups(store)
    assert len(done) == 10 and len(seen) == 10
    for name, kv in store.kv_caches.items():
        assert _same(kv[NULL_BLOCK + 1:], kv_before[name][NULL_BLOCK + 1:]), name
    assert store.remap == {} and store.take_report() is None


def test_a_step_kernel_compiles_once_for_any_action_count() -> None:
    """Triton specializes an integer argument equal to 1 or divisible by 16, and a pointer by its
    16-byte alignment: the action count and the step table's offset change every step, so the
    kernels opt out of both (else a step of a new count compiled again, seconds on the H100's host;
    with only `tbl_ptr` listed, the H100 still compiled a variant per group at an odd offset)."""
    code = ("from proxima.compression.kernels import step, cluster\n"
            "for k in (step._quant_step_kernel, step._dequant_step_kernel, cluster._cluster_kernel):\n"
            "    ps = {p.name: p for p in k.params}\n"
            "    print(ps['A'].do_not_specialize, ps['A'].do_not_specialize_on_alignment,\n"
            "          ps['tbl_ptr'].do_not_specialize_on_alignment, ps['rows_ptr'].do_not_specialize_on_alignment)\n")
    env = {"PATH": "/usr/bin:/bin"}  # no TRITON_INTERPRET: the compiled kernels' own parameters
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=".",
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True"] * 4 * 3, out.stdout


def test_a_format_the_readers_cannot_read_is_not_run() -> None:
    store = _store("aggressive", "torch")
    store.format_gate = lambda f: "no code for it" if f.reduction_ratio >= 8 else None
    names = {f"{s.name}->{d.name}" for s, d in step_groups_of(store)}
    assert "bf16->cluster(8)+int4" not in names and "int4->cluster(2)+int4" in names
    assert not any(Format.parse("cluster(8)+int4") in pair for pair in step_groups_of(store))
