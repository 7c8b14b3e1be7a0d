"""The one-pass decode kernel over mixed blocks, under TRITON_INTERPRET=1 on CPU (compiled on a
GPU: the kernel tests below run on CUDA there, `DEV`): against dense attention over the worker's
decompressed blocks and against the existing paged path, over the worker's real slot pools and
the connector's device block table."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton (vLLM does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from proxima.compression.mixed_decode import READS_QUANTS, block_mass, mixed_decode, pool_descriptors
from proxima.compression.paged import PagedRow, paged_attention, plan_rows
from proxima.formats import Format
from proxima.integration.vllm import POLICY_ENV
from proxima.integration.vllm.attention import triton as cb
from proxima.integration.vllm.connector import ProximaConnector
from proxima.integration.vllm.plan import CompressAction, ProximaPlan
from proxima.integration.vllm.worker.store import WorkerStore
from tests.integration.vllm.attention.test_cuda_backend import parent_kernel_stub  # noqa: F401 (a fixture)
from tests.integration.vllm.engine_helpers import compression_probe_off

NB, H, HQ, B, D = 40, 2, 4, 16, 32
LAYER = "layer.0"
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# request -> (physical blocks, seq_len, {logical block: (fmt, dst, slot)}); one query token each
REQUESTS = {
    "a": ([1, 2, 3, 4], 60, {0: ("int8", 20, 0), 1: ("int4", 21, 0), 2: ("fp8", 22, 1)}),
    "b": ([5, 6], 20, {}),
    "c": ([7, 8, 9, 10], 55, {0: ("int2", 23, 3), 1: ("cluster(2)+int4", 24, 0), 2: ("int8", 20, 1)}),
    "d": ([11], 9, {}),
    # runs of one format: with tiles of 2 blocks, [0, 1] is a tile of int4 slots and [2, 3] one of
    # cluster(2)+int4 slots (read block by block), [4] the page with the query token
    "e": ([12, 13, 14, 15, 16], 70, {0: ("int4", 25, 0), 1: ("int4", 25, 1), 2: ("cluster(2)+int4", 26, 0),
                                     3: ("cluster(2)+int4", 26, 1)}),
    # the lean formats (rotated codes, issue 40) beside a KIVI block: with tiles of 2, [0, 1] is a
    # tile of int4h and int2h, [2, 3] one of cluster(2)+int4h and int4
    "f": ([27, 28, 29, 30, 31], 75, {0: ("int4h", 32, 0), 1: ("int2h", 33, 0), 2: ("cluster(2)+int4h", 34, 0),
                                     3: ("int4", 25, 2)}),
}


LEAN_STARTUP = Path(__file__).with_name("lean_startup.yaml")


@pytest.fixture(autouse=True)
def _one_pass_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device table these tests read exists only with the one-pass decode on (the connector
    reads the switch when the caches are registered); a test may turn it off after."""
    monkeypatch.setenv(cb.ONE_PASS_ENV, "1")


def _registered(connector: ProximaConnector) -> tuple[WorkerStore, torch.Tensor]:
    """The connector's worker with one layer's cache registered, read by Proxima's backend."""
    kv = torch.randn(NB, H, B, 2 * D).bfloat16().to(DEV)
    impl = cb.ProximaTritonAttentionImpl(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=H,
                                         alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    connector._vllm_config.compilation_config.static_forward_context[LAYER] = SimpleNamespace(impl=impl)
    connector.register_kv_caches({LAYER: kv})
    store = connector.store
    assert store is not None
    return store, kv


def _world(connector: ProximaConnector, group: int | None = None
           ) -> tuple[WorkerStore, torch.Tensor, dict[str, torch.Tensor]]:
    """The connector's worker with REQUESTS' blocks compressed (with `group`: the storage's KIVI
    group instead of the policy's, e.g. 8 < the block size: several key groups per slot)."""
    torch.manual_seed(0)
    store, kv = _registered(connector)
    # request f's lean blocks: as the connector sets it up when the start-up policy stores a lean
    # format (`test_a_start_up_policy_with_a_lean_format_compiles_the_lean_reader_in`)
    store.one_pass_lean, store.readable_quants = True, READS_QUANTS
    compression_probe_off(store)
    if group is not None:
        from proxima.policy.schema import Storage

        store.storage = Storage(group_size=group)
    todo = [(rid, j, blocks[j], *p) for rid, (blocks, _, comp) in REQUESTS.items() for j, p in comp.items()]
    acts = [CompressAction(i, rid, j, src=src, dst=dst, slot=slot, fmt=Format.parse(fmt))
            for i, (rid, j, src, fmt, dst, slot) in enumerate(todo)]
    connector.bind_connector_metadata(ProximaPlan(actions=acts))
    rep = connector.build_connector_worker_meta()
    assert rep is not None and sorted(rep.ok) == list(range(len(acts))), rep
    tables = torch.zeros(len(REQUESTS), 5, dtype=torch.int32)  # 5: the longest request's blocks
    slots, key_blocks = [], {}
    for r, (rid, (blocks, n, comp)) in enumerate(REQUESTS.items()):
        for j, phys in enumerate(blocks):
            if j in comp:
                kv[phys] = 1e4  # freed and reused: nothing may read it
            tables[r, j] = 0 if j in comp else phys
        slots.append(blocks[(n - 1) // B] * B + (n - 1) % B)
        key_blocks[blocks[(n - 1) // B]] = rid
    kv[0] = 1e4  # vLLM's null block
    connector.bind_connector_metadata(ProximaPlan(key_blocks=key_blocks))
    meta = {
        "block_table": tables.to(DEV),
        "seq_lens": torch.tensor([REQUESTS[r][1] for r in REQUESTS], dtype=torch.int32, device=DEV),
        "query_start_loc": torch.arange(len(REQUESTS) + 1, dtype=torch.int32, device=DEV),
        "slot_mapping": torch.tensor(slots, dtype=torch.long, device=DEV),
    }  # fmt: skip
    return store, kv, meta


def _reference(store: WorkerStore, kv: torch.Tensor, q: torch.Tensor, rid: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of request `rid`'s last token over its decompressed context (centroids
    weighted by their counts); also the mass of each logical block [NB_r, HQ]."""
    blocks, n, comp = REQUESTS[rid]
    ks, vs, lcs, owner = [], [], [], []
    for j, phys in enumerate(blocks):
        if j in comp:
            fmt, dst, slot = comp[j]
            kh, vh, lc = store.read_with_counts(LAYER, Format.parse(fmt), torch.tensor([dst]), torch.tensor([slot]))
            kh, vh, lc = kh[0], vh[0], lc[0]
        else:
            t = min(B, n - j * B)
            kh, vh = kv[phys, :, :t, :D].transpose(0, 1), kv[phys, :, :t, D:].transpose(0, 1)
            lc = torch.zeros(t, H, device=kv.device)
        ks.append(kh)
        vs.append(vh)
        lcs.append(lc)
        owner += [j] * kh.shape[0]
    k = torch.cat(ks).float().repeat_interleave(HQ // H, 1)
    v = torch.cat(vs).float().repeat_interleave(HQ // H, 1)
    lc = torch.cat(lcs).float().repeat_interleave(HQ // H, 1)
    logits = torch.einsum("hd,thd->ht", q.float(), k) * D**-0.5 + lc.T
    p = torch.softmax(logits, -1)
    mass = torch.zeros(len(blocks), HQ, device=p.device).index_add_(0, torch.tensor(owner, device=p.device), p.T)
    return torch.einsum("ht,thd->hd", p, v), mass


def _pools(connector: ProximaConnector, store: WorkerStore) -> torch.Tensor:
    t = connector.block_table
    assert t is not None
    pools = {c + 1: cb.slot_pool_of(store, LAYER, f, DEV) for c, f in enumerate(t.formats)}
    return pool_descriptors(pools, B, DEV)


@pytest.mark.parametrize(("splits", "tiles", "group", "comp", "reader"),
                         [(1, None, None, None, "tiles"), (1, 1, None, None, "tiles"), (2, 1, None, None, "tiles"),
                          (3, 1, None, None, "tiles"), (2, 2, None, None, "tiles"), (1, 2, None, 1, "tiles"),
                          (2, None, 8, None, "tiles"), (3, None, 8, 2, "tiles"), (1, 1, 8, 1, "tiles"),
                          (2, 2, 8, 2, "tiles"), (1, None, None, None, "kernel"), (3, 1, None, None, "kernel"),
                          (2, None, 8, None, "kernel"), (3, 2, 8, None, "kernel"), (1, None, 32, None, "kernel")])
def test_one_launch_equals_dense_attention_over_every_format(worker_connector: ProximaConnector, splits: int,
                                                             tiles: int | None, group: int | None,
                                                             comp: int | None, reader: str) -> None:
    """Whatever the split of the context over programs (3 over rows of 1-4 blocks: uneven runs,
    and splits with no block at all) and the tile (1 block: rows a and c read their last page as a
    tile of its own after their compressed blocks; 2 and the default 8: tiles mixing formats and
    pages, block by block, and all-pages tiles, partial ones in rows b and d; row e: runs of one
    compressed format) and the storage's group (8: two KIVI key groups per 16-token slot, read per
    token; the policy's 32: one scale row per slot) and the compressed tile (the default: as many
    blocks as the page tile; 1 and 2: tiles of mixed quantizations split by the tile's edges), the
    merged result and the per-block mass are the same. Also with the compressed blocks read by a
    kernel of their own (`reader` "kernel", `mixed_comp.py`), per token (group 8, and no group
    given) and with one key-scale row per slot (group 32 given as the storage's)."""
    store, kv, meta = _world(worker_connector, group)
    if group is not None:  # the slots were written with it
        assert cb.slot_pool_of(store, LAYER, Format.parse("int4"), DEV).group_size == group
    t = worker_connector.block_table
    assert t is not None and len(t.formats) == 8  # int8, int4, fp8, int2, cluster(2)+int4, int4h, int2h, c(2)+int4h
    q = torch.randn(len(REQUESTS), HQ, D).bfloat16().to(DEV)
    out = torch.full_like(q, float("nan"))
    ent = torch.empty(len(REQUESTS), 5, HQ, device=DEV)
    lse = torch.empty(len(REQUESTS), HQ, device=DEV)
    mixed_decode(q, out, kv, meta["block_table"], meta["seq_lens"], meta["query_start_loc"], meta["slot_mapping"],
                 t.owner, t.entries, _pools(worker_connector, store), sm_scale=D**-0.5, entry_lse=ent, lse=lse,
                 splits=splits, tile_blocks=tiles, comp_tile=comp, compressed_reader=reader,
                 key_group=group if reader == "kernel" else None)
    mass = block_mass(ent, lse)
    for r, rid in enumerate(REQUESTS):
        want, want_mass = _reference(store, kv, q[r], rid)
        err = float((out[r].float() - want).norm() / want.norm())
        assert err < 1e-2, (rid, err)
        nblk = len(REQUESTS[rid][0])
        assert torch.allclose(mass[r, :nblk], want_mass, atol=2e-3), rid
        assert mass[r, nblk:].eq(0).all()


def test_a_start_up_policy_with_a_lean_format_compiles_the_lean_reader_in(worker_connector: ProximaConnector,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLICY_ENV, str(LEAN_STARTUP))
    store, _ = _registered(worker_connector)
    assert store.one_pass_lean and store.readable_quants == READS_QUANTS


def test_a_start_up_policy_without_lean_formats_leaves_the_lean_reader_out(worker_connector: ProximaConnector) -> None:
    """The lean reader costs every other format of the kernel, so the connector compiles it in only
    when the start-up policy stores a lean format. With `off` at start (the fixture's), a lean
    format a live policy brings later is refused: the block stays hot and the report says why,
    and the blocks of other formats are written."""
    store, _ = _registered(worker_connector)
    assert not store.one_pass_lean
    assert store.readable_quants is not None
    assert "int4h" not in store.readable_quants and "int4" in store.readable_quants
    compression_probe_off(store)
    acts = [CompressAction(0, "a", 0, src=1, dst=20, slot=0, fmt=Format.parse("int4h")),
            CompressAction(1, "a", 1, src=2, dst=21, slot=0, fmt=Format.parse("int4"))]
    worker_connector.bind_connector_metadata(ProximaPlan(actions=acts))
    rep = worker_connector.build_connector_worker_meta()
    assert rep is not None and rep.failed == [0] and rep.ok == [1]
    assert any("int4h" in e and "start-up policy" in e for e in rep.errors), rep.errors


def test_it_agrees_with_the_existing_paged_path(worker_connector: ProximaConnector) -> None:
    store, kv, meta = _world(worker_connector)
    t = worker_connector.block_table
    assert t is not None
    q = torch.randn(len(REQUESTS), HQ, D).bfloat16().to(DEV)
    out = torch.empty_like(q)
    mixed_decode(q, out, kv, meta["block_table"], meta["seq_lens"], meta["query_start_loc"], meta["slot_mapping"],
                 t.owner, t.entries, _pools(worker_connector, store), sm_scale=D**-0.5)
    rows = [PagedRow(meta["block_table"][r].tolist(), n, 1, store.remap.get(rid, {}))
            for r, (rid, (_, n, _)) in enumerate(REQUESTS.items())]
    plan = plan_rows(rows, B).to(DEV)
    from proxima.compression.layout import KVLayout, hot_store

    hot = hot_store(kv, KVLayout.FLASH_ATTN, num_kv_heads=H, head_dim=D)
    pools = {s.fmt: cb.slot_pool_of(store, LAYER, s.fmt, kv.device) for s in plan.segments if not s.fmt.is_hot}
    res = paged_attention(q, plan, hot, pools, sm_scale=D**-0.5, backend="torch" if DEV.type == "cpu" else "auto")
    assert torch.allclose(out.float(), res.out.float(), atol=2e-2, rtol=2e-2)


def test_bad_inputs_are_named() -> None:
    q = torch.zeros(2, HQ, D)
    kv = torch.zeros(4, H, B, 2 * D).bfloat16()
    z = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="do not match"):
        mixed_decode(q, torch.zeros(2, HQ, D + 1), kv, z, z, z, z.long(), z, z, z, sm_scale=1.0)
    with pytest.raises(ValueError, match="go together"):
        mixed_decode(q, q.clone(), kv, z, z, z, z.long(), z, z, z, sm_scale=1.0, lse=torch.zeros(2, HQ))
    with pytest.raises(ValueError, match="codes start at 1"):
        pool_descriptors({0: None}, B, torch.device("cpu"))  # type: ignore[dict-item]


# ---- the backend: a uniform decode batch in one launch per layer ----------------------------

VIEW_OPS = {"view", "_unsafe_view", "as_strided", "slice", "select", "t", "transpose", "expand", "alias",
            "detach", "unsqueeze", "squeeze", "permute", "reshape", "empty", "empty_strided", "lift_fresh"}
"""Dispatched ops that launch nothing on a GPU (views and allocations)."""
HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "tolist"}


class _Counter:
    """Kernel launches (Triton launches of the product's kernels, torch ops that would launch a
    kernel) and reads back to the host, while active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import triton.runtime.interpreter as interp
        import triton.runtime.jit as jit
        from torch.utils._python_dispatch import TorchDispatchMode

        self.triton: list[str] = []
        self.torch_ops: list[str] = []
        self.host_reads: list[str] = []
        self.on = False
        counter = self
        for cls in (interp.InterpretedFunction, jit.JITFunction):
            orig = cls.run

            def run(self, *args, _orig=orig, **kwargs):  # type: ignore[no-untyped-def]
                if not counter.on:
                    return _orig(self, *args, **kwargs)
                counter.triton.append(getattr(self, "__name__", None) or self.fn.__name__)
                counter.on = False  # the interpreter's own tensor work inside a launch is the launch
                try:
                    return _orig(self, *args, **kwargs)
                finally:
                    counter.on = True

            monkeypatch.setattr(cls, "run", run)
        for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
            orig_m = getattr(torch.Tensor, name)

            def read(self, *args, _orig=orig_m, _name=name, **kwargs):  # type: ignore[no-untyped-def]
                if counter.on:
                    counter.host_reads.append(_name)
                return _orig(self, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, read)

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                name = func.overloadpacket.__name__
                if counter.on:
                    if name in HOST_READS:
                        counter.host_reads.append(name)
                    elif name not in VIEW_OPS:
                        counter.torch_ops.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Ops()

    def __enter__(self) -> _Counter:
        self.triton.clear(), self.torch_ops.clear(), self.host_reads.clear()
        self.on = True
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)
        self.on = False

    @property
    def launches(self) -> int:
        return len(self.triton) + len(self.torch_ops)


def _common(meta: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n = len(REQUESTS)
    return CommonAttentionMetadata(
        query_start_loc=meta["query_start_loc"], query_start_loc_cpu=meta["query_start_loc"].clone(),
        seq_lens=meta["seq_lens"], num_reqs=n, num_actual_tokens=n, max_query_len=1,
        max_seq_len=int(meta["seq_lens"].max()), block_table_tensor=meta["block_table"],
        slot_mapping=meta["slot_mapping"],
    )  # fmt: skip


@pytest.fixture
def no_parent_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's kernel must not run on a decode batch the one-pass kernel serves."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    def forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("vLLM's kernel ran on a row the one-pass decode serves")

    monkeypatch.setattr(TritonAttentionImpl, "forward", forward)


@pytest.mark.parametrize("reader", ["tiles", "kernel"])
@pytest.mark.parametrize("layers", [1, 3])
def test_a_decode_batch_is_one_launch_per_layer_and_building_reads_nothing_back(
    worker_connector: ProximaConnector, no_parent_kernel: None, monkeypatch: pytest.MonkeyPatch, layers: int,
    reader: str
) -> None:
    """Item 6 of issue 38: one forward of the backend over a batch mixing bf16 pages and eight
    compressed formats (the lean ones among them) launches at most 2 kernels per layer (here 1: the observed layer's
    importance is still planned on the host, see `importance.py`), and building the step's
    metadata reads nothing back to the host. Counted on the product's own launches. With the
    compressed blocks read by a kernel of their own (`mixed_decode.COMPRESSED_READER` "kernel",
    `mixed_comp.py`; docs/design-decisions.md says why): that kernel first, at most 3 per layer."""
    import proxima.compression.mixed_decode as md
    from tests.integration.vllm.attention.test_cuda_backend import _builder

    monkeypatch.setenv(cb.ONE_PASS_ENV, "1")
    monkeypatch.setattr(md, "COMPRESSED_READER", reader)
    store, kv, meta = _world(worker_connector)
    store.observe_layer = None  # the non-observed layers (the observed one: test below)
    counter = _Counter(monkeypatch)
    impl = worker_connector._vllm_config.compilation_config.static_forward_context[LAYER].impl
    q = torch.randn(len(REQUESTS), HQ, D).bfloat16().to(DEV)
    cm, builder = _common(meta), _builder()
    with counter:
        m = builder.build(0, cm)
    assert isinstance(m, cb.ProximaTritonMetadata) and m.px_table is worker_connector.block_table
    assert counter.host_reads == [], counter.host_reads
    impl.layer_descriptors(LAYER, store, m.px_table, kv.device)  # built once per layer, not per step
    outs = [torch.full_like(q, float("nan")) for _ in range(layers)]
    with counter:
        for out in outs:
            impl.forward(SimpleNamespace(layer_name=LAYER), q, None, None, kv, m, out)
    per_layer = ["_comp_decode_kernel", "_mixed_decode_kernel"] if reader == "kernel" else ["_mixed_decode_kernel"]
    assert counter.triton == per_layer * layers, counter.triton
    assert counter.launches <= (3 if reader == "kernel" else 2) * layers, (counter.triton, counter.torch_ops)
    assert counter.host_reads == [], counter.host_reads
    for r, rid in enumerate(REQUESTS):
        want, _ = _reference(store, kv, q[r], rid)
        assert float((outs[-1][r].float() - want).norm() / want.norm()) < 1e-2, rid


def test_without_the_switch_or_with_a_prefill_row_the_split_path_runs(worker_connector: ProximaConnector,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.integration.vllm.attention.test_cuda_backend import _builder

    _, _, meta = _world(worker_connector)
    monkeypatch.setenv(cb.ONE_PASS_ENV, "0")
    assert _builder().build(0, _common(meta)).px_table is None  # switch off: the existing path
    monkeypatch.delenv(cb.ONE_PASS_ENV)  # the default on a CPU cache: off (on CUDA it is on)
    assert _builder().build(0, _common(meta)).px_table is None
    monkeypatch.setenv(cb.ONE_PASS_ENV, "1")
    cm = _common(meta)
    cm.max_query_len = 2  # a prefill or verification row: the existing path
    assert _builder().build(0, cm).px_table is None
    assert _builder().build(0, _common(meta)).px_table is not None


def test_the_observed_layer_on_the_one_pass_path_still_reports_importance(
    worker_connector: ProximaConnector, no_parent_kernel: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.integration.vllm.attention.test_cuda_backend import _builder

    monkeypatch.setenv(cb.ONE_PASS_ENV, "1")
    store, kv, meta = _world(worker_connector)
    assert store.observe_layer == LAYER
    impl = worker_connector._vllm_config.compilation_config.static_forward_context[LAYER].impl
    q = torch.randn(len(REQUESTS), HQ, D).bfloat16().to(DEV)
    out = torch.empty_like(q)
    impl.forward(SimpleNamespace(layer_name=LAYER), q, None, None, kv, _builder().build(0, _common(meta)), out)
    rep = worker_connector.build_connector_worker_meta()
    assert rep is not None and set(rep.importance) == set(REQUESTS)  # type: ignore[attr-defined]
    for r, rid in enumerate(REQUESTS):
        want, _ = _reference(store, kv, q[r], rid)
        assert float((out[r].float() - want).norm() / want.norm()) < 1e-2, rid



def test_a_format_without_a_free_code_is_refused_and_a_freed_code_serves_it(worker_connector: ProximaConnector) -> None:
    """Under CUDA graphs the decode replays the one-pass kernel whatever the host decides, so a
    block must never be stored in a format that has no code in the device table (the H100 soak of
    2026-12-06 ran out of codes, the table stopped following, and logprobs turned NaN). The
    worker asks the table first: a format that cannot get a code is refused (the block stays,
    the report says why), the others are written; once no block holds a code it serves the next."""
    store, _ = _registered(worker_connector)
    t = worker_connector.block_table
    assert t is not None and store.format_gate == t.refusal
    compression_probe_off(store)
    t.max_codes = 1
    int4, int8 = Format.parse("int4"), Format.parse("int8")
    worker_connector.bind_connector_metadata(ProximaPlan(actions=[CompressAction(0, "a", 0, src=1, dst=20, slot=0,
                                                                                 fmt=int4)], key_blocks={3: "a"}))
    rep = worker_connector.build_connector_worker_meta()
    assert rep is not None and rep.ok == [0] and set(t.coded()) == {int4}
    worker_connector.bind_connector_metadata(ProximaPlan(actions=[CompressAction(1, "a", 1, src=2, dst=21, slot=0,
                                                                                 fmt=int8)], key_blocks={3: "a"}))
    rep = worker_connector.build_connector_worker_meta()
    assert rep is not None and rep.failed == [1] and 1 not in store.remap["a"]
    assert any("int8" in e and "formats in use" in e for e in rep.errors), rep.errors
    worker_connector.bind_connector_metadata(ProximaPlan(dropped=["a"]))  # a finishes: int4's code goes back
    worker_connector.build_connector_worker_meta()
    assert t.coded() == {}
    worker_connector.bind_connector_metadata(ProximaPlan(actions=[CompressAction(2, "b", 0, src=4, dst=22, slot=0,
                                                                                 fmt=int8)], key_blocks={5: "b"}))
    rep = worker_connector.build_connector_worker_meta()
    assert rep is not None and rep.ok == [2] and set(t.coded()) == {int8}
    code, sid = t.entries[t.rows["b"], 0].tolist()
    assert t.formats[code - 1] == int8 and sid == 22 * int8.pack_ratio
    assert t.descriptors[LAYER][1][code].any()  # the kernel's descriptor row for the reused code


def test_a_recompressions_old_format_keeps_its_code_for_a_revocation(worker_connector: ProximaConnector) -> None:
    """A recompression moves a block's last int8 entry to int4, but a revocation (another rank
    failed it, tensor parallelism) may put it back: int8 keeps its code meanwhile, so the table
    can follow the revocation, and a third format is refused instead of taking that code."""
    store, _ = _registered(worker_connector)
    t = worker_connector.block_table
    assert t is not None
    compression_probe_off(store)
    t.max_codes = 2
    int8, int4, fp8 = Format.parse("int8"), Format.parse("int4"), Format.parse("fp8")
    first = CompressAction(0, "a", 0, src=1, dst=20, slot=0, fmt=int8)
    worker_connector.bind_connector_metadata(ProximaPlan(actions=[first], key_blocks={3: "a"}))
    worker_connector.build_connector_worker_meta()
    again = CompressAction(1, "a", 0, src=1, dst=21, slot=0, fmt=int4, from_fmt=int8, from_dst=20, from_slot=0)
    worker_connector.bind_connector_metadata(ProximaPlan(actions=[again], key_blocks={3: "a"}))
    rep = worker_connector.build_connector_worker_meta()
    assert rep is not None and rep.ok == [1] and set(t.coded()) == {int8, int4}  # int8: no entry, still coded
    worker_connector.bind_connector_metadata(ProximaPlan(actions=[CompressAction(2, "b", 0, src=4, dst=22, slot=0,
                                                                                 fmt=fp8)], key_blocks={5: "b"}))
    rep = worker_connector.build_connector_worker_meta()
    assert rep is not None and rep.failed == [2]
    worker_connector.bind_connector_metadata(ProximaPlan(revoked=[again], key_blocks={3: "a"}))
    assert worker_connector.block_table is t  # followed, not retired
    code, sid = t.entries[t.rows["a"], 0].tolist()
    assert t.formats[code - 1] == int8 and sid == 20 * int8.pack_ratio


def test_a_block_installed_by_a_late_probe_verdict_enters_the_device_table_at_the_next_plan(
    worker_connector: ProximaConnector,
) -> None:
    """With the compression-time probe on, a measured block is installed when its verdict is read
    (at the report, after its own plan updated the table): the next plan's table update carries it,
    so the one-pass decode reads the slot, not the source block the scheduler then frees."""
    store, _, _ = _world(worker_connector)
    policy = store.policy
    assert policy is not None
    on = policy.probes.compression.model_copy(update={"enabled": True, "max_error": {"int8": 10.0}})
    store.adopt(policy.model_copy(update={"probes": policy.probes.model_copy(update={"compression": on})}),
                store.policy_version)
    store.recent_queries.add("b", torch.randn(8, HQ, D).bfloat16().to(DEV), D**-0.5)
    t = worker_connector.block_table
    assert t is not None
    act = CompressAction(99, "b", 0, src=5, dst=25, slot=0, fmt=Format.parse("int8"))
    worker_connector.bind_connector_metadata(ProximaPlan(actions=[act], key_blocks={6: "b"}))
    assert "b" not in store.remap and store.probing  # written and measured, not installed yet
    assert "b" not in t.rows or int(t.entries[t.rows["b"], 0, 0]) == 0  # the table still reads the page
    rep = worker_connector.build_connector_worker_meta()
    assert rep is not None and rep.ok == [99] and store.remap["b"][0][1:] == (25, 0)
    worker_connector.bind_connector_metadata(ProximaPlan(key_blocks={6: "b"}))
    code, sid = t.entries[t.rows["b"], 0].tolist()
    assert t.formats[code - 1] == Format.parse("int8") and sid == 25 * 2 + 0 and not store.settled

@pytest.mark.usefixtures("parent_kernel_stub")
def test_an_observed_layer_the_one_pass_kernel_cannot_read_is_observed_on_the_host(
    worker_connector: ProximaConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The builder marks the device importance as observed this step; when the observed layer then
    takes the split path (here: soft-capping, which the one-pass kernel refuses), the mark is taken
    back, so the connector reports the host's observation instead of reading a device average that
    nothing updated."""
    from tests.integration.vllm.attention.test_cuda_backend import _builder

    _, kv, meta = _world(worker_connector)
    impl = worker_connector._vllm_config.compilation_config.static_forward_context[LAYER].impl
    monkeypatch.setattr(impl, "logits_soft_cap", 30.0)
    q = torch.randn(len(REQUESTS), HQ, D).bfloat16().to(DEV)
    m = _builder().build(0, _common(meta))
    assert m.px_table is not None and m.px_table.observed is not None
    with pytest.raises(NotImplementedError, match="soft-capping"):  # compressed rows, refused by the split path
        impl.forward(SimpleNamespace(layer_name=LAYER), q, None, None, kv, m, torch.empty_like(q))
    assert m.px_table.observed is None
    rep = worker_connector.build_connector_worker_meta()
    assert rep is not None and set(rep.importance) == set(REQUESTS)  # type: ignore[attr-defined]

COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from proxima.compression import mixed_comp as mc, mixed_decode as md

observe, partial, lean, comp = (a == "1" for a in sys.argv[1:5])
ptrs = {"q_ptr": "*bf16", "o_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "seq_ptr": "*i32",
        "qsl_ptr": "*i32", "slot_ptr": "*i64", "owner_ptr": "*i32", "ent_ptr": "*i32", "desc_ptr": "*i64",
        "ent_out_ptr": "*fp32", "lse_ptr": "*fp32", "part_ml_ptr": "*fp32", "part_acc_ptr": "*fp32",
        "cml_ptr": "*fp32", "cacc_ptr": "*fp32", "anchor_ptr": "*u8", "sm_scale_log2": "fp32"}
kernels = [(md._mixed_decode_kernel, {"G": 4, "G_PAD": 16, "D": 128, "BLOCK_D": 128, "BS": 16, "OBSERVE": observe,
                                      "DOT": True, "DOT_16BIT": True, "PARTIAL": partial,
                                      "TILE_BLOCKS": 4, "VG": 32, "LEAN": lean,
                                      "COMP_TILE": 4 if observe else 2, "TILES": not comp, "COMP_IN": comp})]
if comp:  # the compressed blocks' own kernel at the 8B shape (block 32, one key-scale row per slot)
    kernels.append((mc._comp_decode_kernel, {"G": 4, "G_PAD": 16, "D": 128, "BLOCK_D": 128, "BS": 32,
                                             "OBSERVE": observe, "DOT": True, "DOT_16BIT": True, "TILE_BLOCKS": 4,
                                             "VG": 32, "KEY_ROW": True, "SCAN": 64, "ALIGN": True}))
if partial:
    kernels.append((md._combine_splits_kernel, {"G": 4, "G_PAD": 4, "D": 128, "BLOCK_D": 128, "SPLITS_PAD": 16,
                                                "OBSERVE": observe}))
for fn, consts in kernels:
    names = list(fn.arg_names)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    # pointers 16-byte aligned, as the launcher specializes them (the compressed kernel's vector loads)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(f".entry {fn.__name__}" in ptx)
    if fn is md._mixed_decode_kernel:  # whether the lean reader is in: its rotations are the only fp32 (tf32) dots
        print("tf32" in ptx)
"""


@pytest.mark.parametrize(("observe", "partial", "lean", "comp"),
                         [(False, False, True, False), (True, False, True, False), (True, True, True, False),
                          (False, False, False, False), (False, True, True, True), (True, True, True, True)])
def test_the_kernel_compiles_for_the_h200_without_a_gpu(observe: bool, partial: bool, lean: bool, comp: bool) -> None:
    """The interpreter runs Python, so it accepts what the compiler refuses (e.g. a runtime `if`
    whose branches leave one name with two types). Compile the kernels (with a split context:
    also the merge) for sm_90 to PTX, in a process without TRITON_INTERPRET (this one's
    decorators built interpreter wrappers). The backend's variants hold the lean formats' reader
    (`mixed_decode_lean.py`): its query rotation and final un-rotation are in the PTX; `lean=False`
    (the benchmark's variant without it) leaves them out. `comp`: the compressed blocks' own
    kernel (`mixed_comp.py`) and the main kernel without its tile reader, starting from that
    kernel's state."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", COMPILE, *(str(int(x)) for x in (observe, partial, lean, comp))],
                         env=env, capture_output=True, text=True, timeout=300)
    want = ["True", str(lean)] + ["True"] * comp + ["True"] * partial
    assert res.returncode == 0 and res.stdout.split() == want, res.stderr[-2000:]
