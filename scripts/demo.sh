#!/usr/bin/env bash
# The main job: sets up .venv if needed, then runs Proxima's demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/proxima demo "$@"
