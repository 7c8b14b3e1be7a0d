#!/usr/bin/env bash
# Device call 1 (carry .gpu/p1):  bash .gpu/p1/stage1.sh [check]
# Unpacks the kit's vLLM (.gpu/p1/VLLM_VERSION: 0.32.0 or 0.33.0) into /tmp/site, outside the checkout: /tmp survives between calls only while
# the machine stays warm (30 s idle), so the next call must follow at once. `check` also prints
# the device's versions and runs one op of the CUDA extension (+about 20 s).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
T0=$(date +%s); say() { echo "[stage1 +$(( $(date +%s) - T0 ))s] $*"; }
cd "$HERE"
# A payload whose extension is too big for one call (vLLM 0.33: 61 MiB xz'd) comes in two chunks:
# call 0 carries .gpu/p0 (the extension's second half), call 1 .gpu/p1 (the rest); both run this.
STASH=/tmp/gpu-kit-stash
if [ -f C_stable.so.xz.part1 ]; then
  mkdir -p "$STASH" && cp C_stable.so.xz.part1 SHA256SUMS "$STASH/"
  say "stashed the extension's second half in $STASH: next call at once, carry .gpu/p1, run 'bash .gpu/p1/stage1.sh'"
  exit 0
fi
if [ -f C_stable.so.xz.part0 ]; then
  if ! { [ -f "$STASH/C_stable.so.xz.part1" ] && cmp -s SHA256SUMS "$STASH/SHA256SUMS"; }; then
    echo "gpu-kit: ERROR: this payload comes in two chunks: run call 0 first (carry .gpu/p0," \
         "'bash .gpu/p0/stage1.sh'), then this call at once on the same warm machine" >&2
    exit 2
  fi
  W=/tmp/gpu-kit-p1 && rm -rf "$W" && mkdir -p "$W"
  cat C_stable.so.xz.part0 "$STASH/C_stable.so.xz.part1" > "$W/C_stable.so.xz"
  ln -s "$HERE/vllm_py.tar.xz" "$W/vllm_py.tar.xz" && cp SHA256SUMS "$W/"
  cd "$W"
fi
if [ -f /tmp/site/.gpu-kit-p1 ] && cmp -s SHA256SUMS /tmp/site/.gpu-kit-p1; then
  say "/tmp/site already holds this payload"
else
  sha256sum -c --quiet SHA256SUMS || { echo "gpu-kit: ERROR: .gpu/p1 arrived damaged; rebuild it and redo call 1" >&2; exit 2; }
  rm -rf /tmp/site && mkdir -p /tmp/site
  python3 - <<'PY'
import lzma, shutil, tarfile
with tarfile.open("vllm_py.tar.xz") as tf:
    tf.extractall("/tmp/site", filter="fully_trusted")
with lzma.open("C_stable.so.xz") as src, open("/tmp/site/vllm/_C_stable_libtorch.abi3.so", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 24)
PY
  # The FlashAttention extensions are not carried. vllm.vllm_flash_attn raises ImportError without
  # them, and vLLM imports it unconditionally (llama.py -> mm_encoder_attention -> fa_utils);
  # TRITON_ATTN and Proxima's CUSTOM backend never call it.
  F=/tmp/site/vllm/vllm_flash_attn/__init__.py
  sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:  # gpu-kit: FA extensions not carried/' "$F"
  grep -q '^if False:  # gpu-kit' "$F" || { echo "gpu-kit: ERROR: FA import patch did not apply to $F" >&2; exit 2; }
  cp SHA256SUMS /tmp/site/.gpu-kit-p1
  say "unpacked $(du -sh /tmp/site | cut -f1) into /tmp/site"
fi
[ "${1:-}" = check ] || { say "done: next call at once, carry .gpu/p2, start with 'source .gpu/p2/env.sh'"; exit 0; }
say "device facts"
ldd --version | head -1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 - <<'PY'
import sys
import torch, triton, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())
sys.path.insert(0, "/tmp/site")
import vllm._C_stable_libtorch  # noqa: F401
x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(x)
torch.ops._C.rms_norm(out, x, w, 1e-6)
torch.cuda.synchronize()
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
err = (out.float() - ref).abs().max().item()
print("vllm._C_stable_libtorch loads; rms_norm max error vs float32", round(err, 4))
assert err < 0.05
PY
say done
