#!/usr/bin/env bash
# One device call (2 x H200) for the README's table: the floor (floor.cu), the kernels alone (the harness, N = 1
# and 2, buffers of 8 and 128 tokens), the benchmark of every backend at N = 2 with the XLA variants again with
# their collectives in command buffers (gpu_final.sh stages bench and xlacb), and the jitted NVLink layer with one
# buffer of 128 tokens for every T (`-buf128`: a decode server's case, one ExpertParallel for every batch size).
#   GIT_COMMIT=<sha> OUT=<dir> [STAGES="floor latency final buf128"] bash benchmarks/gpu_table.sh
# Then: python benchmarks/floor_rows.py $OUT/floor_raw.csv --commit <sha> >> benchmarks/results/floor.csv,
# python benchmarks/plot.py --ranks 2.
# At most 8 files come back from a device call: the CSVs, table.txt, and every log in logs.tar.gz.
source "$(dirname "$0")/gpu_common.sh"
stages="${STAGES:-floor latency final buf128}"
T=/tmp/table; rm -rf $T; mkdir -p $T/final  # gpu_final.sh clears $W: its output and logs go here
{
if has floor; then
  log "floor: flag round trip and SM store bandwidth (benchmarks/floor.cu)"
  nvcc -O3 -arch=sm_90a -o $W/floor benchmarks/floor.cu && $W/floor $OUT/floor_raw.csv 2>&1 | grep -E "round|peer_store" | tail -9
fi
if has latency; then
  for mt in 8 128; do
    log "kernels alone (harness), N = 1 2, max_tokens $mt"
    timeout 120 $H --mode latency --ranks 1 2 --max-tokens $mt --tag=-max$mt --csv $OUT/latency.csv $C 2>&1 | grep -E "T=|rror"
  done
fi
if has final; then
  OUT=$T/final STAGES="bench xlacb" BENCH_RANKS=2 XLACB_VARIANTS=collectives-cmdbuf XLACB_TOKENS=1,2,5,8,16,32,64,128 \
    bash benchmarks/gpu_final.sh > $T/final.txt 2>&1
  grep -v "^\[" $T/final.txt
  cp $T/final/bench.csv $T/final/bench_xlacb.csv $OUT/
fi
if has buf128; then
  log "jitted NVLink layer, N = 2 (one process per GPU), one buffer of 128 tokens for every T"
  timeout 150 python3 benchmarks/bench.py all --stages layers --backends nvlink --tokens 1,2,5,8,16,32,64,128 --layers 32 --repeats 10 \
    --max-tokens 128 --only-ranks 2 --only-procs 2 --xla-flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP \
    --tag=-buf128 --out $T/bench_buf128.csv 2>&1 | grep -v "^\[" | tail -3
  cp $T/bench_buf128.csv $OUT/
fi
log done
} 2>&1 | tee $OUT/table.txt
tar czf $OUT/logs.tar.gz -C $T . 2>/dev/null
