#!/usr/bin/env bash
# issue 38: the one-pass decode's compressed blocks read inside the main kernel ("tiles", the
# default) or by a kernel of their own ("kernel", mixed_comp.py, never timed on a GPU before):
# (1) per layer, bench/one_pass_decode.py --readers tiles kernel at 8 x 32k (where int4 ran 8x
# slower than bf16 pages) and at the throughput workload's shape (16 x 3k, block 32); (2) the
# throughput workload's ROWS once with each reader (PROXIMA_COMPRESSED_READER), same lease.
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o 'H[0-9]00' | tr H h)
export TRITON_CACHE_DIR=/tmp/tcache-new
timeout ${KT:-150} python3 bench/one_pass_decode.py --batch 8 --context 32768 --block 32 \
  --formats int4 "cluster(4)+int4" fp8 --fractions 1.0 --readers tiles kernel --iters 20 --tag _readers_8x32k \
  > $OUT/k1.log 2>&1; echo "k1 rc $?"; grep "^| one_pass\b\|^| one_pass |\|^| vllm" $OUT/k1.log | cut -c1-160
timeout ${KT:-150} python3 bench/one_pass_decode.py --batch 16 --context 3072 --block 32 \
  --formats int4 "cluster(2)+int4" "cluster(8)+int4" --fractions 0.9 --readers tiles kernel --iters 20 --tag _readers_16x3k \
  > $OUT/k2.log 2>&1; echo "k2 rc $?"; grep "^| one_pass\b\|^| one_pass |\|^| vllm" $OUT/k2.log | cut -c1-160
cp bench/results/one-pass-decode-*_readers_* $OUT/ 2>/dev/null
[ "${ENGINE:-1}" = 1 ] || exit 0
# (the first engine of a lease compiles, about 220 s before its window: CT1; the second CT2)
ct=${CT1:-270}
for reader in kernel tiles; do
  rm -rf /tmp/pxr-$reader; mkdir -p /tmp/pxr-$reader
  PROXIMA_COMPRESSED_READER=$reader timeout $ct python3 bench/capacity.py --mode equal-bytes --workload throughput \
    --reps 1 --rows ${ROWS:-balanced} --budget-s $(( ct - 10 )) --run-s ${RUN_S:-90} \
    --out /tmp/pxr-$reader/runs.json --logs /tmp/pxr-$reader/logs > /tmp/pxr-$reader/cap.log 2>&1
  echo "$reader cap rc $?"; grep "^|" /tmp/pxr-$reader/cap.log | tail -2 | cut -c1-400
  cp /tmp/pxr-$reader/runs.json $OUT/runs-$reader.json 2>/dev/null
  ct=${CT2:-170}
done
tar czf $OUT/reader-logs.tgz -C /tmp pxr-tiles pxr-kernel 2>/dev/null
