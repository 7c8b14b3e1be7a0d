#!/usr/bin/env bash
# the quick throughput workload (issue 39), shipped vs lean policies, one engine at a time; step counters (issue 37)
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
timeout 60 python3 -m pytest -q tests/integration/vllm/worker/test_step_counter.py -k cuda 2>&1 | tail -2
mkdir -p /tmp/pxb
timeout ${CT:-420} python bench/capacity.py --mode equal-bytes --workload throughput --quick --reps 1 \
  --rows ${ROWS:-vllm_int4_pth,balanced,bench/policies/balanced-lean.yaml,aggressive,bench/results/experiments/lean-policies/variants/aggressive-lean-int4first.yaml} \
  --budget-s ${BUDGET:-400} --out /tmp/pxb/tp.json --logs $OUT/logs > $OUT/cap.log 2>&1
echo "cap rc $?"; grep -v "^INFO\|^(EngineCore" $OUT/cap.log | tail -12 | cut -c1-300
python3 bench/capacity.py --merge /tmp/pxb/tp.json --out /tmp/pxb/capacity-quick.json --step-out /tmp/pxb/step-quick.json > /dev/null 2>&1
cp /tmp/pxb/*.json /tmp/pxb/*.md $OUT/ 2>/dev/null; cat /tmp/pxb/tp.md 2>/dev/null | tail -8 | cut -c1-400; cat /tmp/pxb/step-quick.md 2>/dev/null | tail -6
