"""The worker role of Proxima's KV connector: it owns the worker's store, finds the layers that
read compressed blocks, executes plans, and is how the attention backends reach the store."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

from proxima.formats import Format
from proxima.integration.vllm.attention.triton import ProximaTritonAttentionImpl
from proxima.integration.vllm.connector import ProximaConnector, worker_store
from proxima.integration.vllm.plan import NO_READER, CompressAction, ProximaPlan, ProximaReport
from proxima.integration.vllm.worker.store import WorkerStore
from tests.integration.vllm.engine_helpers import compression_probe_off

NB, H, HQ, B, D = 16, 2, 4, 32, 64


def _caches() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NB, H, B, 2 * D).bfloat16() for i in range(2)}


def _build_layers(connector: ProximaConnector, impl_cls: type, names: list[str]) -> None:
    """What vLLM's Attention layers do when the model is built, before the connector exists: each
    constructs its backend's implementation and enters the forward context (the connector reads
    only each layer's `impl`). The CUDA backend's implementations: vLLM's CPU one needs a whole
    model config to be constructed."""
    cfg = connector._vllm_config
    with set_current_vllm_config(cfg):
        for name in names:
            impl = impl_cls(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=H, alibi_slopes=None,
                            sliding_window=None, kv_cache_dtype="auto")
            cfg.compilation_config.static_forward_context[name] = SimpleNamespace(impl=impl)


def _compress_one(connector: ProximaConnector, action_id: int) -> ProximaReport:
    """One step as vLLM drives the worker's connector: bind the plan, then collect the report."""
    compression_probe_off(connector.store)  # (the probe: test_worker_probe.py)
    connector.bind_connector_metadata(ProximaPlan(actions=[CompressAction(action_id, "r", 0, src=1, dst=10, slot=0,
                                                                          fmt=Format.parse("int4"))]))  # fmt: skip
    rep = connector.build_connector_worker_meta()
    assert isinstance(rep, ProximaReport)
    return rep


def test_the_backends_reach_the_store_of_the_active_connector(worker_connector: ProximaConnector) -> None:
    assert isinstance(worker_connector.store, WorkerStore)
    assert worker_store() is worker_connector.store
    caches = _caches()
    worker_connector.register_kv_caches(caches)
    assert worker_connector.store.kv_caches == caches and worker_connector.store.active


def test_without_proximas_connector_there_is_no_store(worker_connector: ProximaConnector,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)  # vLLM without a connector
    assert worker_store() is None
    other = ExampleConnector(worker_connector._vllm_config, KVConnectorRole.WORKER, None)  # type: ignore[arg-type]  # another connector
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", other)
    assert worker_store() is None


def test_the_scheduler_role_has_no_store(worker_connector: ProximaConnector) -> None:
    sched = ProximaConnector(worker_connector._vllm_config, KVConnectorRole.SCHEDULER)
    assert sched.store is None
    with pytest.raises(RuntimeError, match="worker-side connector hook ran on the SCHEDULER"):
        sched.register_kv_caches(_caches())


def test_without_a_proxima_backend_on_the_layers_nothing_is_compressed(worker_connector: ProximaConnector) -> None:
    """vLLM's own attention (here CUDA without `--attention-backend CUSTOM`) would read the freed
    source blocks: every action fails, the blocks stay hot, and the report says why."""
    caches = _caches()
    before = {k: v.clone() for k, v in caches.items()}
    _build_layers(worker_connector, TritonAttentionImpl, list(caches))
    worker_connector.register_kv_caches(caches)
    rep = _compress_one(worker_connector, 7)
    assert rep.failed == [7] and not rep.ok and rep.errors == [NO_READER]
    assert all(torch.equal(before[k], caches[k]) for k in caches)


def test_proximas_backend_on_the_layers_is_a_reader(worker_connector: ProximaConnector) -> None:
    caches = _caches()
    _build_layers(worker_connector, ProximaTritonAttentionImpl, list(caches))
    worker_connector.register_kv_caches(caches)
    store = worker_connector.store
    assert store is not None and store.readers == {"ProximaTritonAttentionImpl"}
    rep = _compress_one(worker_connector, 8)
    assert rep.ok == [8] and not rep.failed
    assert store.remap["r"][0][1:] == (10, 0)


def test_a_sampled_step_counts_the_connectors_step(worker_connector: ProximaConnector) -> None:
    """The connector's step (`bind_connector_metadata`: the apply and the device table's update)
    under the step counter (`worker/step_counter.py`): its report carries what `OpCounter` counts
    around the same step of the same shape; the first compressing step is never sampled."""
    from proxima.integration.vllm.worker.step_counter import OpCounter, StepCounter

    caches = _caches()
    _build_layers(worker_connector, ProximaTritonAttentionImpl, list(caches))
    worker_connector.register_kv_caches(caches)
    store = worker_connector.store
    assert store is not None
    compression_probe_off(store)

    def bind(aid: int) -> None:  # one block of request "r" into int4, as vLLM binds a step's plan
        act = CompressAction(aid, "r", aid, src=aid, dst=10 + aid // 4, slot=aid % 4, fmt=Format.parse("int4"))
        worker_connector.bind_connector_metadata(ProximaPlan(actions=[act]))

    def report(aid: int) -> ProximaReport:
        rep = worker_connector.build_connector_worker_meta()
        assert isinstance(rep, ProximaReport) and rep.ok == [aid], rep
        return rep

    store.counter = StepCounter(enabled=True, every=2)  # the 2nd compressing step, then every other
    bind(1)
    assert report(1).step_counts == []
    bind(2)
    sampled = report(2).step_counts
    store.counter = StepCounter(enabled=False)
    with OpCounter() as c:
        bind(3)
    report(3)
    assert sampled == [{"launches": c.counts.device_kernels, "memcpys": c.counts.uploads,
                        "syncs": c.counts.total_syncs}]
    assert c.counts.uploads >= 1 and c.counts.device_kernels >= 1
