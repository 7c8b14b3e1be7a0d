"""The one-pass decode kernel over mixed blocks, under TRITON_INTERPRET=1 on CPU: against dense
attention over the worker's decompressed blocks and against the existing paged path, over the
worker's real slot pools and the connector's device block table."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton (vLLM does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from proxima.compression.mixed_decode import block_mass, mixed_decode, pool_descriptors
from proxima.compression.paged import PagedRow, paged_attention, plan_rows
from proxima.formats import Format
from proxima.integration.vllm.attention import triton as cb
from proxima.integration.vllm.connector import ProximaConnector
from proxima.integration.vllm.plan import CompressAction, ProximaPlan
from proxima.integration.vllm.worker.store import WorkerStore
from tests.integration.vllm.engine_helpers import compression_probe_off

NB, H, HQ, B, D = 40, 2, 4, 16, 32
LAYER = "layer.0"
# request -> (physical blocks, seq_len, {logical block: (fmt, dst, slot)}); one query token each
REQUESTS = {
    "a": ([1, 2, 3, 4], 60, {0: ("int8", 20, 0), 1: ("int4", 21, 0), 2: ("fp8", 22, 1)}),
    "b": ([5, 6], 20, {}),
    "c": ([7, 8, 9, 10], 55, {0: ("int2", 23, 3), 1: ("cluster(2)+int4", 24, 0), 2: ("int8", 20, 1)}),
    "d": ([11], 9, {}),
}


def _world(connector: ProximaConnector) -> tuple[WorkerStore, torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    kv = torch.randn(NB, H, B, 2 * D).bfloat16()
    impl = cb.ProximaTritonAttentionImpl(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=H,
                                         alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    connector._vllm_config.compilation_config.static_forward_context[LAYER] = SimpleNamespace(impl=impl)
    connector.register_kv_caches({LAYER: kv})
    store = connector.store
    assert store is not None
    compression_probe_off(store)
    todo = [(rid, j, blocks[j], *p) for rid, (blocks, _, comp) in REQUESTS.items() for j, p in comp.items()]
    acts = [CompressAction(i, rid, j, src=src, dst=dst, slot=slot, fmt=fmt)
            for i, (rid, j, src, fmt, dst, slot) in enumerate(todo)]
    connector.bind_connector_metadata(ProximaPlan(actions=acts))
    rep = connector.build_connector_worker_meta()
    assert rep is not None and sorted(rep.ok) == list(range(len(acts))), rep
    tables = torch.zeros(len(REQUESTS), 5, dtype=torch.int32)
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
        "block_table": tables, "seq_lens": torch.tensor([REQUESTS[r][1] for r in REQUESTS], dtype=torch.int32),
        "query_start_loc": torch.arange(len(REQUESTS) + 1, dtype=torch.int32),
        "slot_mapping": torch.tensor(slots, dtype=torch.long),
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
            lc = torch.zeros(t, H)
        ks.append(kh)
        vs.append(vh)
        lcs.append(lc)
        owner += [j] * kh.shape[0]
    k = torch.cat(ks).float().repeat_interleave(HQ // H, 1)
    v = torch.cat(vs).float().repeat_interleave(HQ // H, 1)
    lc = torch.cat(lcs).float().repeat_interleave(HQ // H, 1)
    logits = torch.einsum("hd,thd->ht", q.float(), k) * D**-0.5 + lc.T
    p = torch.softmax(logits, -1)
    mass = torch.zeros(len(blocks), HQ).index_add_(0, torch.tensor(owner), p.T)
    return torch.einsum("ht,thd->hd", p, v), mass


def _pools(connector: ProximaConnector, store: WorkerStore) -> torch.Tensor:
    t = connector.block_table
    assert t is not None
    pools = {c + 1: cb.slot_pool_of(store, LAYER, f, torch.device("cpu")) for c, f in enumerate(t.formats)}
    return pool_descriptors(pools, B, torch.device("cpu"))


def test_one_launch_equals_dense_attention_over_every_format(worker_connector: ProximaConnector) -> None:
    store, kv, meta = _world(worker_connector)
    t = worker_connector.block_table
    assert t is not None and len(t.formats) == 5  # int8, int4, fp8, int2, cluster(2)+int4
    q = torch.randn(len(REQUESTS), HQ, D).bfloat16()
    out = torch.full_like(q, float("nan"))
    ent = torch.empty(len(REQUESTS), 5, HQ)
    lse = torch.empty(len(REQUESTS), HQ)
    mixed_decode(q, out, kv, meta["block_table"], meta["seq_lens"], meta["query_start_loc"], meta["slot_mapping"],
                 t.owner, t.entries, _pools(worker_connector, store), sm_scale=D**-0.5, entry_lse=ent, lse=lse)
    mass = block_mass(ent, lse)
    for r, rid in enumerate(REQUESTS):
        want, want_mass = _reference(store, kv, q[r], rid)
        err = float((out[r].float() - want).norm() / want.norm())
        assert err < 1e-2, (rid, err)
        nblk = len(REQUESTS[rid][0])
        assert torch.allclose(mass[r, :nblk], want_mass, atol=2e-3), rid
        assert mass[r, nblk:].eq(0).all()


def test_it_agrees_with_the_existing_paged_path(worker_connector: ProximaConnector) -> None:
    store, kv, meta = _world(worker_connector)
    t = worker_connector.block_table
    assert t is not None
    q = torch.randn(len(REQUESTS), HQ, D).bfloat16()
    out = torch.empty_like(q)
    mixed_decode(q, out, kv, meta["block_table"], meta["seq_lens"], meta["query_start_loc"], meta["slot_mapping"],
                 t.owner, t.entries, _pools(worker_connector, store), sm_scale=D**-0.5)
    rows = [PagedRow(meta["block_table"][r].tolist(), n, 1, store.remap.get(rid, {}))
            for r, (rid, (_, n, _)) in enumerate(REQUESTS.items())]
    plan = plan_rows(rows, B)
    from proxima.compression.layout import KVLayout, hot_store

    hot = hot_store(kv, KVLayout.FLASH_ATTN, num_kv_heads=H, head_dim=D)
    pools = {s.fmt: cb.slot_pool_of(store, LAYER, s.fmt, kv.device) for s in plan.segments if not s.fmt.is_hot}
    res = paged_attention(q, plan, hot, pools, sm_scale=D**-0.5, backend="torch")
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
