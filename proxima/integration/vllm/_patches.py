"""The one place where Proxima changes vLLM behaviour without a supported hook (vLLM 0.32 only).

Every patch here is version-checked (`check_vllm_version`) and names the hook it stands in for:

1. `EngineArgs.create_engine_config` is wrapped (`install`), in the process that builds the
   engine's configuration. Missing hook: a general plugin can neither add a KV connector to the
   engine configuration nor pick the attention backend, so `vllm serve` / `vllm.LLM` with
   `PROXIMA_POLICY` set would neither route the per-step connector calls to Proxima nor read
   compressed blocks on CUDA. The wrapper
   * fills `kv_transfer_config` with Proxima's connector when the user gave none (and gives a
     user-supplied Proxima connector the role `kv_producer`: see `kv_transfer_config`);
   * on CUDA, when the policy compresses, selects Proxima's attention backend (`CUSTOM`) if the
     user chose none, and refuses to start, saying what to pass, if the user chose another one:
     vLLM's own backends would read the freed source blocks of compressed blocks. A policy that
     is off leaves vLLM's choice untouched.
2. The KV manager's class is swapped on the live instance (`adopt_kv_manager`). Missing hook:
   `Scheduler.__init__` constructs `KVCacheManager` directly, with no config option naming its
   class (the connector only receives the built instance, through `bind_kv_cache_manager`).
   Swapping `__class__` to a subclass that adds no `__init__` state of vLLM's keeps every
   attribute vLLM set where vLLM put it; Proxima's own state goes into one `px` attribute.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, TypeVar

from proxima.integration.vllm import (
    CONNECTOR_NAME,
    CONNECTOR_ROLE,
    POLICY_ENV,
    SUPPORTED_VLLM,
    kv_transfer_config,
)
from proxima.policy.schema import Policy

logger = logging.getLogger("proxima.vllm")
M = TypeVar("M")
PROXIMA_BACKEND = "CUSTOM"
"""The registry member Proxima's CUDA backend is registered under (`cuda_backend.register_cuda_backend`)."""


def check_vllm_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"Proxima's vLLM integration supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"found vLLM {version}. Unset {POLICY_ENV} to run vLLM without Proxima."
        )


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
    """Patch 1 (idempotent: the wrapper marks itself, so a second call changes nothing)."""
    import torch
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    check_vllm_version(vllm.__version__)
    original = EngineArgs.create_engine_config
    if getattr(original, "__proxima_patch__", False):
        return
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

    create_engine_config.__proxima_patch__ = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


def adopt_kv_manager(manager: object, cls: type[M]) -> M:
    """Patch 2: make vLLM's KV manager instance an instance of `cls` (a subclass of its class)."""
    import vllm

    check_vllm_version(vllm.__version__)
    if not isinstance(manager, cls.__mro__[1]):
        raise TypeError(f"{cls.__name__} extends {cls.__mro__[1].__name__}, vLLM built a {type(manager).__name__}")
    manager.__class__ = cls
    return manager  # type: ignore[return-value]
