#!/usr/bin/env bash
# issue 37: aggressive's groups at the throughput workload's scale (a prefill chunk of 512 tokens
# = 16 blocks, ~10 requests), hot blocks straight to every rung (the write-once path) included:
# CUDA ms per group, to find what made aggressive's compression 634 ms a step on the H100 (2026-12-07)
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
NAME=step-ops-direct-$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o 'H[0-9]00' | tr H h)
timeout ${OT:-240} python bench/step_ops.py --device cuda --layers 32 --heads 8 --block-size 32 --head-dim 128 \
  --policies aggressive balanced --probe both --direct --per-group ${PER:-64} --blocks ${BLOCKS:-800} \
  --name $NAME > $OUT/ops.log 2>&1
echo "ops rc $?"; grep "^|" $OUT/ops.log | head -40 | cut -c1-250; tail -5 $OUT/ops.log
cp bench/results/$NAME.* $OUT/ 2>/dev/null; ls $OUT
