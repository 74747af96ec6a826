#!/usr/bin/env bash
# One device call (2 x H200) on the JAX path: the launch-path check (record targets vs traced, bit for bit),
# the benchmark of every backend (N = 1; N = 2 one process and one process per GPU; the NVLink backend also on
# the traced path), the kernel timeline of a jitted program, the GPU test suite, and compute-sanitizer on the
# FFI path; Nsight Compute (ncu) of both kernels at N = 1, T = 128, and a stress smoke run. CSVs and a summary
# land in $OUT as each stage ends; logs in $OUT/logs.tar.gz.
# Stage xlacb (not in the default list): the XLA variants at N = 2 with NCCL's collectives captured into XLA's
# command buffers (COLLECTIVES) against the defaults, in one run, the NVLink backend beside them
# ([XLACB_VARIANTS="default collectives-cmdbuf"] [XLACB_TOKENS=1,8,32,128]).
#   GIT_COMMIT=<sha> OUT=<dir> [STAGES="record bench timeline tests sanitize ncu stress xlacb"] [BENCH_RANKS=2]
#   [TESTS_TIMEOUT=300] [TEST_FILES="tests/..."] bash benchmarks/gpu_final.sh
# (The harness runs, the 100,000-layer stress included, are in benchmarks/gpu_guard.sh.)
source "$(dirname "$0")/gpu_common.sh"
TOK=1,2,5,8,16,32,64,128
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
FLAGS=--xla-flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP
stages="${STAGES:-record bench timeline tests sanitize ncu stress}"
{
if has record; then
log "launch paths: record targets vs traced, bit for bit against XLA"
timeout 150 python3 -m pytest -q -x -m gpu tests/test_nvlink_gpu.py -k "record or lowering" 2>&1 | tail -4
rc=${PIPESTATUS[0]}
if [ $rc -ne 0 ]; then export JAX_LATENT_EP_FFI_RECORD=0; echo "record path failed (rc $rc): the rest runs traced"; fi
python3 -c "import jax; jax.devices(); from jax_latent_ep import ffi; ffi.register_targets(); print('launch path:', ffi.launch_path(), ffi.record_error() or '')" 2>&1 | tail -1
fi
if has bench; then
log "bench: every backend (XLA flags: command buffers for fusions and custom calls, temps at fixed addresses)"
timeout 300 python3 benchmarks/bench.py all --stages layers --backends nvlink,xla,xla-allgather --tokens $TOK --layers 32 --repeats 10 \
  --max-tokens -1 --only-ranks ${BENCH_RANKS:-1,2} $FLAGS --out $W/bench.csv 2>&1 | grep -v "^\[" | tail -12
grep -ho '"launch_path": "[a-z]*"' $W/bench.N*.log | sort | uniq -c
cp $W/bench.csv $OUT/bench.csv
log "bench: the NVLink backend on the traced path (JAX_LATENT_EP_FFI_RECORD=0), N=$(( GPUS < 2 ? 1 : 2 ))"
JAX_LATENT_EP_FFI_RECORD=0 timeout 90 python3 benchmarks/bench.py all --stages layers --backends nvlink --tokens 1,8,128 --layers 32 \
  --repeats 10 --max-tokens -1 --only-ranks $(( GPUS < 2 ? 1 : 2 )) $FLAGS --tag=-traced --out $W/bench.csv 2>&1 | grep -v "^\[" | tail -4
cp $W/bench.csv $OUT/bench.csv
fi
if has xlacb; then
CB_ALL=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES
for v in ${XLACB_VARIANTS:-default collectives-cmdbuf}; do
  extra=""; [ $v = default ] || extra=" --xla_gpu_enable_command_buffer=$CB_ALL"
  log "bench N=2, XLA variants ($v)"
  timeout 300 python3 benchmarks/bench.py all --stages layers --backends xla,xla-allgather$([ $v = default ] && echo ,nvlink) \
    --tokens ${XLACB_TOKENS:-1,8,32,128} --layers 32 --repeats 10 --max-tokens -1 --only-ranks 2 \
    --xla-flags="--xla_gpu_command_buffer_update_mode=SKIP_TEMP$extra" --tag=-$v --out $OUT/bench_xlacb.csv 2>&1 \
    | grep -v "^\[" | tail -8
done
fi
if has timeline; then
for n in $(seq 1 $(( GPUS < 2 ? GPUS : 2 ))); do
  log "timeline N=$n T=1 (one process)"
  XLA_FLAGS="--xla_gpu_command_buffer_update_mode=SKIP_TEMP --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL" timeout 90 \
    python3 benchmarks/timeline.py --ranks $n --tokens 1 --show 7 2>&1 | grep -v "^[WI][0-9]\{4\}" | head -16
done
fi
if has tests; then
log gpu tests
timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu ${TEST_FILES:-tests/test_nvlink_gpu.py tests/test_kernels_gpu.py \
  tests/test_reference.py tests/test_api.py tests/test_moe.py} 2>&1 | tail -8
fi
if has sanitize; then
log racecheck, FFI path '(jitted program, N=1, 2 layers)'
timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 benchmarks/bench.py worker --ranks 1 \
  --backends nvlink --tokens 8 --layers 2 --repeats 1 --inner 1 --max-tokens -1 > $W/racecheck.log 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|RESULT|Error" $W/racecheck.log | cut -c1-160
fi
if has ncu; then
log "ncu: dispatch and combine at N = 1, T = 128 (first un-captured launches; clocks left alone)"
timeout 150 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section LaunchStats --section Occupancy -k regex:ep_ -c 2 python3 -m jax_latent_ep.testing.harness --mode latency \
  --ranks 1 --max-tokens 128 --latency-tokens 128 > $W/ncu.txt 2>&1
echo "ncu rc=$?"; grep -E "ep_dispatch|ep_combine|Duration|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Stall|Compute \(SM\) Throughput|L2 Hit|Block Size|Grid Size" $W/ncu.txt | head -60
cp $W/ncu.txt $OUT/ncu.txt
fi
if has stress; then
log "stress: 20000 layers, N = 2 on two GPUs, one rank delayed at random"
timeout 60 python3 -m jax_latent_ep.testing.harness --mode stress --ranks 2 --layers 20000 --max-tokens 16 \
  --stress-log-every 10000 --csv $OUT/stress.csv $C 2>&1 | tail -4
fi
log done
} 2>&1 | tee $OUT/summary.txt
tar czf $OUT/logs.tar.gz -C $W . 2>/dev/null
