"""Admission of a long prompt under chunked prefill, over a real vLLM `KVCacheManager` (no engine).

vLLM admits a request only if its whole prompt fits uncompressed (`scheduler_reserve_full_isl`).
A policy that compresses finished prompt chunks (`protect.prefilling: false`) replaces that gate
with the prompt's compressed footprint; a policy that waits for the end of the prefill keeps it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from proxima.integration.vllm.manager import ProximaKVCacheManager, install  # noqa: E402
from proxima.policy.loader import load_policy  # noqa: E402
from proxima.policy.schema import Policy  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
B = 32


def _manager(policy: Policy, blocks: int) -> ProximaKVCacheManager:
    spec = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    m = install(KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=B, hash_block_size=B,
                               enable_caching=False), policy)
    assert m is not None
    return m


def _request(rid: str, tokens: int) -> Request:
    return Request(rid, list(range(1, tokens + 1)), SamplingParams(max_tokens=8), None)


@pytest.mark.parametrize("prefilling", [False, True])
def test_a_long_prompt_is_admitted_on_its_compressed_footprint(prefilling: bool) -> None:
    policy = load_policy(ROOT / "configs" / "balanced.yaml")
    policy = policy.model_copy(update={"protect": policy.protect.model_copy(update={"prefilling": prefilling})})
    m = _manager(policy, blocks=24)  # 23 usable blocks
    assert m.allocate_slots(_request("resident", 6 * B), 6 * B) is not None  # 6 blocks used, 17 free
    # 20 blocks of prompt: uncompressed it does not fit. Balanced keeps 1 sink + 2 recent + the
    # tail hot and stores the rest in int4 (4 per block): 4 + ceil(16 / 4) = 8 blocks.
    assert m.compressed_footprint(20 * B) == 8
    got = m.allocate_slots(_request("long", 20 * B), 8 * B, full_sequence_must_fit=True)
    assert (got is not None) == (not prefilling)
    # A prompt whose compressed footprint does not fit either waits, and counts as pressure.
    m2 = _manager(policy, blocks=24)
    assert m2.allocate_slots(_request("resident", 6 * B), 6 * B) is not None
    assert m2.compressed_footprint(64 * B) == 4 + 15
    assert m2.allocate_slots(_request("huge", 64 * B), 8 * B, full_sequence_must_fit=True) is None
    assert m2.px_waiting_need == (19 + 2 if not prefilling else 8 + 1 + 2)  # footprint or chunk, + reserve
