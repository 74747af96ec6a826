#!/usr/bin/env bash
# One device call: kernel harness (correctness + kernel-only latency), the floor microbenchmark, the GPU
# test suite and the 1000-layer JAX checks in both process modes. Writes everything under $OUT (or ./out).
# Expects the artifacts (cubins, manifest, FFI library) in jax_latent_ep/_artifacts and, optionally, an
# earlier verified set in .carry/art_v1 to fall back on if the harness finds a mismatch.
#   GIT_COMMIT=<sha> bash benchmarks/gpu_check.sh [harness] [jax]     (both stages by default)
set -u
stages="${*:-harness jax}"
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
C="--commit ${GIT_COMMIT:-unknown}"
H="python3 -m jax_latent_ep.testing.harness"
log() { echo "=== $(date +%T) $*"; }
nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -5
if [[ " $stages " == *" harness "* ]]; then
log harness correctness
( CUDA_VISIBLE_DEVICES=0 $H --mode virtual --ranks 8 --max-tokens 16 --layers 1000 --csv $OUT/results.csv $C &&
  CUDA_VISIBLE_DEVICES=0 $H --mode virtual --ranks 1 --max-tokens 128 --layers 1000 --csv $OUT/results.csv $C ) > $OUT/h0.log 2>&1 &
p0=$!
( CUDA_VISIBLE_DEVICES=1 $H --mode virtual --ranks 4 --max-tokens 32 --layers 1000 --csv $OUT/results.csv $C &&
  CUDA_VISIBLE_DEVICES=1 $H --mode virtual --ranks 2 --max-tokens 64 --layers 1000 --csv $OUT/results.csv $C ) > $OUT/h1.log 2>&1 &
p1=$!
wait $p0; r0=$?; wait $p1; r1=$?
tail -3 $OUT/h0.log $OUT/h1.log
$H --mode devices --ranks 2 --max-tokens 64 --layers 1000 --csv $OUT/results.csv $C 2>&1 | tail -5; r2=${PIPESTATUS[0]}
if [ $r0 -ne 0 ] || [ $r1 -ne 0 ] || [ $r2 -ne 0 ]; then
  log "HARNESS FAILED ($r0 $r1 $r2): falling back to .carry/art_v1"
  rm -rf jax_latent_ep/_artifacts && cp -r .carry/art_v1 jax_latent_ep/_artifacts
  echo fallback > $OUT/FALLBACK
fi
log harness latency
$H --mode latency --ranks 1 2 --csv $OUT/results.csv $C 2>&1 | tail -12
log floor
nvcc -O3 -arch=sm_90a -o /tmp/floor benchmarks/floor.cu && /tmp/floor $OUT/floor.csv
log sanitizers
compute-sanitizer --tool memcheck --error-exitcode 9 $H --mode virtual --ranks 1 --layers 3 --nonfinite-every 2 2>&1 | tail -3
compute-sanitizer --tool racecheck --error-exitcode 9 $H --mode virtual --ranks 1 --layers 3 2>&1 | tail -3
compute-sanitizer --tool memcheck --error-exitcode 9 $H --mode devices --ranks 2 --layers 3 --timeout-ns 60000000000 2>&1 | tail -3
fi
if [[ " $stages " == *" jax "* ]]; then
log gpu tests
timeout 300 python3 -m pytest -q -x -m gpu tests/ 2>&1 | tail -15
log nvlink 1000 layers, one process
timeout 240 python3 benchmarks/nvlink_layers.py --procs 1 --layers 1000 --csv $OUT/results.csv 2>&1 | tail -3
log nvlink 1000 layers, two processes
timeout 240 python3 benchmarks/nvlink_layers.py --procs 2 --layers 1000 --csv $OUT/results.csv 2>&1 | tail -8
fi
log done
