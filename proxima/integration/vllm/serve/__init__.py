"""The `proxima serve` / `proxima demo` parent process: command line, supervisor, canary runner, vLLM's CLI."""
