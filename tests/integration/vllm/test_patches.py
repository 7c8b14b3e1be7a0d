"""The engine-configuration patch: Proxima's connector role and, on CUDA, its attention backend."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from proxima.integration.vllm import kv_transfer_config
from proxima.integration.vllm._patches import select_attention_backend
from proxima.policy.loader import load_policy
from proxima.policy.schema import Policy

ROOT = Path(__file__).resolve().parents[3]
BALANCED = load_policy(ROOT / "proxima" / "policies" / "balanced.yaml")


def _args(backend: object = None, config_backend: object = None) -> SimpleNamespace:
    return SimpleNamespace(attention_backend=backend, attention_config=SimpleNamespace(backend=config_backend))


def test_connector_is_not_a_kv_consumer() -> None:
    # A consumer connector makes vLLM's scheduler defer freeing finished requests' blocks under
    # async scheduling (blocks neither owned nor free for a step): Proxima loads no KV.
    cfg = kv_transfer_config()
    assert cfg.kv_connector == "ProximaConnector" and not cfg.is_kv_consumer


def test_compressing_policy_on_cuda_selects_proximas_backend() -> None:
    args = _args()
    assert select_attention_backend(args, BALANCED, on_cuda=True) == "CUSTOM"
    assert args.attention_backend is AttentionBackendEnum.CUSTOM


@pytest.mark.parametrize("policy", [Policy(enabled=False), load_policy(ROOT / "proxima" / "policies" / "off.yaml")])
def test_policy_off_leaves_vllms_backend_alone(policy: Policy) -> None:
    args = _args()
    assert select_attention_backend(args, policy, on_cuda=True) is None and args.attention_backend is None


def test_cpu_is_left_to_the_plugin() -> None:
    args = _args()
    assert select_attention_backend(args, BALANCED, on_cuda=False) is None and args.attention_backend is None


@pytest.mark.parametrize("where", ["flag", "config"])
def test_another_backend_with_a_compressing_policy_is_refused(where: str) -> None:
    args = _args(AttentionBackendEnum.TRITON_ATTN) if where == "flag" else _args(config_backend="FLASH_ATTN")
    with pytest.raises(ValueError, match="--attention-backend CUSTOM") as e:
        select_attention_backend(args, BALANCED, on_cuda=True)
    assert "balanced" in str(e.value)


def test_custom_chosen_by_the_user_is_kept() -> None:
    args = _args(AttentionBackendEnum.CUSTOM)
    assert select_attention_backend(args, BALANCED, on_cuda=True) is None
    assert args.attention_backend is AttentionBackendEnum.CUSTOM
