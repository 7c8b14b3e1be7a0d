#!/usr/bin/env bash
# issue 37: kernel launches per group on CUDA (bench/step_ops.py --device cuda), and the step counter's CUDA test
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
timeout 60 python3 -m pytest -q tests/integration/vllm/worker/test_step_counter.py -k cuda 2>&1 | tail -2
NAME=step-ops-$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o 'H[0-9]00' | tr H h)
timeout ${OT:-200} python bench/step_ops.py --device cuda --layers 32 --heads 8 --block-size 32 --head-dim 128 \
  --policies conservative balanced aggressive --probe both --name $NAME > $OUT/ops.log 2>&1
echo "ops rc $?"; tail -40 $OUT/ops.log | cut -c1-250
cp bench/results/$NAME.* $OUT/ 2>/dev/null; ls $OUT
