#!/usr/bin/env bash
# One device call (2 x H200) per kernel iteration: kernel-only latency of several cubin sets side by side
# (ARTS: artifact directories, interleaved per buffer size; the first is the tree's), correctness of the tree's
# kernels (CHECK_ARTS: another directory), the stamps of a trace build (TRACE_ARTS, built with JAX_LATENT_EP_KERNEL_TRACE=1), then the jitted
# benchmark of every backend at N = 2. Summary in $OUT/summary.txt, CSVs in $OUT.
#   GIT_COMMIT=<sha> OUT=<dir> ARTS="jax_latent_ep/_artifacts jax_latent_ep/_artifacts/prev"
#   [TRACE_ARTS=jax_latent_ep/_artifacts/trace] [STAGES="latency grid check trace host pdl abbench bench"]
#   [LAT_RANKS="1 2"] [CHECK_LAYERS=1000] bash benchmarks/gpu_iter.sh
# (host: enqueue vs wall time per program, benchmarks/host_probe.py, and a timeline with host events.)
source "$(dirname "$0")/gpu_common.sh"
ARTS="${ARTS:-jax_latent_ep/_artifacts}"
stages="${STAGES:-latency grid check trace bench}"
{
if has latency; then
for mt in 8 128; do
  for art in $ARTS; do
    tag=-$(basename $art)-max$mt
    echo "-- kernels $art, max_tokens $mt (N = ${LAT_RANKS:-1 2})"
    timeout 100 $H --mode latency --ranks ${LAT_RANKS:-1 2} --max-tokens $mt --artifacts $art --tag=$tag --csv $OUT/latency.csv $C 2>&1 | grep -E "T=|rror"
  done
done
fi
if has grid; then
for cap in 128 256; do
  echo "-- kernels of the tree, max_tokens 128, grids max(T, min(N * S, $cap)) (N = 2)"
  timeout 100 $H --mode latency --ranks 2 --max-tokens 128 --grid-cap $cap --tag=-grid$cap --csv $OUT/latency.csv $C 2>&1 | grep -E "T=|rror"
done
fi
if has check; then
CA="--artifacts ${CHECK_ARTS:-jax_latent_ep/_artifacts}"
log "harness correctness ($CA)"
CHECK_LAYERS=${CHECK_LAYERS:-1000} harness_check $OUT/check.csv $CA
for case in dispatch_twice combine_twice; do
  timeout 60 $H $CA --mode sequence --sequence-case $case --csv $OUT/sequence.csv $C 2>&1 | tail -1
done
fi
if has trace; then
for art in ${TRACE_ARTS:-}; do
  for mt in 8 128; do
    log "trace build $art, max_tokens $mt"
    timeout 100 $H --mode latency --ranks 1 2 --max-tokens $mt --artifacts $art --trace --tag=-trace-max$mt 2>&1 | grep -v "^note"
  done
done
fi
if has host; then
CB="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
log "host or GPU: enqueue time per program vs wall time per program (one process)"
XLA_FLAGS="$CB --xla_gpu_command_buffer_update_mode=SKIP_TEMP" timeout 150 python3 benchmarks/host_probe.py --ranks 2 \
  --tokens 1 --backends nvlink,xla --layers 32,64 2>&1 | grep -v "^[WI][0-9]\{4\}"
XLA_FLAGS="$CB --xla_gpu_command_buffer_update_mode=SKIP_TEMP" timeout 60 python3 benchmarks/host_probe.py --ranks 1 \
  --tokens 1 --backends nvlink --layers 32 2>&1 | grep -v "^[WI][0-9]\{4\}" | tail -1
echo "-- traced FFI path (JAX_LATENT_EP_FFI_RECORD=0)"
JAX_LATENT_EP_FFI_RECORD=0 XLA_FLAGS="$CB --xla_gpu_command_buffer_update_mode=SKIP_TEMP" timeout 60 python3 \
  benchmarks/host_probe.py --ranks 2 --tokens 1 --backends nvlink --layers 32 2>&1 | grep -v "^[WI][0-9]\{4\}" | tail -1
echo "-- command buffers for fusions only (our calls as thunks)"
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION --xla_gpu_graph_min_graph_size=1" timeout 60 python3 \
  benchmarks/host_probe.py --ranks 2 --tokens 1 --backends nvlink --layers 32 2>&1 | grep -v "^[WI][0-9]\{4\}" | tail -1
log "timeline N=2 T=1 with host events"
XLA_FLAGS="$CB --xla_gpu_command_buffer_update_mode=SKIP_TEMP" timeout 90 python3 benchmarks/timeline.py --ranks 2 \
  --tokens 1 --show 8 --host-events 40 2>&1 | grep -v "^[WI][0-9]\{4\}"
fi
if has pdl; then
CB="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1 --xla_gpu_command_buffer_update_mode=SKIP_TEMP"
for pdl in false true; do
  log "timeline N=2 T=1 (one process), --xla_gpu_enable_pdl=$pdl --xla_gpu_enable_pdl_launch=$pdl"
  XLA_FLAGS="$CB --xla_gpu_enable_pdl=$pdl --xla_gpu_enable_pdl_launch=$pdl" timeout 90 python3 benchmarks/timeline.py \
    --ranks 2 --tokens 1 --show 7 2>&1 | grep -v "^[WI][0-9]\{4\}" | head -13
done
log "bench N=2, nvlink and xla, XLA's PDL for its own kernels off / on"
for pdl in false true; do
  timeout 150 python3 benchmarks/bench.py all --stages layers --backends nvlink,xla --tokens 1,8,32,128 --layers 32 --repeats 10 \
    --max-tokens -1 --only-ranks 2 --xla-flags="--xla_gpu_command_buffer_update_mode=SKIP_TEMP --xla_gpu_enable_pdl=$pdl --xla_gpu_enable_pdl_launch=$pdl" \
    --tag=-xlapdl-$pdl --out $OUT/bench.csv 2>&1 | grep -v "^\[" | tail -5
done
fi
if has abbench; then
log "bench N=2 (one process per GPU), the NVLink backend with each of ARTS"
for art in $ARTS; do
  JAX_LATENT_EP_ARTIFACTS=$PWD/$art timeout 120 python3 benchmarks/bench.py all --stages layers --backends nvlink --tokens 1,8,32,128 \
    --layers 32 --repeats 10 --max-tokens -1 --only-ranks 2 --only-procs 2 \
    --xla-flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP --tag=-$(basename $art) --out $OUT/bench.csv 2>&1 | grep -v "^\[" | tail -2
done
fi
if has bench; then
log "bench N=2: every backend (SKIP_TEMP)"
timeout 260 python3 benchmarks/bench.py all --stages layers --backends nvlink,xla,xla-allgather --tokens 1,2,5,8,16,32,64,128 --layers 32 \
  --repeats 10 --inner 20 --max-tokens -1 --only-ranks ${BENCH_RANKS:-2} --xla-flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP \
  --out $OUT/bench.csv 2>&1 | grep -v "^\[" | tail -14
log "bench N=2: nvlink with 5 programs per sample (the earlier setting)"
timeout 100 python3 benchmarks/bench.py all --stages layers --backends nvlink --tokens 1,8,128 --layers 32 --repeats 10 --inner 5 \
  --max-tokens -1 --only-ranks 2 --xla-flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP --tag=-inner5 \
  --out $OUT/bench.csv 2>&1 | grep -v "^\[" | tail -4
fi
log done
} 2>&1 | tee $OUT/summary.txt
