"""Proxima inside vLLM: plugin, KV manager subclass, connector channel, worker executor, attention.

Everything vLLM-specific lives in this package (DESIGN.md). This module holds the package's
constants and imports none of its modules, so any of them may import it without a circle.
`kv_transfer_config()` returns the connector configuration for users who build `vllm.LLM`
themselves without the plugin's default.
"""

from __future__ import annotations

from typing import Any, Final, Literal

CONNECTOR_NAME = "ProximaConnector"
CONNECTOR_MODULE = "proxima.integration.vllm.connector"
CONNECTOR_ROLE: Final[Literal["kv_producer"]] = "kv_producer"
"""See `kv_transfer_config`: Proxima's connector consumes no KV."""
POLICY_ENV = "PROXIMA_POLICY"
"""The policy file Proxima runs with in every vLLM process; unset, the plugin does nothing."""
DRIFT_ID_ARG = "proxima_drift_id"
"""`SamplingParams.extra_args` key: the request id the observer reports the request's tokens under."""
SUPPORTED_VLLM = ("0.32.", "0.33.")
"""vLLM versions whose internals this package was checked against (prefix match); each internal
and what 0.33 changed: docs/vllm-integration.md, "vLLM versions"."""
SUPPORTED_VLLM_RANGE = ">=0.32,<0.34"
"""The same as a requirement specifier (pyproject's `vllm` extra, `proxima version`)."""


def kv_transfer_config() -> Any:
    """The `KVTransferConfig` that routes vLLM's per-step connector calls to Proxima.

    The role is `kv_producer`, not `kv_both`: Proxima loads no external KV, and vLLM treats a
    *consumer* connector under overlapping batches (async scheduling, vLLM's GPU default) as
    one whose loads race the in-flight step's writes, so it defers returning a finished
    request's blocks to the pool (`Scheduler.defer_block_free`). Those blocks would then be
    neither owned nor free for a step or two, breaking the accounting invariant the manager
    relies on (free + owned == total) for no benefit: Proxima's worker writes (scrub, compress)
    run on the step's stream before its forward, ordered after the previous step's kernels.
    """
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE, kv_role=CONNECTOR_ROLE
    )
