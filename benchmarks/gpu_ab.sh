#!/usr/bin/env bash
# One device call (2 x H200) comparing this tree with an older one in the same run: kernel-only latency (the
# harness, N = 1 and 2, buffers of 8 and 128 tokens) and the jitted NVLink layer (one process per GPU), each
# interleaved old / new; then the floor microbenchmark and the benchmark of every backend at N = 2.
# OLD (and MID, if set): an older tree with its own cubins and FFI library in OLD/jax_latent_ep/_artifacts (a
# different buffer layout needs its own Python package, so it runs from its own directory). Also a correctness
# stage (check: the harness on this tree's kernels). Summary in $OUT/summary.txt.
# EXTRA="name=dir ...": more trees of this commit (build variants, e.g. other build-time settings), each run like
# OLD under its own name (a name must not start with old, mid or new).
#   GIT_COMMIT=<sha> OLD_COMMIT=<sha> OLD=<dir> [MID_COMMIT=<sha> MID=<dir>] [EXTRA="name=dir ..."] OUT=<dir>
#   [STAGES="floor check latency jit bench"] [JIT_MAX_TOKENS="-1 128"] [JIT_TOKENS=1,8,32,128] bash benchmarks/gpu_ab.sh
source "$(dirname "$0")/gpu_common.sh"
stages="${STAGES:-floor latency jit bench}"
NEW=$PWD
EXTRA="${EXTRA:-}"
SIDES="${OLD:+old} ${MID:+mid} $(for e in $EXTRA; do printf '%s ' ${e%%=*}; done)new"
extra_dir() {  # extra_dir SIDE: the directory of an EXTRA side (SIDE may carry a suffix, e.g. -again), else empty
  local e; for e in $EXTRA; do [[ $1 == ${e%%=*}* ]] && { echo ${e#*=}; return; }; done
}
side_dir() { case $1 in old*) echo $OLD;; mid*) echo $MID;; new*) echo $NEW;; *) extra_dir $1;; esac; }
side_commit() {
  case $1 in old*) echo ${OLD_COMMIT:-unknown};; mid*) echo ${MID_COMMIT:-unknown};; *) echo ${GIT_COMMIT:-unknown};; esac
}
run_in() {  # run_in DIR COMMIT command...: the command in DIR with that tree's package
  local dir=$1 commit=$2; shift 2
  (cd $dir && PYTHONPATH=$dir "$@" --commit $commit)
}
{
if has floor; then
log "floor: flag round trip and SM store bandwidth (benchmarks/floor.cu)"
nvcc -O3 -arch=sm_90a -o $W/floor benchmarks/floor.cu && $W/floor $OUT/floor_raw.csv 2>&1 | tail -20
fi
if has check; then
log "harness correctness, this tree's kernels"
harness_check $OUT/check.csv
for case in dispatch_twice combine_twice; do
  timeout 60 $H --mode sequence --sequence-case $case --csv $OUT/sequence.csv $C 2>&1 | tail -1
done
fi
if has latency; then
for mt in 8 128; do
  for side in $SIDES; do
    dir=$(side_dir $side); commit=$(side_commit $side)
    echo "-- kernels ($side, $commit), max_tokens $mt (N = 1 2)"
    run_in $dir $commit timeout 100 python3 -m jax_latent_ep.testing.harness --mode latency --ranks 1 2 \
      --max-tokens $mt --tag=-$side-max$mt --csv $OUT/latency.csv 2>&1 | grep -E "T=|rror"
  done
done
fi
if has jit; then
for mt in ${JIT_MAX_TOKENS:--1}; do  # -1: each T its own buffer (max_tokens = T); N: one buffer of N tokens
log "jitted layer, N = 2 (one process per GPU), the NVLink backend of each tree, --max-tokens $mt"
for side in ${JIT_SIDES:-new old ${MID:+mid} new-again}; do
  dir=$(side_dir $side); commit=$(side_commit $side)
  tag=-$side; [ $mt = -1 ] || tag=-$side-buf$mt
  (cd $dir && GIT_COMMIT=$commit PYTHONPATH=$dir timeout 120 python3 benchmarks/bench.py all --stages layers --backends nvlink --tokens ${JIT_TOKENS:-1,8,32,128} \
    --layers 32 --repeats 10 --max-tokens $mt --only-ranks 2 --only-procs 2 \
    --xla-flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP --tag=$tag --out $OUT/bench_ab.csv 2>&1 | grep -v "^\[" \
    > $W/jit$tag.txt)
  tail -2 $W/jit$tag.txt
  # A failed worker's error survives here (its log beside the CSV is overwritten by the next side's run).
  grep -E "failed with|Error|error:" $W/jit$tag.txt | grep -v "^W[0-9]" | head -6
done
done
fi
if has bench; then
log "bench N=2: every backend (SKIP_TEMP), both process modes"
timeout 280 python3 benchmarks/bench.py all --stages layers --backends nvlink,xla,xla-allgather --tokens 1,2,5,8,16,32,64,128 --layers 32 \
  --repeats 10 --max-tokens -1 --only-ranks 2 --xla-flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP \
  --out $OUT/bench.csv 2>&1 | grep -v "^\[" | tail -14
fi
log done
} 2>&1 | tee $OUT/summary.txt
