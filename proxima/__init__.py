"""Proxima: adaptive KV-cache compression for vLLM."""

__version__ = "0.1.0"
