"""The one place where Proxima changes vLLM behaviour without a supported hook.

Missing hook: a general plugin cannot add a KV connector to the engine configuration, nor pick the
attention backend, so `vllm serve` / `vllm.LLM` with `PROXIMA_POLICY` set would neither route the
per-step connector calls to Proxima nor read compressed blocks on CUDA. We wrap
`EngineArgs.create_engine_config` (in the process that builds the engine's configuration) to:

* fill `kv_transfer_config` with Proxima's connector when the user gave none (and give a
  user-supplied Proxima connector the role `kv_producer`: see `kv_transfer_config`);
* on CUDA, when the policy compresses, select Proxima's attention backend (`CUSTOM`) if the user
  chose none, and refuse to start, saying what to pass, if the user chose another one: vLLM's own
  backends would read the freed source blocks of compressed blocks. A policy that is off leaves
  vLLM's choice untouched.

Checked against vLLM 0.32 only.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from proxima.policy.schema import Policy

logger = logging.getLogger("proxima.vllm")
_installed = False
PROXIMA_BACKEND = "CUSTOM"
"""The registry member Proxima's CUDA backend is registered under (`cuda_backend.register_cuda_backend`)."""


def _chosen_backend(args: Any) -> str | None:
    """The attention backend the user asked for (None: vLLM chooses)."""
    config = getattr(args, "attention_config", None)
    for value in (getattr(args, "attention_backend", None), getattr(config, "backend", None)):
        if value is not None:
            return str(getattr(value, "name", value))
    return None


def select_attention_backend(args: Any, policy: Policy, on_cuda: bool) -> str | None:
    """Proxima's backend on CUDA when the policy compresses; returns what was set (None: nothing).

    Raises ValueError when the user chose a backend that cannot read compressed blocks."""
    if not on_cuda or policy.is_off:
        return None
    chosen = _chosen_backend(args)
    if chosen is None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        args.attention_backend = AttentionBackendEnum[PROXIMA_BACKEND]
        return PROXIMA_BACKEND
    if chosen.upper() != PROXIMA_BACKEND:
        raise ValueError(
            f"proxima: policy {policy.name!r} compresses KV blocks, which only Proxima's attention backend can read, "
            f"but the attention backend {chosen} was requested. Pass `--attention-backend {PROXIMA_BACKEND}` "
            "(or none: Proxima selects it), or run a policy that is off."
        )
    return None


def install(policy: Policy) -> None:
    global _installed
    if _installed:
        return
    import torch
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    from proxima.integration.vllm import CONNECTOR_NAME, CONNECTOR_ROLE, kv_transfer_config
    from proxima.integration.vllm.plugin import check_vllm_version

    check_vllm_version(vllm.__version__)
    original = EngineArgs.create_engine_config
    on_cuda = torch.cuda.is_available()

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.kv_transfer_config is None:
            self.kv_transfer_config = kv_transfer_config()
        elif getattr(self.kv_transfer_config, "kv_connector", None) != CONNECTOR_NAME:
            logger.warning("proxima: a KV connector is already configured; Proxima stays inactive")
        elif self.kv_transfer_config.kv_role != CONNECTOR_ROLE:
            logger.info("proxima: connector role %s -> %s (Proxima loads no KV)",
                        self.kv_transfer_config.kv_role, CONNECTOR_ROLE)
            self.kv_transfer_config.kv_role = CONNECTOR_ROLE
        if getattr(self.kv_transfer_config, "kv_connector", None) == CONNECTOR_NAME:
            chosen = select_attention_backend(self, policy, on_cuda)
            if chosen is not None:
                logger.warning("proxima: attention backend %s selected (policy %r compresses on CUDA)",
                               chosen, policy.name)
        return original(self, *args, **kwargs)

    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    _installed = True
