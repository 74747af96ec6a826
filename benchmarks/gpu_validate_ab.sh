#!/usr/bin/env bash
# One device call (2 x H200) after a kernel change: the harness's correctness runs on this tree's kernels (check,
# sequence, timeout, a stress of STRESS_LAYERS layers), and only if they pass, the A/B against an older tree
# (gpu_ab.sh stages latency and jit). Everything in $OUT/all.tar.gz, the verdicts in $OUT/summary.txt.
#   GIT_COMMIT=<sha> OLD=<dir> OLD_COMMIT=<sha> OUT=<dir> [STRESS_LAYERS=100000] [JIT_TOKENS=...]
#   [JIT_MAX_TOKENS="-1"] [JIT_SIDES="new old new-again old-again"] [AB_STAGES="latency jit"]
#   [LAT_SIDES="name=tree:artifacts:commit ..." (gpu_lat_variants.sh, before the A/B)] bash benchmarks/gpu_validate_ab.sh
source "$(dirname "$0")/gpu_common.sh"  # $OUT, $W, the environment, $H
mkdir -p $OUT/check $OUT/ab
{
OUT=$OUT/check STAGES=check bash benchmarks/gpu_ab.sh > /dev/null 2>&1
cat $OUT/check/summary.txt
ok=1
grep -qE "rc=[1-9]" $OUT/check/summary.txt && ok=0
[ "$(grep -c ' 0 mismatches' $OUT/check/summary.txt)" = 5 ] || ok=0
[ "$(grep -c 'PASS' $OUT/check/summary.txt)" = 2 ] || ok=0  # the two sequence tests
if [ $ok = 1 ]; then
  echo "=== $(date +%T) timeout test"
  for case in dispatch combine; do timeout 60 $H --mode timeout --timeout-case $case 2>&1 | tail -2; done
  echo "=== $(date +%T) stress: ${STRESS_LAYERS:-100000} layers, N=2 on two GPUs, max_tokens 16, one rank delayed at random"
  timeout 200 $H --mode stress --ranks 2 --layers ${STRESS_LAYERS:-100000} --max-tokens 16 --stress-log-every 50000 \
    --csv $OUT/stress.csv --commit ${GIT_COMMIT:-unknown} 2>&1 | tail -4
  if [ -n "${LAT_SIDES:-}" ]; then
    echo "=== $(date +%T) kernels alone, alternated"
    SIDES="$LAT_SIDES" OUT=$OUT bash benchmarks/gpu_lat_variants.sh
  fi
  echo "=== $(date +%T) A/B"
  OUT=$OUT/ab STAGES="${AB_STAGES:-latency jit}" bash benchmarks/gpu_ab.sh > /dev/null 2>&1
  grep -vE "^\s*$" $OUT/ab/summary.txt
else
  echo "CHECK FAILED: no A/B"; tail -30 $W/h*.log
fi
} 2>&1 | tee $OUT/summary.txt
(cd $OUT && tar czf all.tar.gz check ab stress.csv lat.csv 2>/dev/null; rm -rf check ab stress.csv lat.csv)
