"""Proxima inside vLLM: plugin, KV manager subclass, connector channel, worker executor, attention.

Everything vLLM-specific lives in this package (DESIGN.md). This module holds the package's
constants and imports none of its modules, so any of them may import it without a circle.
`kv_transfer_config()` returns the connector configuration for users who build `vllm.LLM`
themselves without the plugin's default.
"""

from __future__ import annotations

from typing import Any

CONNECTOR_NAME = "ProximaConnector"
CONNECTOR_MODULE = "proxima.integration.vllm.connector"
POLICY_ENV = "PROXIMA_POLICY"
"""The policy file Proxima runs with in every vLLM process; unset, the plugin does nothing."""
SUPPORTED_VLLM = ("0.32.",)
"""vLLM versions whose internals this package was written against (prefix match)."""


def kv_transfer_config() -> Any:
    """The `KVTransferConfig` that routes vLLM's per-step connector calls to Proxima."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both"
    )
