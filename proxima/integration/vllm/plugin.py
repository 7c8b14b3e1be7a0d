"""The `vllm.general_plugins` entry point: a no-op unless `PROXIMA_POLICY` names a policy file.

vLLM loads general plugins in every process it starts (front end, EngineCore, Worker), so this
function must be cheap and idempotent.
"""

from __future__ import annotations

import logging
import os

POLICY_ENV = "PROXIMA_POLICY"
_registered = False
logger = logging.getLogger("proxima.vllm")


def check_vllm_version(version: str) -> None:
    from proxima.integration.vllm import SUPPORTED_VLLM

    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"Proxima's vLLM integration supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"found vLLM {version}. Unset {POLICY_ENV} to run vLLM without Proxima."
        )


def register() -> None:
    global _registered
    path = os.environ.get(POLICY_ENV)
    if not path or _registered:
        return
    import vllm

    from proxima import __version__
    from proxima.policy.loader import load_policy

    check_vllm_version(vllm.__version__)
    policy = load_policy(path)  # raises PolicyError with file:line on a bad file

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "proxima.integration.vllm.backend.ProximaCPUAttentionBackend")
    import torch

    if torch.cuda.is_available():  # opt-in on CUDA: --attention-backend CUSTOM (cuda_backend.py)
        from proxima.integration.vllm.cuda_backend import register_cuda_backend

        register_cuda_backend()
    from proxima.integration.vllm import _patches

    _patches.install(policy)
    _registered = True
    logger.warning("proxima %s active in pid %d: policy %r (%s)", __version__, os.getpid(), policy.name, path)
