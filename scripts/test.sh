#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite (unit, property-based,
# Triton kernels under the interpreter, and the end-to-end tests on real vLLM and SmolLM2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export TRITON_INTERPRET=1
# Lint and types first: they take seconds and fail fast (pyproject.toml configures both).
.venv/bin/ruff check proxima tests bench
.venv/bin/mypy
# Exit code 5 means pytest collected nothing: that is a failure here, never a pass.
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "[proxima] pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
