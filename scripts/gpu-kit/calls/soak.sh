#!/usr/bin/env bash
# call 2: stage deps (p2) and run the GPU soak (issue 41 item 4; NaN fix verification)
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 560 python bench/soak.py --gpu --policy bench/policies/soak-probes.yaml --requests ${REQ:-3000} --wave 500 \
  --policy-interval 1 --fault-every 10 --fault-seconds 3 --seconds 400 --out $OUT/soak-gpu.json > $OUT/soak.log 2>&1
echo "soak rc $?"
grep -v "^INFO\|^(APIServer\|^(EngineCore" $OUT/soak.log | tail -40
