"""The one place where Proxima changes vLLM behaviour without a supported hook (vLLM 0.32 only).

Every patch here is version-checked (`check_vllm_version`) and names the hook it stands in for:

1. `EngineArgs.create_engine_config` is wrapped (`install`). Missing hook: a general plugin
   cannot add a KV connector to the engine configuration, so `vllm serve` / `vllm.LLM` with
   `PROXIMA_POLICY` set would not route the per-step connector calls to Proxima. The wrapper
   fills `kv_transfer_config` with Proxima's connector when the user gave none.
2. The KV manager's class is swapped on the live instance (`adopt_kv_manager`). Missing hook:
   `Scheduler.__init__` constructs `KVCacheManager` directly, with no config option naming its
   class (the connector only receives the built instance, through `bind_kv_cache_manager`).
   Swapping `__class__` to a subclass that adds no `__init__` state of vLLM's keeps every
   attribute vLLM set where vLLM put it; Proxima's own state goes into one `px` attribute.
"""

from __future__ import annotations

import functools
import logging
from typing import TypeVar

from proxima.integration.vllm import POLICY_ENV, SUPPORTED_VLLM, kv_transfer_config

logger = logging.getLogger("proxima.vllm")
M = TypeVar("M")


def check_vllm_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"Proxima's vLLM integration supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"found vLLM {version}. Unset {POLICY_ENV} to run vLLM without Proxima."
        )


def install() -> None:
    """Patch 1 (idempotent: the wrapper marks itself, so a second call changes nothing)."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    check_vllm_version(vllm.__version__)
    original = EngineArgs.create_engine_config
    if getattr(original, "__proxima_patch__", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.kv_transfer_config is None:
            self.kv_transfer_config = kv_transfer_config()
        elif getattr(self.kv_transfer_config, "kv_connector", None) != "ProximaConnector":
            logger.warning("proxima: a KV connector is already configured; Proxima stays inactive")
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
