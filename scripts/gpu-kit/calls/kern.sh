#!/usr/bin/env bash
# the compressed-blocks kernel (issue 38): compiled tests, then readers timed
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
timeout ${KT:-120} python -m pytest -q -x tests/integration/vllm/attention/test_mixed_decode_shapes.py -k kernel 2>&1 | tail -4
timeout ${KB:-300} python bench/one_pass_decode.py --batch 8 --context 32768 --block 32 --formats ${FMTS:-int4 "cluster(4)+int4" fp8} \
  --fractions ${FRACS:-1.0} --iters 10 --readers tiles kernel --comp-warps 8 --comp-stages 1 --tag=-readers > $OUT/readers.log 2>&1
echo "bench rc $?"; grep -v "^INFO" $OUT/readers.log | tail -25 | cut -c1-250
cp bench/results/one-pass-decode-*-readers.* $OUT/ 2>/dev/null; ls $OUT
