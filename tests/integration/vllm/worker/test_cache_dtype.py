"""vLLM's own 8-bit KV cache (`kv_cache_dtype` fp8 / int8 / int4 per token head) and Proxima
(`worker/cache_dtype.py`): with `off` Proxima stands aside, with a compressing policy start-up
stops and says what to change; a compression a live policy asks for later fails, the request is
served from its blocks as they are."""

from __future__ import annotations

import pytest
import torch

from proxima.formats import Format
from proxima.integration.vllm.plan import CACHE_8BIT, CompressAction, ProximaPlan
from proxima.integration.vllm.worker.store import WorkerStore
from proxima.policies import policy_path
from proxima.policy.loader import load_policy

NB, H, B, D = 8, 2, 32, 64


def caches(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(NB, H, B, 2 * D, dtype=dtype) for i in range(2)}


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.int8])
def test_off_stands_aside_on_an_8_bit_cache(dtype: torch.dtype) -> None:
    st = WorkerStore()
    kv = caches(dtype)
    st.register(kv, load_policy(policy_path("off")))  # vLLM's CPU kernel cannot write a 16-bit probe page here
    assert not st.compressible and st.layout is None and st.stack.meta_bytes == 0
    before = {k: t.clone() for k, t in kv.items()}
    # A compressing policy adopted later (the runtime API): its compressions fail, nothing is written.
    st.adopt(load_policy(policy_path("balanced")), 1)
    st.apply(ProximaPlan(actions=[CompressAction(3, "r", 0, src=1, dst=5, slot=0, fmt=Format.parse("int4"))]))
    rep = st.take_report()
    assert rep is not None and rep.failed == [3] and not rep.ok and rep.errors == [CACHE_8BIT]
    assert all(torch.equal(before[k].view(torch.uint8), t.view(torch.uint8)) for k, t in kv.items())


def test_a_compressing_policy_on_an_8_bit_cache_stops_at_startup_saying_why() -> None:
    with pytest.raises(ValueError) as e:
        WorkerStore().register(caches(torch.uint8), load_policy(policy_path("balanced")))
    msg = str(e.value)
    assert "'balanced'" in msg and "torch.uint8" in msg and "--kv-cache-dtype" in msg and "PROXIMA_POLICY=off" in msg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_cache_is_compressible(dtype: torch.dtype) -> None:
    st = WorkerStore()
    st.register(caches(dtype), load_policy(policy_path("balanced")))
    assert st.compressible and st.layout is not None and st.stack.meta_bytes > 0
