#!/usr/bin/env bash
# One device call (2 x H200) after a kernel change: the harness's correctness runs, the sequence tests (with
# the kernels of this tree and, with EXTRA_ARTIFACTS, with an older build, to show what they catch), the
# timeout path and kernel-only latency; then where a jitted layer's time goes (profiler timeline, XLA's
# command-buffer log). Summary in $OUT/summary.txt, CSVs and logs in $OUT/all.tar.gz.
#   GIT_COMMIT=<sha> OUT=<dir> [EXTRA_ARTIFACTS=<dir>] [STAGES="check sequence latency timeline"] bash benchmarks/gpu_guard.sh
source "$(dirname "$0")/gpu_common.sh"
stages="${STAGES:-check sequence latency timeline}"  # also: stress
{
if has check; then
log harness correctness
DEVICE_MAX_TOKENS=64 CHECK_LAYERS=1000 harness_check $W/results.csv
fi
if has sequence; then
for art in jax_latent_ep/_artifacts ${EXTRA_ARTIFACTS:-}; do
  for case in dispatch_twice combine_twice; do
    log "sequence $case, kernels $art"
    timeout 60 $H --mode sequence --sequence-case $case --artifacts $art --csv $W/sequence_$(basename $art).csv $C 2>&1 | tail -3
  done
done
log timeout test
for case in dispatch combine; do timeout 60 $H --mode timeout --timeout-case $case 2>&1 | tail -2; done
fi
if has stress; then
log stress smoke: 2000 layers
timeout 40 $H --mode stress --ranks 2 --layers 2000 --max-tokens 16 --stress-log-every 1000 2>&1 | tail -3; smoke=${PIPESTATUS[0]}
if [ $smoke -eq 0 ]; then
log stress: 100000 layers, N=2 on two GPUs, one rank delayed at random
timeout 200 $H --mode stress --ranks 2 --layers 100000 --max-tokens 16 --stress-log-every 20000 --csv $W/stress.csv $C 2>&1 | tail -9
fi
fi
if has latency; then
log harness latency
for art in jax_latent_ep/_artifacts ${EXTRA_ARTIFACTS:-}; do
  for mt in 8 128; do
    echo "-- kernels $art, max_tokens $mt (N = 1, then N = 2)"
    timeout 120 $H --mode latency --ranks 1 2 --max-tokens $mt --artifacts $art --csv $W/latency_$(basename $art)_mt$mt.csv $C 2>&1 | grep -E "T="
  done
done
fi
if has timeline; then
for flags in "--xla_gpu_command_buffer_update_mode=SKIP_TEMP" ""; do
  for n in 1 2; do
    log "timeline N=$n T=1 (one process), XLA_FLAGS='$flags'"
    XLA_FLAGS="$flags" timeout 120 python3 benchmarks/timeline.py --ranks $n --tokens 1 2>&1 | grep -v "^[WI]0000\|^[WI]1130" | tail -36
  done
done
log "XLA command-buffer log, N=1 T=1, SKIP_TEMP"
XLA_FLAGS="--xla_gpu_command_buffer_update_mode=SKIP_TEMP" TF_CPP_MIN_LOG_LEVEL=0 \
  TF_CPP_VMODULE=gpu_executable=5,command_buffer_thunk=3,command_executor=1,traced_command_buffer=6 \
  timeout 120 python3 benchmarks/timeline.py --ranks 1 --tokens 1 > $W/vlog.txt 2>&1
grep -o "Buffer allocations changed address.*\|updated_allocs=[0-9]*\|Updated [0-9]* commands in [0-9]* us (skipped [0-9]*\|cache hit\|create new item\|evicting" $W/vlog.txt \
  | sed 's/in [0-9]* us/in N us/' | sort | uniq -c | sort -rn | head -12
grep -o "Updated [0-9]* commands in [0-9]* us" $W/vlog.txt | tail -4
fi
log done
} 2>&1 | tee $OUT/summary.txt
tar czf $OUT/all.tar.gz -C $W . 2>/dev/null
