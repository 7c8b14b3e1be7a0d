#!/usr/bin/env bash
# issue 37: where aggressive's 634 ms of compression per step goes on the GPU (H100, 2026-12-07).
# Rows of the full throughput workload, each with py-spy sampling every process (carry .gpu/s for
# its binary, .gpu/s/bin/py-spy) and a fresh Triton cache whose file times say when each kernel
# compiled (before serving or inside the window):
#   1. aggressive at a baseline checkout (carry .gpu/base: `git archive <rev> proxima bench scripts
#      pyproject.toml` unpacked there), unless BASE=0;
#   2. ROWS (default aggressive,balanced) at this checkout.
# Output per part P (base, new): $OUT/P.json (the runs file), P.tgz (cap.log, py-spy raw, compiles.txt),
# P.logs.tgz (the rows' logs and stats files).
source .gpu/p2/env.sh 2>/dev/null || source /tmp/gpu-kit/env.sh || exit 1
PS=$PWD/.gpu/s/bin/py-spy; chmod +x $PS
part() {  # part NAME DIR ROWS TIMEOUT
  local name=$1 dir=$2 rows=$3 t=$4
  export TRITON_CACHE_DIR=/tmp/tcache-$name; rm -rf $TRITON_CACHE_DIR /tmp/pxb-$name; mkdir -p /tmp/pxb-$name
  date +%s > $OUT/$name.t0
  (cd $dir && PYTHONPATH=${PYTHONPATH/$PWD/$dir} timeout $t python3 bench/capacity.py --mode equal-bytes \
     --workload throughput --reps 1 --rows $rows --budget-s $((t - 10)) --resume /tmp/pxb-$name/throughput.json \
     --logs /tmp/pxb-$name/logs > $OUT/$name.cap.log 2>&1) &
  local cap=$!
  sleep 2
  timeout $t $PS record --subprocesses --nonblocking -r ${RATE:-25} -f raw -o $OUT/$name.raw --pid $cap > $OUT/$name.pyspy.log 2>&1 &
  wait $cap; echo "$name cap rc $?"; sleep 3
  grep -v "^INFO\|^(EngineCore" $OUT/$name.cap.log | grep "^\[" | tail -4 | cut -c1-300; tail -2 $OUT/$name.pyspy.log
  find $TRITON_CACHE_DIR -name "*.json" ! -name "__grp*" -printf "%T@ %f\n" | sort -n > $OUT/$name.compiles.txt
  wc -l < $OUT/$name.compiles.txt
  cp /tmp/pxb-$name/throughput.json $OUT/$name.json 2>/dev/null
  # (a call brings back at most 8 files: everything else of the part in one archive)
  tar czf $OUT/$name.tgz -C $OUT --remove-files $name.cap.log $name.raw $name.pyspy.log $name.compiles.txt $name.t0 2>/dev/null
  tar czf $OUT/$name.logs.tgz -C /tmp/pxb-$name logs 2>/dev/null
}
[ "${BASE:-1}" = 1 ] && part base $PWD/.gpu/base aggressive ${BT:-170}
part new $PWD ${ROWS:-aggressive,balanced} ${NT:-330}
ls $OUT
