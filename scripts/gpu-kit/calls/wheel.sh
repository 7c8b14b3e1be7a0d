#!/usr/bin/env bash
# issue 41 item 1: the README's GPU install, from the wheel, into the device's Python (vLLM from the kit)
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
WHL=$(ls $PWD/.gpu/whl/proxima-*.whl) || exit 1
# the user's environment: vLLM and its deps, neither the checkout nor the kit's stand-in for Proxima
mkdir -p /tmp/aside && mv /tmp/deps/proxima-0.1.0.dist-info /tmp/aside/ 2>/dev/null
export PYTHONPATH=/tmp/site:/tmp/deps
PY=$(command -v python3); echo "python: $PY"
python3 -m pip install --no-index --find-links $PWD/.gpu/whl proxima 2>&1 | tail -4
python3 -m pip list 2>/dev/null | grep -i -E "^(proxima|vllm|torch) "
BIN=$(dirname $PY)/proxima; echo "console script: $BIN"
cd /tmp
python3 -c "import proxima, sys; print('proxima from', proxima.__file__)"
$BIN version
$BIN simulate --policy balanced --requests 32 2>&1 | tail -4
cat > /tmp/llm_check.py <<'PY'
import json, os, sys, time
from vllm import LLM, SamplingParams
t = time.time()
llm = LLM(model=os.environ["PX_MODEL"], gpu_memory_utilization=0.3, max_model_len=2048, num_gpu_blocks_override=64, block_size=16)
outs = llm.generate(["The history of the city " * 40] * 8, SamplingParams(max_tokens=128, ignore_eos=True, logprobs=1))
lp = [l for o in outs for d in o.outputs[0].logprobs for l in [next(iter(d.values())).logprob]]
print(json.dumps({"requests": len(outs), "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                  "nonfinite_logprobs": sum(1 for x in lp if x != x or abs(x) == float("inf")), "s": round(time.time() - t, 1)}))
PY
PROXIMA_POLICY=balanced PROXIMA_STATS_FILE=/tmp/llm-stats.json timeout 240 python3 /tmp/llm_check.py > $OUT/wheel-llm.log 2>&1
echo "LLM rc $?"; grep -i "proxima\|error\|gpukit" $OUT/wheel-llm.log | grep -v "^INFO" | tail -8 | cut -c1-300; tail -1 $OUT/wheel-llm.log
python3 -c "import json; d=json.load(open('/tmp/llm-stats.json')); print({k: d[k] for k in list(d)[:12]})" 2>&1 | cut -c1-600
