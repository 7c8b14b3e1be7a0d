#!/usr/bin/env bash
# call 4: step ops on CUDA (issue 37), then tests/gpu
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
NAME=step-ops-$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o 'H[0-9]00' | tr H h)
timeout 150 python bench/step_ops.py --device cuda --layers 32 --heads 8 --block-size 32 --head-dim 128 \
  --policies conservative balanced aggressive --probe both --name $NAME > $OUT/ops.log 2>&1
echo "ops rc $?"; tail -60 $OUT/ops.log | cut -c1-250
cp bench/results/$NAME.* $OUT/ 2>/dev/null
PROXIMA_GPU_SUMMARY=$OUT/gpu-e2e.json timeout ${GT:-420} python3 -m pytest tests/gpu -x -q -rs > $OUT/gpu-tests.log 2>&1
echo "tests/gpu rc $?"; tail -15 $OUT/gpu-tests.log
