"""Whether this engine's KV cache is one Proxima can compress: dense 16-bit pages (bf16 / fp16).

vLLM can store its own cache in 8 bits (`kv_cache_dtype` fp8, int8 or int4 per token head): those
pages are vLLM's format, and a compressed slot is a reinterpretation of a 16-bit block's bytes
(`compression/layer_stack.py`), so Proxima has nothing to add there. With a policy that
compresses, that is a configuration error, said at start-up with the way out; with `off` (or no
compression yet) Proxima stands aside: no page layout is probed (vLLM's CPU kernel cannot write a
16-bit probe page into an 8-bit cache: `cpu_attn_reshape_and_cache` "not implemented for 'Byte'",
which stopped the engine before this check), no slot pool is made, attention stays vLLM's, and a
compressing policy adopted later fails its compressions (the requests are served uncompressed).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from proxima.policy.schema import Policy

logger = logging.getLogger("proxima.vllm")


def compressible(kv_caches: Mapping[str, torch.Tensor], policy: Policy | None) -> bool:
    """True when every KV layer is a 16-bit float tensor. Raises when it is not and `policy`
    compresses: the policy could never run."""
    odd = sorted({str(t.dtype) for t in kv_caches.values() if not (t.is_floating_point() and t.element_size() == 2)})
    if not odd:
        return True
    if policy is not None and policy.enabled:
        raise ValueError(
            f"proxima: policy {policy.name!r} compresses 16-bit KV blocks, but this engine's KV cache is "
            f"{', '.join(odd)} (vLLM's kv_cache_dtype): start vLLM without --kv-cache-dtype (Proxima "
            f"chooses the formats), or set PROXIMA_POLICY=off to keep vLLM's quantized cache"
        )
    logger.info("proxima: the KV cache is %s (vLLM's own quantized cache): Proxima stands aside", ", ".join(odd))
    return False


__all__ = ["compressible"]
