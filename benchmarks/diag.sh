#!/usr/bin/env bash
# One device call of diagnostics for the latency work (issue: Benchmarks): which kernels XLA launches per
# layer and how long each runs (ncu, N = 1), XLA's optimized HLO / command buffers at T = 5 and T = 8, the
# per-layer time with a buffer sized for T vs for 128, and ncu source-level stalls of each kernel (N = 1).
#   GIT_COMMIT=<sha> OUT=<dir> bash benchmarks/diag.sh
set -u
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
CB="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
log() { echo "=== $(date +%T) $*"; }
W="python3 benchmarks/bench.py worker --backends nvlink --repeats 3"
log kernels per layer, N=1, ncu
for t in 1 8; do
  XLA_FLAGS="$CB" timeout 120 ncu --clock-control none --csv --metrics gpu__time_duration.sum --print-units base \
    $W --ranks 1 --tokens $t --layers 4 --max-tokens $t > $OUT/ncu_jit_n1_t$t.csv 2> $OUT/ncu_jit_n1_t$t.err
  echo "T=$t: $(grep -c gpu__time_duration $OUT/ncu_jit_n1_t$t.csv) kernel rows"
done
log XLA dumps N=2 one process
for t in 5 8; do
  rm -rf /tmp/dump$t
  XLA_FLAGS="$CB --xla_dump_to=/tmp/dump$t" timeout 120 $W --ranks 2 --tokens $t --layers 4 --max-tokens 128 > /dev/null 2>&1
  mkdir -p $OUT/dump$t
  cp $(ls /tmp/dump$t/* | grep -E "program.*(after_optimizations\.txt|thunk|command|buffer-assignment)" | head -8) $OUT/dump$t/ 2>/dev/null
  ls /tmp/dump$t | grep program | head -20 > $OUT/dump$t/LIST
done
log bench N=2, buffer for 128 vs for T
for mt in 0 -1; do
  XLA_FLAGS="" timeout 300 python3 benchmarks/bench.py all --stages layers --only-ranks 2 --backends nvlink,xla --tokens 1,8,128 \
    --layers 32 --repeats 10 --max-tokens $mt --out $OUT/bench_mt$mt.csv 2>&1 | grep -v "^\[" | tail -8
done
log harness latency, buffer for 8
python3 -m jax_latent_ep.testing.harness --mode latency --ranks 1 2 --max-tokens 8 --csv $OUT/lat8.csv 2>&1 | tail -8
log ncu source stalls, N=1
for k in dispatch combine; do
  timeout 120 ncu --clock-control none --section SourceCounters --section WarpStateStats --section LaunchStats --section SpeedOfLight \
    -k regex:ep_$k --launch-skip 4 -c 2 -o $OUT/$k -f \
    python3 -m jax_latent_ep.testing.harness --mode virtual --ranks 1 --max-tokens 8 --layers 8 --nonfinite-every 0 > $OUT/ncu_$k.log 2>&1
  ncu -i $OUT/$k.ncu-rep --page source --print-source sass --csv > $OUT/${k}_sass.csv 2>&1
  ncu -i $OUT/$k.ncu-rep --page details > $OUT/${k}_details.txt 2>&1
  tail -2 $OUT/ncu_$k.log; wc -l $OUT/${k}_sass.csv
done
log done
