#!/usr/bin/env bash
# One device call (2 x H200): where the late rank's combine spends token 0's reduce (kernel_notes.md, sessions
# 11-12). Runs the warp trace build (built here with JAX_LATENT_EP_KERNEL_TRACE=2 into $TRACEW and carried) at N = 2,
# buffers of 8 and 128, then the same layers with the shipped cubins for reference; the full output goes to
# $OUT/trace_split.txt, a summary (per rank: stamps 9-13, each warp's polls returned and past the stash barrier,
# warp 0's rstd and stores) to stdout.
#   TRACEW=.carry/tracew2 GIT_COMMIT=<sha> OUT=<dir> [HARGS=--latency-virtual] bash benchmarks/gpu_trace_split.sh
# (HARGS: more harness arguments; --latency-virtual runs both ranks on one GPU, to try the script on one.)
source "$(dirname "$0")/gpu_common.sh"
TRACEW="${TRACEW:-.carry/tracew2}"; HARGS="${HARGS:-}"
{
for mt in 8 128; do
  log "warp trace build $TRACEW, N = 2, max_tokens $mt"
  JAX_LATENT_EP_KERNEL_TRACE=2 timeout 120 $H --mode latency --ranks 2 $HARGS --max-tokens $mt --artifacts $TRACEW --trace \
    --tag=-tracew-max$mt --csv $OUT/latency.csv $C 2>&1 | grep -v "^note"
  log "shipped cubins, N = 2, max_tokens $mt"
  timeout 120 $H --mode latency --ranks 2 $HARGS --max-tokens $mt --tag=-max$mt --csv $OUT/latency.csv $C 2>&1 | grep -E "T=|rror"
done
} > $OUT/trace_split.txt 2>&1
grep -E "===|T=|rank |   9 |  1[0-3] |warp trace|combine wait" $OUT/trace_split.txt | cut -c1-150
