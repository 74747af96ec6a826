#!/usr/bin/env bash
# One device call: correctness of the kernels (harness: N = 1, 2, 4, 8 virtual ranks and N = 2 on two GPUs,
# Kimi K3 and DeepSeek-V3), the timeout path, kernel-only latency, then (if all passed) the GPU tests and a
# short benchmark. Everything lands in $OUT/all.tar.gz (one file) plus $OUT/summary.txt.
#   GIT_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu_v3.sh [quick|full|perf]   (perf: skip the correctness runs)
set -u
mode="${1:-full}"
OUT="${OUT:-$PWD/out}"; W=/tmp/w; rm -rf $W; mkdir -p $W "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
C="--commit ${GIT_COMMIT:-unknown}"
H="python3 -m jax_latent_ep.testing.harness"
log() { echo "=== $(date +%T) $*"; }
{
r0=0; r1=0; r2=0
if [ "$mode" != perf ]; then
log harness correctness
( CUDA_VISIBLE_DEVICES=0 $H --mode virtual --ranks 1 --max-tokens 128 --layers 300 --csv $W/results.csv $C &&
  CUDA_VISIBLE_DEVICES=0 $H --mode virtual --ranks 8 --max-tokens 16 --layers 300 --csv $W/results.csv $C &&
  CUDA_VISIBLE_DEVICES=0 $H --shape deepseek_v3 --mode virtual --ranks 4 --max-tokens 16 --layers 100 --csv $W/results.csv $C ) > $W/h0.log 2>&1 &
p0=$!
( CUDA_VISIBLE_DEVICES=1 $H --mode virtual --ranks 4 --max-tokens 32 --layers 300 --csv $W/results.csv $C &&
  CUDA_VISIBLE_DEVICES=1 $H --mode virtual --ranks 2 --max-tokens 64 --layers 300 --csv $W/results.csv $C ) > $W/h1.log 2>&1 &
p1=$!
wait $p0; r0=$?; wait $p1; r1=$?
grep -E "layers,|mismatch|Error|error|->" $W/h0.log $W/h1.log | head -20
timeout 120 $H --mode devices --ranks 2 --max-tokens 64 --layers 1000 --csv $W/results.csv $C > $W/h2.log 2>&1; r2=$?
tail -3 $W/h2.log
echo "harness rc: $r0 $r1 $r2"
log timeout test
timeout 60 $H --mode timeout 2>&1 | tail -2
fi
if [ "$mode" = perf ]; then
  log harness correctness, short
  timeout 120 $H --mode devices --ranks 2 --max-tokens 64 --layers 300 --csv $W/results.csv $C 2>&1 | tail -1; r2=${PIPESTATUS[0]}
fi
log harness latency
for art in jax_latent_ep/_artifacts ${EXTRA_ARTIFACTS:-}; do
  tag=$(basename $art)
  for mt in 8 128; do
    echo "-- $tag max_tokens $mt"
    timeout 120 $H --mode latency --ranks ${LAT_RANKS:-1 2} --max-tokens $mt --artifacts $art --csv $W/latency_${tag}_mt$mt.csv $C 2>&1 | grep -E "T="
  done
done
if [ "$mode" != quick ] && [ $r0 -eq 0 ] && [ $r1 -eq 0 ] && [ $r2 -eq 0 ]; then
  if [ -z "${SKIP_TESTS:-}" ]; then log gpu tests
  timeout 300 python3 -m pytest -q -m gpu ${TESTS:-tests/test_nvlink_gpu.py tests/test_kernels_gpu.py tests/test_reference.py tests/test_api.py tests/test_moe.py} 2>&1 | tail -8; fi
  log "custom calls per layer (XLA dump, T = 8, 4 layers: expect 4 dispatch + 4 combine)"
  rm -rf /tmp/d8; XLA_FLAGS="--xla_dump_to=/tmp/d8" timeout 60 python3 benchmarks/bench.py worker --ranks 1 --backends nvlink \
    --tokens 8 --layers 4 --repeats 1 --inner 1 --max-tokens -1 > /dev/null 2>&1
  for k in dispatch combine; do echo "$k: $(cat /tmp/d8/*jit_program*after_optimizations.txt | grep -c "custom_call_target=\"jax_latent_ep_$k")"; done
  log nvlink 1000 layers, two processes
  timeout 200 python3 benchmarks/nvlink_layers.py --procs 2 --layers 1000 --csv $W/results.csv 2>&1 | tail -4
  log bench
  timeout 420 python3 benchmarks/bench.py all --stages layers --backends ${BACKENDS:-nvlink,xla,xla-allgather} --tokens 1,2,5,8,16,32,64,128 \
    --layers ${LAYERS:-32} --repeats 10 --inner 5 --max-tokens -1 --only-ranks ${BENCH_RANKS:-1,2} --out $W/bench.csv 2>&1 | grep -v "^\[" | tail -14
fi
log done
} 2>&1 | tee $OUT/summary.txt
tar czf $OUT/all.tar.gz -C $W . 2>/dev/null
