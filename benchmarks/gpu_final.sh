#!/usr/bin/env bash
# One device call (2 x H200): the 100,000-layer stress run, compute-sanitizer on the FFI path, and the
# benchmark of every backend (N = 1; N = 2 one process and one process per GPU) plus the XLA backends with
# XLA's default flags. CSVs and a summary land in $OUT as each stage ends.
#   GIT_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu_final.sh
set -u
OUT="${OUT:-$PWD/out}"; W=/tmp/w; rm -rf $W; mkdir -p $W "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
C="--commit ${GIT_COMMIT:-unknown}"
log() { echo "=== $(date +%T) $*"; }
TOK=1,2,5,8,16,32,64,128
stages="${STAGES:-stress bench sanitize}"
{
if [[ " $stages " == *" stress "* ]]; then
log stress smoke: 2000 layers
timeout 40 python3 -m jax_latent_ep.testing.harness --mode stress --ranks 2 --layers 2000 --max-tokens 16 \
  --stress-log-every 1000 2>&1 | tail -4; smoke=${PIPESTATUS[0]}
if [ $smoke -eq 0 ]; then
log stress: 100000 layers, N=2 on two GPUs, one rank delayed at random
timeout 200 python3 -m jax_latent_ep.testing.harness --mode stress --ranks 2 --layers 100000 --max-tokens 16 \
  --stress-log-every 20000 --csv $OUT/stress.csv $C 2>&1 | tail -9
fi
fi
if [[ " $stages " == *" bench "* ]]; then
log bench: every backend, XLA flags: command buffers for fusions and custom calls, temps at fixed addresses
timeout 190 python3 benchmarks/bench.py all --backends nvlink,xla,xla-allgather --tokens $TOK --layers 32 --repeats 10 \
  --inner 5 --max-tokens -1 --xla-flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP --out $W/bench.csv 2>&1 | grep -v "^\[" | tail -12
cp $W/bench.csv $OUT/bench.csv
fi
if [[ " $stages " == *" sanitize "* ]]; then
log memcheck, FFI path '(jitted program, N=1, 4 layers)'
timeout 110 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 benchmarks/bench.py worker --ranks 1 \
  --backends nvlink --tokens 8 --layers 4 --repeats 1 --inner 1 --max-tokens -1 > $W/memcheck.log 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|RESULT" $W/memcheck.log | cut -c1-160
log racecheck, harness N=1
timeout 40 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m jax_latent_ep.testing.harness --mode virtual \
  --ranks 1 --layers 3 --max-tokens 8 2>&1 | grep -E "RACECHECK SUMMARY|->" ; echo "racecheck rc=${PIPESTATUS[0]}"
fi
if [[ " $stages " == *" bench "* ]]; then
log bench: XLA backends with XLA default flags, N=2 one process per GPU
timeout 60 python3 benchmarks/bench.py all --no-cmdbuf --only-ranks 2 --only-procs 2 --backends xla,xla-allgather --tokens $TOK \
  --layers 32 --repeats 10 --inner 5 --max-tokens -1 --tag=-defaultflags --out $W/bench.csv 2>&1 | grep -v "^\[" | tail -4
cp $W/bench.csv $OUT/bench.csv
fi
log done
} 2>&1 | tee $OUT/summary.txt
tar czf $OUT/logs.tar.gz -C $W . 2>/dev/null
