#!/usr/bin/env bash
# issue 39/37: the full throughput workload (16 x 2048+1024, 8B shape), one engine at a time, 1 rep
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/pxb
timeout ${CT:-575} python3 bench/capacity.py --mode equal-bytes --workload throughput --reps 1 \
  --rows ${ROWS:-vanilla,vllm_int4_pth,balanced,bench/policies/balanced-lean.yaml,aggressive,off} \
  --budget-s ${BUDGET:-560} --resume /tmp/pxb/throughput.json --logs /tmp/pxb/logs > $OUT/cap.log 2>&1
echo "cap rc $?"; grep "^\[" $OUT/cap.log | tail -14 | cut -c1-300
cp /tmp/pxb/*.json /tmp/pxb/*.md $OUT/ 2>/dev/null; mkdir -p $OUT/logs; cp /tmp/pxb/logs/* $OUT/logs/ 2>/dev/null
python3 bench/capacity.py --merge /tmp/pxb/throughput.json --out /tmp/pxb/capacity-full.json --step-out /tmp/pxb/step-full.json > /dev/null 2>&1
cp /tmp/pxb/capacity-full.* /tmp/pxb/step-full.* $OUT/ 2>/dev/null; tail -8 /tmp/pxb/capacity-full.md 2>/dev/null | cut -c1-500; tail -6 /tmp/pxb/step-full.md 2>/dev/null
