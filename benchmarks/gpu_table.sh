#!/usr/bin/env bash
# One device call (2 x H200) for the README's tables: `bench.py all` (the issue's one script: in one run the floor
# from floor.cu, the kernels alone from the harness, every backend's jitted layer at N = 1 and N = 2 in both process
# modes, and the launches per layer, all into one CSV), then the XLA variants again with their collectives in
# command buffers (stage xlacb), and the jitted NVLink layer with one buffer of 128 tokens for every T (stage buf128:
# a decode server's case, one ExpertParallel for every batch size).
#   GIT_COMMIT=<sha> OUT=<dir> [STAGES="all xlacb buf128"] bash benchmarks/gpu_table.sh
# Then: python benchmarks/bench.py table $OUT/bench.csv --markdown (the README's tables); python benchmarks/plot.py --ranks 2.
# At most 8 files come back from a device call: the CSVs, table.txt, and the workers' logs in logs.tar.gz.
source "$(dirname "$0")/gpu_common.sh"
stages="${STAGES:-all xlacb buf128}"
FLAGS=--xla-flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP
T=/tmp/table; rm -rf $T; mkdir -p $T
{
if has all; then
  log "bench.py all: floor, kernels alone, jitted layers of every backend, launches per layer (N = 1 and 2)"
  GIT_COMMIT=${GIT_COMMIT:-unknown} timeout 420 python3 benchmarks/bench.py all --layers 32 --repeats 10 --max-tokens -1 \
    $FLAGS --out $T/bench.csv 2>&1 | grep -v "^\["
  cp $T/bench.csv $T/bench.floor_raw.csv $OUT/ 2>/dev/null
fi
if has xlacb; then
  log "XLA variants at N = 2 with NCCL's collectives in XLA's command buffers"
  CB_ALL=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES
  GIT_COMMIT=${GIT_COMMIT:-unknown} timeout 300 python3 benchmarks/bench.py all --stages layers --backends xla,xla-allgather \
    --layers 32 --repeats 10 --max-tokens -1 --only-ranks 2 --count-tokens none \
    --xla-flags="--xla_gpu_command_buffer_update_mode=SKIP_TEMP --xla_gpu_enable_command_buffer=$CB_ALL" \
    --tag=-collectives-cmdbuf --out $T/bench_xlacb.csv 2>&1 | grep -v "^\[" | tail -8
  cp $T/bench_xlacb.csv $OUT/
fi
if has buf128; then
  log "jitted NVLink layer, N = 2 (one process per GPU), one buffer of 128 tokens for every T"
  GIT_COMMIT=${GIT_COMMIT:-unknown} timeout 150 python3 benchmarks/bench.py all --stages layers --backends nvlink --layers 32 \
    --repeats 10 --max-tokens 128 --only-ranks 2 --only-procs 2 --count-tokens none $FLAGS --tag=-buf128 \
    --out $T/bench_buf128.csv 2>&1 | grep -v "^\[" | tail -3
  cp $T/bench_buf128.csv $OUT/
fi
log done
} 2>&1 | tee $OUT/table.txt
tar czf $OUT/logs.tar.gz -C $T . 2>/dev/null
