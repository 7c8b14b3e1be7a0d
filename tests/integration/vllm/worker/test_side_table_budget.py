"""The start-up word on the side tables' GPU memory (`worker/side_table_budget.py`)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from proxima.integration.vllm.worker.side_table_budget import Budget, check_at_startup, worst_case_bytes
from proxima.policies import policy_path
from proxima.policy.loader import load_policy

GIB = 1 << 30
# Llama-3.1-8B's KV shape at block 32: 32 layers, 8 KV heads, head dim 128 (a 4 MiB block)
L, H, B, D = 32, 8, 32, 128
BLOCK_BYTES = L * H * B * 2 * D * 2


def load_named(name: str):  # type: ignore[no-untyped-def]
    return load_policy(policy_path(name))


@pytest.mark.parametrize(("name", "ratio"), [("conservative", 0.25), ("balanced", 0.5), ("aggressive", 1.156)])
def test_the_worst_case_of_the_shipped_policies_in_pool_bytes(name: str, ratio: float) -> None:
    """The policy's formats share one arena over every pool block, each block's region the largest
    format's (the numbers the module docstring quotes; one table per format: 0.328 / 1.234 / 2.469)."""
    worst = worst_case_bytes(load_named(name), L, 1000, H, B, D)
    assert worst / (1000 * BLOCK_BYTES) == pytest.approx(ratio, abs=5e-4)


def test_the_worst_case_is_what_the_worker_allocates() -> None:
    """The bound counts the very tables the worker allocates: every format of the policy written
    once (the warm-up's reach), the side tables grow no further."""
    from proxima.integration.vllm.worker.store import WorkerStore

    policy = load_named("aggressive")
    n, h, b, d = 9, 2, 32, 64
    store = WorkerStore()
    store.register({f"l{i}": torch.zeros(n, h, b, 2 * d, dtype=torch.bfloat16) for i in range(3)}, policy)
    for f in policy.stored_formats(3):
        if f.name != "hot":
            store.slot_pool(f)
    assert worst_case_bytes(policy, 3, n, h, b, d) == store.stack.meta_bytes > 0


def test_the_utilization_that_fits_leaves_room_for_the_worst_case() -> None:
    """H200-like: 141 GiB, utilization 0.9, 16 GiB of weights and activations, the rest pool."""
    total, util = 141 * GIB, 0.9
    pool = int(util * total) - 16 * GIB
    worst = int(1.234 * pool)
    b = Budget(worst, pool, total, util)
    assert not b.fits
    u = b.utilization_that_fits()
    shrunk_pool = pool - (util - u) * total  # vLLM's non-KV memory unchanged
    assert (1 - u) * total == pytest.approx(1.234 * shrunk_pool, rel=1e-6)  # exactly fits there
    assert 0.3 < u < 0.6
    assert Budget(worst // 100, pool, total, util).fits


def test_a_policy_that_can_outgrow_the_budget_is_named_at_startup(caplog: pytest.LogCaptureFixture) -> None:
    total = 141 * GIB
    pool = int(0.9 * total) - 16 * GIB
    shape = (pool // BLOCK_BYTES, H, B, 2 * D)
    with caplog.at_level(logging.WARNING, logger="proxima.vllm"):
        b = check_at_startup(load_named("balanced"), L, shape, pool, total, 0.9)
    assert b is not None and not b.fits
    msg = caplog.text
    assert "policy 'balanced'" in msg and "gpu_memory_utilization <= 0." in msg and "int4h" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="proxima.vllm"):  # a small pool: nothing to say
        assert check_at_startup(load_named("balanced"), L, (64, H, B, 2 * D), 64 * BLOCK_BYTES, total, 0.9).fits
    assert caplog.text == ""
    assert check_at_startup(load_named("off"), L, shape, pool, total, 0.9) is None


def test_the_connector_checks_cuda_pools_vllm_sized_itself(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The connector's hook: a CUDA pool sized from gpu_memory_utilization is checked with the
    device's memory; CPU pools and overridden pools are not."""
    from proxima.integration.vllm.connector import ProximaConnector

    total = 141 * GIB
    n = (int(0.9 * total) - 16 * GIB) // BLOCK_BYTES

    class FakeCudaLayer:  # what the hook reads of a CUDA KV tensor
        device = torch.device("cuda", 0)
        shape = (n, H, B, 2 * D)

        def numel(self) -> int:
            return n * H * B * 2 * D

        def element_size(self) -> int:
            return 2

    seen: list[object] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (seen.append(dev), (0, total))[1])
    conn = object.__new__(ProximaConnector)
    store = SimpleNamespace(policy=load_named("aggressive"))
    for override, warned in ((None, True), (512, False)):
        conn._vllm_config = SimpleNamespace(  # type: ignore[attr-defined]
            cache_config=SimpleNamespace(num_gpu_blocks_override=override, gpu_memory_utilization=0.9))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="proxima.vllm"):
            conn._check_side_table_budget(store, {f"l{i}": FakeCudaLayer() for i in range(L)})  # type: ignore[arg-type]
        assert ("policy 'aggressive'" in caplog.text) is warned
    assert len(seen) == 1  # the device was asked once: for the pool vLLM sized itself
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="proxima.vllm"):  # CPU: pages commit where written
        conn._vllm_config = SimpleNamespace(  # type: ignore[attr-defined]
            cache_config=SimpleNamespace(num_gpu_blocks_override=None, gpu_memory_utilization=0.9))
        conn._check_side_table_budget(store, {"l0": torch.zeros(4, H, B, 2 * D)})  # type: ignore[arg-type]
    assert caplog.text == "" and len(seen) == 1


def test_the_check_never_stops_the_engine(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Advice only: a device that cannot be asked (or any other failure) is logged, not raised."""
    from proxima.integration.vllm.connector import ProximaConnector

    def broken(dev: object = None) -> tuple[int, int]:
        raise RuntimeError("no device here")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    conn = object.__new__(ProximaConnector)
    conn._vllm_config = SimpleNamespace(  # type: ignore[attr-defined]
        cache_config=SimpleNamespace(num_gpu_blocks_override=None, gpu_memory_utilization=0.9))
    layer = SimpleNamespace(device=torch.device("cuda", 0), shape=(8, H, B, 2 * D))
    with caplog.at_level(logging.INFO, logger="proxima.vllm"):
        conn._check_side_table_budget(SimpleNamespace(policy=load_named("aggressive")), {"l0": layer})  # type: ignore[arg-type]
    assert "side-table budget not checked: no device here" in caplog.text
