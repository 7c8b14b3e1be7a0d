#!/usr/bin/env bash
# issues 37-39: where an engine step's GPU time goes. (1) the write-once groups (a hot block straight
# into each rung) on the step kernels, CUDA timings; (2) ROWS of the throughput workload under vLLM's
# torch profiler for STEPS engine steps after SKIP (`bench/capacity.py --profile`), summed per kernel
# and category by `bench/step_profile.py` (device ms per step, span, busy share). The profiled runs
# are slower than a table's: their tokens/s are not the benchmark's. Brings back at most 8 files.
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o 'H[0-9]00' | tr H h)
export TRITON_CACHE_DIR=/tmp/tcache-new
if [ "${DIRECT:-1}" = 1 ]; then
  timeout 150 python3 bench/step_ops.py --device cuda --layers 32 --heads 8 --block-size 32 --head-dim 128 \
    --policies aggressive --probe off --direct --name step-ops-direct-$NAME > $OUT/ops-direct.log 2>&1
  echo "ops rc $?"; grep "^| aggressive" $OUT/ops-direct.log | cut -c1-200
  cp bench/results/step-ops-direct-$NAME.json $OUT/ 2>/dev/null
fi
SKIP=${SKIP:-400}; STEPS=${STEPS:-20}
rm -rf /tmp/pxp; mkdir -p /tmp/pxp
# (a lease's first run also compiles, ~220 s; the others take ~100 s: RUN_S keeps the estimate there)
timeout ${CT:-440} python3 bench/capacity.py --mode equal-bytes --workload throughput --reps 1 \
  --rows ${ROWS:-aggressive,vllm_int4_pth,balanced} --profile $SKIP:$STEPS --profile-dir /tmp/pxp/traces \
  --budget-s ${BUDGET:-430} --run-s ${RUN_S:-100} --out /tmp/pxp/runs.json --logs /tmp/pxp/logs > /tmp/pxp/cap.log 2>&1
echo "cap rc $?"; grep "^\[" /tmp/pxp/cap.log | tail -8 | cut -c1-300
ls -la /tmp/pxp/traces | tail -5
python3 bench/step_profile.py /tmp/pxp/traces --steps $STEPS --out $OUT/step-profile-$NAME 2>&1 | cut -c1-400
(cd /tmp/pxp && tar czf $OUT/profile-logs.tgz logs cap.log runs.json traces/*.txt 2>/dev/null)
