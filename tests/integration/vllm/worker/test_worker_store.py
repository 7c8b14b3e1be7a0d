"""The worker executor and reader on a fake vLLM CPU KV tensor (no engine: fast)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from proxima.formats import Format
from proxima.integration.vllm.plan import NO_READER, CompressAction, ProximaPlan
from proxima.integration.vllm.worker.faults import FAULT_ENV, FAULT_FILE_ENV, parse_fault
from proxima.integration.vllm.worker.store import WorkerStore

NB, H, B, D = 12, 3, 128, 64
TOL = {"int8": 0.02, "fp8": 0.08, "int4": 0.2, "int2": 0.6, "int4h": 0.2, "int2h": 0.6}


def _store() -> tuple[WorkerStore, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    caches = {f"layer.{i}": torch.randn(NB, H, B, 2 * D).to(torch.bfloat16) for i in range(2)}
    st = WorkerStore()
    st.register(caches)
    return st, caches


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4", "int2", "int4h", "int2h"])
def test_roundtrip_into_packed_slots(fmt: str) -> None:
    st, caches = _store()
    f = Format.parse(fmt)
    before = {k: v.clone() for k, v in caches.items()}
    acts = [CompressAction(i, "r", i, src=1 + i, dst=10, slot=i, fmt=f) for i in range(min(f.pack_ratio, 4))]
    st.apply(ProximaPlan(actions=acts))
    rep = st.take_report()
    assert rep is not None and rep.ok == [a.action_id for a in acts] and not rep.failed
    dst = torch.tensor([10] * len(acts))
    slot = torch.tensor([a.slot for a in acts])
    for layer, kv in before.items():
        kh, vh = st.read(layer, f, dst, slot)  # [N, B, H, D]
        assert st.layout is not None
        for i, a in enumerate(acts):
            k, v = st.layout.read_blocks(kv, torch.tensor([a.src]))  # the kernel's page order -> [1, B, H, D]
            k, v = k[0].float(), v[0].float()
            rel_k = (kh[i].float() - k).norm() / k.norm()
            rel_v = (vh[i].float() - v).norm() / v.norm()
            assert rel_k < TOL[fmt] and rel_v < TOL[fmt], (fmt, rel_k, rel_v)
        # Only the destination block changed.
        changed = (caches[layer] != kv).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [10]
    assert st.remap["r"][0] == (f, 10, 0)


def test_no_proxima_backend_means_no_compression() -> None:
    """In a real worker (the connector sets `require_reader`), compressing while vLLM's own
    attention backend runs (CUDA without `--attention-backend CUSTOM`) would read freed blocks:
    every action fails instead, blocks stay hot, and the report says why."""
    st, caches = _store()
    before = {k: v.clone() for k, v in caches.items()}
    st.require_reader = True
    st.apply(ProximaPlan(actions=[CompressAction(7, "r", 0, src=1, dst=10, slot=0, fmt=Format.parse("int4"))]))
    rep = st.take_report()
    assert rep is not None and rep.failed == [7] and not rep.ok and rep.errors == [NO_READER]
    assert "r" not in st.remap and all(torch.equal(before[k], caches[k]) for k in caches)
    st.readers.add("ProximaCPUAttentionBackendImpl")  # what the connector finds on the layers
    st.apply(ProximaPlan(actions=[CompressAction(8, "r", 0, src=1, dst=10, slot=0, fmt=Format.parse("int4"))]))
    rep = st.take_report()
    assert rep is not None and rep.ok == [8] and not rep.failed


def test_a_format_the_readers_cannot_read_fails_and_stays_hot() -> None:
    """With the one-pass decode (the connector sets `readable_quants`), a format its kernel cannot
    read (16-bit centroids: `cluster(2)`, read by the split path only) would be written where the
    decode graphs cannot read it: its actions fail, the others in the same plan run (the lean
    int4h / int2h among them: the kernel reads their rotated codes), and the report names the
    format and the switch."""
    from proxima.compression.mixed_decode import READS_QUANTS

    st, caches = _store()
    before = {k: v.clone() for k, v in caches.items()}
    st.readable_quants = READS_QUANTS
    acts = [CompressAction(7, "r", 0, src=1, dst=10, slot=0, fmt=Format.parse("cluster(2)")),
            CompressAction(8, "r", 1, src=2, dst=11, slot=0, fmt=Format.parse("int4h")),
            CompressAction(9, "r", 2, src=3, dst=9, slot=0, fmt=Format.parse("int2h"))]  # fmt: skip
    st.apply(ProximaPlan(actions=acts))
    rep = st.take_report()
    assert rep is not None and rep.failed == [7] and sorted(rep.ok) == [8, 9]
    assert len(rep.errors) == 1 and "cluster(2)" in rep.errors[0] and "PROXIMA_ONE_PASS_DECODE=0" in rep.errors[0]
    assert set(st.remap["r"]) == {1, 2}
    changed = (caches["layer.0"] != before["layer.0"]).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [9, 11]  # block 10 (the refused action's destination) untouched


def test_injected_fault_keeps_blocks_hot(monkeypatch: pytest.MonkeyPatch) -> None:
    st, caches = _store()
    before = {k: v.clone() for k, v in caches.items()}
    monkeypatch.setenv(FAULT_ENV, "compress")
    st.apply(ProximaPlan(actions=[CompressAction(7, "r", 0, src=1, dst=10, slot=0, fmt=Format.parse("int4"))]))
    rep = st.take_report()
    assert rep is not None and rep.failed == [7] and not rep.ok and rep.errors
    assert "r" not in st.remap
    assert all(torch.equal(before[k], caches[k]) for k in caches)


def test_fault_file_switches_faults_on_and_off_between_steps(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    st, _ = _store()
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, "compress")  # the file, once named, replaces the variable
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))

    def step(aid: int, spelling: str | None) -> tuple[list[int], list[int]]:
        if spelling is None:
            fault.unlink(missing_ok=True)
        else:
            fault.write_text(spelling)
        st.apply(ProximaPlan(actions=[
            CompressAction(aid, "r", aid, src=1 + aid % 4, dst=6 + aid, slot=0, fmt=Format.parse("int8")),
            CompressAction(aid + 100, "r", aid + 100, src=1 + aid % 4, dst=6 + aid, slot=0, fmt=Format.parse("int4")),
        ]))
        rep = st.take_report()
        assert rep is not None
        return rep.ok, rep.failed

    assert step(0, None) == ([0, 100], [])  # no file: no fault
    assert step(1, "compress\n") == ([], [1, 101])  # both batches of the step fail
    assert step(2, "") == ([2, 102], [])
    ok, failed = step(3, "compress@2")  # every second batch: one of the two
    assert len(ok) == 1 and len(failed) == 1
    with caplog.at_level("ERROR", logger="proxima.vllm"):
        assert step(4, "explode") == ([4, 104], [])  # a typo injects nothing and says so
        assert step(5, "explode") == ([5, 105], [])
    assert [r.getMessage() for r in caplog.records if "unknown fault" in r.getMessage()] == [
        f"proxima: {FAULT_FILE_ENV}={fault}: unknown fault 'explode'; expected 'compress' or 'compress@N' "
        "with N >= 1; no fault injected"]
    assert st.faults.injected == 3


def test_fault_spelling() -> None:
    assert parse_fault("", "x") is None and parse_fault(" compress ", "x") == 1 and parse_fault("compress@3", "x") == 3
    for bad in ("compress@0", "compress@", "compress@-1", "kernel"):
        with pytest.raises(ValueError, match="x: unknown fault"):
            parse_fault(bad, "x")


def test_dropped_request_forgotten() -> None:
    st, _ = _store()
    st.apply(ProximaPlan(actions=[CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=Format.parse("int8"))]))
    assert "r" in st.remap
    st.apply(ProximaPlan(dropped=["r"]))
    assert "r" not in st.remap


def test_recompression_reads_the_current_slot() -> None:
    st, caches = _store()
    orig = caches["layer.0"].clone()
    st.apply(ProximaPlan(actions=[CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=Format.parse("int8"))]))
    st.apply(ProximaPlan(actions=[CompressAction(1, "r", 0, src=-1, dst=11, slot=0, fmt=Format.parse("int4"),
                                                 from_fmt=Format.parse("int8"), from_dst=10, from_slot=0)]))
    assert st.remap["r"][0] == (Format.parse("int4"), 11, 0)
    kh, _ = st.read("layer.0", Format.parse("int4"), torch.tensor([11]), torch.tensor([0]))
    assert st.layout is not None
    k = st.layout.read_blocks(orig, torch.tensor([1]))[0][0].float()
    assert (kh[0].float() - k).norm() / k.norm() < TOL["int4"]


def test_released_destinations_are_zeroed_before_the_step() -> None:
    """A destination block's packed bytes read as bf16 include NaN; vLLM's CPU kernel reads whole
    blocks, so a reused destination must not keep them where its new owner has not written yet."""
    st, caches = _store()
    st.apply(ProximaPlan(actions=[CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=Format.parse("int4"))]))
    assert any(kv[10].isnan().any() for kv in caches.values())  # what makes the scrub necessary
    st.apply(ProximaPlan(actions=[CompressAction(1, "s", 0, src=3, dst=11, slot=0, fmt=Format.parse("int4"))]))
    others = {k: torch.cat([v[:10], v[12:]]).clone() for k, v in caches.items()}
    # Block 11 released (its bytes go), block 10 released and reused by the same plan for a
    # new slot: the scrub must run first, or it would wipe the new slot.
    st.apply(ProximaPlan(dropped=["r", "s"], scrub=[10, 11],
                         actions=[CompressAction(2, "q", 0, src=2, dst=10, slot=0, fmt=Format.parse("int8"))]))
    assert st.layout is not None
    for layer, kv in caches.items():
        assert torch.equal(kv[11], torch.zeros_like(kv[11]))
        assert torch.equal(torch.cat([kv[:10], kv[12:]]), others[layer])  # nothing else touched
        kh, _ = st.read(layer, Format.parse("int8"), torch.tensor([10]), torch.tensor([0]))
        k = st.layout.read_blocks(kv, torch.tensor([2]))[0][0].float()
        assert (kh[0].float() - k).norm() / k.norm() < TOL["int8"]
    assert st.remap["q"][0] == (Format.parse("int8"), 10, 0)


SAME_PAYLOAD_FORMATS = ["fp8", "int8", "int4", "int2", "sparse(4)", "cluster(4)", "sparse(2)+int8", "cluster(2)+int4",
                        "int4h", "int2h", "cluster(2)+int4h"]


@pytest.mark.parametrize("fmt", SAME_PAYLOAD_FORMATS)
def test_hf_cache_stores_what_the_vllm_worker_stores(fmt: str) -> None:
    """One compression API: for the same block and format, the transformers cache and the vLLM
    worker hold bit-identical payloads (data and every metadata field), so a damage table
    calibrated on the HF path describes what vLLM stores. The HF side gets the block in float32
    (the CPU quality harness runs the model in float32) and casts it to the 16-bit cache dtype,
    as vLLM holds it."""
    from proxima.compression.spec import slot_spec
    from proxima.integration.hf import ProximaCache

    st, caches = _store()
    f = Format.parse(fmt)
    st.apply(ProximaPlan(actions=[CompressAction(1, "r", 0, src=3, dst=10, slot=1 % f.pack_ratio, fmt=f)]))
    rep = st.take_report()
    assert rep is not None and rep.ok == [1], rep and rep.errors
    assert st.layout is not None
    layer = "layer.0"
    k, v = st.layout.read_blocks(caches[layer], torch.tensor([3]))  # [1, B, H, D] bf16, as vLLM holds it
    hf = ProximaCache(block_size=B)
    hf.update(k.transpose(1, 2).float(), v.transpose(1, 2).float(), 0)
    hf.compress_blocks([0], f)
    slot = hf.proxima_layers[0].slots[0]
    assert slot is not None
    cb = slot.cb
    pool = st.pool(layer, f)
    sid = 10 * f.pack_ratio + 1 % f.pack_ratio

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8).flatten()

    assert torch.equal(bits(cb.k_data[0]), bits(pool.k[sid]))
    assert torch.equal(bits(cb.v_data[0]), bits(pool.v[sid]))
    held = {n for n in ("k_scale", "k_zero", "v_scale", "v_zero", "log_count") if getattr(cb, n) is not None}
    assert set(pool.meta) == held
    for name, t in pool.meta.items():
        assert torch.equal(bits(getattr(cb, name)[0]), bits(t[sid])), name
    spec = slot_spec(f, block_size=B, head_dim=D, num_kv_heads=H)
    assert slot.nbytes == cb.held_nbytes == spec.held_bytes_per_slot


def test_merged_blocks_recompress_with_counts_adding() -> None:
    """cluster(2)+int4 -> cluster(4)+int4 in the worker: centroid pairs merge from the stored slot,
    every (block, head) still accounts for its B tokens, and the slot holds exactly what
    `compress_blocks` makes of the stored rows (the transformers cache's call); a move that
    `recompressible` refuses fails the batch and leaves the old slot as it was."""
    from proxima.compression import compress_blocks

    st, _caches = _store()
    c2, c4 = Format.parse("cluster(2)+int4"), Format.parse("cluster(4)+int4")
    st.apply(ProximaPlan(actions=[CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=c2)]))
    st.take_report()
    rows = {layer: st.read_with_counts(layer, c2, torch.tensor([10]), torch.tensor([0])) for layer in st.kv_caches}
    st.apply(ProximaPlan(actions=[CompressAction(1, "r", 0, src=-1, dst=11, slot=0, fmt=c4,
                                                 from_fmt=c2, from_dst=10, from_slot=0)]))
    rep = st.take_report()
    assert rep is not None and rep.ok == [1], rep and rep.errors
    assert st.remap["r"][0] == (c4, 11, 0)
    for layer, (k2, v2, lc2) in rows.items():
        kh, _vh, lc = st.read_with_counts(layer, c4, torch.tensor([11]), torch.tensor([0]))
        assert kh.shape[1] == B // 4
        assert torch.allclose(lc.exp().sum(1), torch.full((1, H), float(B)))
        want = compress_blocks(c4, k2, v2, token_importance=torch.ones(lc2.shape), log_count=lc2,
                               source_tokens=B, backend="torch")
        pool = st.pool(layer, c4)
        sid = 11 * c4.pack_ratio
        assert torch.equal(want.k_data[0].view(torch.uint8), pool.k[sid])
        assert want.log_count is not None and torch.equal(want.log_count[0], pool.meta["log_count"][sid])
    st.apply(ProximaPlan(actions=[CompressAction(2, "r", 0, src=-1, dst=12, slot=0, fmt=Format.parse("sparse(8)+int4"),
                                                 from_fmt=c4, from_dst=11, from_slot=0)]))
    rep = st.take_report()
    assert rep is not None and rep.failed == [2] and "recompressible" in rep.errors[0]
    assert st.remap["r"][0] == (c4, 11, 0)  # the block stays where it was


def _policy_with_group(group: int, per_quant: dict[str, int] | None = None):
    from proxima.policy.loader import load_policy
    from proxima.policy.schema import Storage

    base = load_policy(Path(__file__).resolve().parents[4] / "proxima" / "policies" / "balanced.yaml")
    # The probe off (with no observed queries it would defer the action) and no layer overrides:
    # the layout is what is tested.
    probe = base.probes.compression.model_copy(update={"enabled": False})
    probes = base.probes.model_copy(update={"compression": probe})
    storage = Storage(group_size=group, group_sizes=per_quant or {})
    return base.model_copy(update={"storage": storage, "probes": probes, "layer_overrides": []})


@pytest.mark.parametrize(("fmt", "per_quant"), [
    ("int8", None), ("int4", None), ("int2", None), ("cluster(2)+int4", None),
    ("int4", {"int2": 32}), ("int2", {"int2": 32}),  # group 64 except int2: int2 at 32, int4 at 64
])
def test_policy_group_size_reaches_both_integrations(fmt: str, per_quant: dict[str, int] | None) -> None:
    """`storage.group_size` is one setting: the worker (from the policy it registers with) and the
    transformers cache (from its policy) store the same bytes at group 64, and hold the leaner
    metadata `slot_spec(group_size=64)` counts (int4 at block 128 / head_dim 64: 64 bytes of scales
    and zeros fewer per head than at 32)."""
    from proxima.compression.spec import slot_spec
    from proxima.integration.hf import ProximaCache

    policy = _policy_with_group(64, per_quant)
    f = Format.parse(fmt)
    want = (per_quant or {}).get(f.quant, 64)
    torch.manual_seed(0)
    caches = {f"layer.{i}": torch.randn(NB, H, B, 2 * D).to(torch.bfloat16) for i in range(2)}
    st = WorkerStore()
    st.register(caches, policy)
    assert st.group_for(f) == want
    st.apply(ProximaPlan(actions=[CompressAction(1, "r", 0, src=3, dst=10, slot=0, fmt=f)]))
    rep = st.take_report()
    assert rep is not None and rep.ok == [1], rep and rep.errors
    assert st.layout is not None
    k, v = st.layout.read_blocks(caches["layer.0"], torch.tensor([3]))
    hf = ProximaCache(policy, block_size=B)
    hf.update(k.transpose(1, 2).float(), v.transpose(1, 2).float(), 0)
    hf.compress_blocks([0], f)
    slot = hf.proxima_layers[0].slots[0]
    assert slot is not None and slot.cb.group_size == want
    pool = st.pool("layer.0", f)
    assert pool.spec.group_size == want
    sid = 10 * f.pack_ratio
    assert torch.equal(slot.cb.k_data[0].contiguous().view(torch.uint8), pool.k[sid].contiguous().view(torch.uint8))
    for name, t in pool.meta.items():
        assert torch.equal(getattr(slot.cb, name)[0].contiguous().view(torch.uint8), t[sid].view(torch.uint8)), name
    lean = slot_spec(f, block_size=B, head_dim=D, num_kv_heads=H, group_size=want)
    assert slot.nbytes == lean.held_bytes_per_slot
    if f.quant != "int8" and want == 64:  # int8 values keep a per-token scale: only its keys' groups shrink
        assert lean.meta_bytes_per_slot < slot_spec(f, block_size=B, head_dim=D, num_kv_heads=H).meta_bytes_per_slot


def test_a_group_that_does_not_divide_head_dim_fails_at_registration() -> None:
    """int4 values are grouped along the head dim: group 128 cannot store them at head_dim 64. The
    worker refuses the policy when the caches are registered, naming the field, instead of failing
    every compression batch later."""
    caches = {"layer.0": torch.zeros(NB, H, B, 2 * D, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"storage\.group_size=128 does not divide the model's head_dim 64"):
        WorkerStore().register(caches, _policy_with_group(128))
    want = r"storage\.group_sizes\.int4=128 does not divide the model's head_dim 64: cluster\(2\)\+int4"
    with pytest.raises(ValueError, match=want):
        WorkerStore().register(caches, _policy_with_group(32, {"int4": 128}))


def test_policy_merged_tokens_pin_tokens_in_the_worker_merge() -> None:
    """`protect.merged_tokens` reaches the worker's merge: a first merge and a recompression store
    exactly what `compress_blocks(..., pinned_tokens=2)` makes of the same rows (the transformers
    cache's call), two singleton rows per head ahead of the centroids; with 0 the slot differs."""
    from proxima.compression import compress_blocks

    base = _policy_with_group(32)
    policy = base.model_copy(update={"protect": base.protect.model_copy(update={"merged_tokens": 2})})
    c2, c4 = Format.parse("cluster(2)+int4"), Format.parse("cluster(4)+int4")
    torch.manual_seed(0)
    caches = {f"layer.{i}": torch.randn(NB, H, B, 2 * D).to(torch.bfloat16) for i in range(2)}
    st = WorkerStore()
    st.register(caches, policy)
    pages = {layer: st.layout.read_blocks(kv, torch.tensor([1])) for layer, kv in caches.items()}  # type: ignore[union-attr]
    st.apply(ProximaPlan(actions=[CompressAction(0, "r", 0, src=1, dst=10, slot=0, fmt=c2)]))
    rep = st.take_report()
    assert rep is not None and rep.ok == [0], rep and rep.errors
    for layer, (k, v) in pages.items():
        want = compress_blocks(c2, k, v, token_importance=torch.ones(1, B, H), pinned_tokens=2, backend="torch")
        plain = compress_blocks(c2, k, v, token_importance=torch.ones(1, B, H), backend="torch")
        pool = st.pool(layer, c2)
        sid = 10 * c2.pack_ratio
        assert torch.equal(want.k_data[0].view(torch.uint8), pool.k[sid])
        assert not torch.equal(plain.k_data[0].view(torch.uint8), pool.k[sid])
        _kh, _vh, lc = st.read_with_counts(layer, c2, torch.tensor([10]), torch.tensor([0]))
        assert torch.equal(lc[0, :2], torch.zeros(2, H))
    rows = {layer: st.read_with_counts(layer, c2, torch.tensor([10]), torch.tensor([0])) for layer in st.kv_caches}
    st.apply(ProximaPlan(actions=[CompressAction(1, "r", 0, src=-1, dst=11, slot=0, fmt=c4,
                                                 from_fmt=c2, from_dst=10, from_slot=0)]))
    rep = st.take_report()
    assert rep is not None and rep.ok == [1], rep and rep.errors
    for layer, (k2, v2, lc2) in rows.items():
        want = compress_blocks(c4, k2, v2, token_importance=torch.ones(lc2.shape), log_count=lc2,
                               source_tokens=B, pinned_tokens=2, backend="torch")
        pool = st.pool(layer, c4)
        assert torch.equal(want.k_data[0].view(torch.uint8), pool.k[11 * c4.pack_ratio])
        _kh, _vh, lc = st.read_with_counts(layer, c4, torch.tensor([11]), torch.tensor([0]))
        assert torch.allclose(lc.exp().sum(1), torch.full((1, H), float(B)))
