#!/usr/bin/env bash
# issue 39 headline rows after a scheduler change (one engine at a time, 1 rep), then as much of
# tests/gpu as the call has left. Brings back at most 8 files: the runs file, the merged tables,
# logs in one archive, the tests' log. RUN_S: a run's expected seconds for the budget check (a
# lease's first run compiles for ~150 s more than the rest; from it the estimate stopped early).
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export TRITON_CACHE_DIR=/tmp/tcache-new
mkdir -p /tmp/pxh
timeout ${CT:-440} python3 bench/capacity.py --mode equal-bytes --workload throughput --reps 1 \
  --rows ${ROWS:-conservative,vllm_fp8,balanced,vllm_int4_pth,aggressive} \
  --budget-s ${BUDGET:-430} ${RUN_S:+--run-s $RUN_S} --resume /tmp/pxh/throughput.json --logs /tmp/pxh/logs > /tmp/pxh/cap.log 2>&1
echo "cap rc $?"; grep "^\[" /tmp/pxh/cap.log | tail -12 | cut -c1-300
python3 bench/capacity.py --merge /tmp/pxh/throughput.json --out /tmp/pxh/capacity.json --step-out /tmp/pxh/step.json > /dev/null 2>&1
cp /tmp/pxh/throughput.json /tmp/pxh/capacity.md /tmp/pxh/step.md $OUT/ 2>/dev/null
tail -9 /tmp/pxh/capacity.md 2>/dev/null | cut -c1-420; tail -7 /tmp/pxh/step.md 2>/dev/null
tar czf $OUT/logs.tgz -C /tmp/pxh logs cap.log 2>/dev/null
timeout ${GT:-120} python3 -m pytest tests/gpu -x -q -rs > $OUT/gpu-tests.log 2>&1
echo "tests/gpu rc $?"; tail -6 $OUT/gpu-tests.log
