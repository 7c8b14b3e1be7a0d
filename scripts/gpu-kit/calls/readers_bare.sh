#!/usr/bin/env bash
# issue 38, with no kit staged (torch and Triton of the device's own image; no vLLM, so no `vllm`
# and no split rows): the one-pass decode's compressed blocks read by "tiles" (inside the main
# kernel, the default) or "kernel" (mixed_comp.py, never timed before), per layer, at 8 x 32k
# (int4 ran 8x slower than bf16 pages there) and at the throughput workload's shape (16 x 3k).
# One call, no carry:  bash scripts/gpu-kit/calls/readers_bare.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache-readers
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${KT1:-260} python3 bench/one_pass_decode.py --batch 8 --context 32768 --block 32 \
  --formats int4 "cluster(4)+int4" fp8 --fractions 1.0 --readers tiles kernel --iters 20 --tag _readers_8x32k \
  > $OUT/k1.log 2>&1; echo "k1 rc $?"
timeout ${KT2:-200} python3 bench/one_pass_decode.py --batch 16 --context 3072 --block 32 \
  --formats int4 "cluster(2)+int4" "cluster(8)+int4" --fractions 0.9 --readers tiles kernel --iters 20 --tag _readers_16x3k \
  > $OUT/k2.log 2>&1; echo "k2 rc $?"
cp bench/results/one-pass-decode-*_readers_* $OUT/ 2>/dev/null
grep -h " ms " $OUT/k1.log $OUT/k2.log | cut -c1-110
tail -3 $OUT/k1.log $OUT/k2.log | grep -i "error\|Traceback" -A3
