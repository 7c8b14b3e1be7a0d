"""A transformers integration: `ProximaCache` applies Proxima's block formats and policy engine
inside plain `model.generate`/`model(...)` calls (used for quality work on CPU)."""

from proxima.integration.hf.attention import ATTN_NAME, enable, register
from proxima.integration.hf.cache import ProximaCache
from proxima.integration.hf.compress import CompressionReport
from proxima.integration.hf.layer import ProximaLayer

__all__ = ["ATTN_NAME", "CompressionReport", "ProximaCache", "ProximaLayer", "enable", "register"]
