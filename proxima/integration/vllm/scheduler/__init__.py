"""The scheduler side: everything that runs in vLLM's EngineCore beside the KV manager."""
