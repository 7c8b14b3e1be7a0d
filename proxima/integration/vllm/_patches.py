"""The one place where Proxima changes vLLM behaviour without a supported hook.

Missing hook: a general plugin cannot add a KV connector to the engine configuration, so
`vllm serve` / `vllm.LLM` with `PROXIMA_POLICY` set would not route the per-step connector calls
to Proxima. We wrap `EngineArgs.create_engine_config` to fill `kv_transfer_config` with
Proxima's connector when the user gave none. Checked against vLLM 0.32 only.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("proxima.vllm")
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    from proxima.integration.vllm import kv_transfer_config
    from proxima.integration.vllm.plugin import check_vllm_version

    check_vllm_version(vllm.__version__)
    original = EngineArgs.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.kv_transfer_config is None:
            self.kv_transfer_config = kv_transfer_config()
        elif getattr(self.kv_transfer_config, "kv_connector", None) != "ProximaConnector":
            logger.warning("proxima: a KV connector is already configured; Proxima stays inactive")
        return original(self, *args, **kwargs)

    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    _installed = True
