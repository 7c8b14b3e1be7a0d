"""The `vllm.general_plugins` entry point: a no-op unless `PROXIMA_POLICY` names a policy file.

vLLM loads general plugins in every process it starts (front end, EngineCore, Worker), so this
function must be cheap and idempotent: every step it takes is (vLLM's backend registry maps a
name to a class path; `_patches.install` marks its wrapper).
"""

from __future__ import annotations

import logging
import os
import sys

from proxima.integration.vllm import POLICY_ENV

logger = logging.getLogger("proxima.vllm")


def register() -> None:
    path = os.environ.get(POLICY_ENV)
    if not path:
        return
    import vllm

    from proxima import __version__
    from proxima.integration.vllm import _patches
    from proxima.policy.loader import PolicyError, load_policy

    _patches.check_vllm_version(vllm.__version__)
    try:
        policy = load_policy(path)
    except PolicyError as e:
        if not _in_vllms_command_line():
            raise  # vllm.LLM(...) in Python: the caller gets the exception (file:line in its text)
        # `vllm serve` loads plugins while it builds its argument parser: a traceback there would
        # bury the one line an operator needs. Same message and status as `proxima serve`.
        print(f"proxima: {POLICY_ENV}={path}: invalid policy\n{e}", file=sys.stderr)
        raise SystemExit(2) from None

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "proxima.integration.vllm.attention.cpu.ProximaCPUAttentionBackend")
    import torch

    if torch.cuda.is_available():  # opt-in on CUDA: --attention-backend CUSTOM (cuda_backend.py)
        from proxima.integration.vllm.attention.triton import register_cuda_backend

        register_cuda_backend()
    _patches.install(policy)
    logger.warning("proxima %s active in pid %d: policy %r (%s)", __version__, os.getpid(), policy.name, path)


def _in_vllms_command_line() -> bool:
    """True in the process of vLLM's `vllm` console script (not in the engine processes it
    starts, nor in a Python program that builds `vllm.LLM`)."""
    return os.path.basename(sys.argv[0]) == "vllm"
