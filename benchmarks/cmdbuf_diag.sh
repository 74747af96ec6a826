#!/usr/bin/env bash
# XLA command-buffer diagnostics for the NVLink backend inside jit (N = 1, T = 1, 32 layers): per-layer time
# under several XLA flag sets, XLA's VLOG of command-buffer updates, the thunk sequence. One device call:
#   OUT=<dir> bash benchmarks/cmdbuf_diag.sh
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
CB="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
W="python3 benchmarks/bench.py worker --ranks 1 --tokens 1 --layers 32 --repeats 10 --max-tokens -1"
run() { # name flags inner backends
  r=$(XLA_FLAGS="$2" timeout 90 $W --inner $3 --backends $4 2>&1 | grep -E "RESULT|Error|error" | head -2 | cut -c1-400)
  echo "## $1 inner=$3: $(echo "$r" | grep -o '"backend": "[a-z-]*"\|"layer_us_median": [0-9.]*' | tr '\n' ' ') $(echo "$r" | grep -v RESULT | cut -c1-200)"
}
run cb "$CB" 5 nvlink,xla
run cb1 "$CB" 1 nvlink
run default "" 5 nvlink,xla
run skip_temp "$CB --xla_gpu_command_buffer_update_mode=SKIP_TEMP" 5 nvlink,xla
run skip_profiled "$CB --xla_gpu_command_buffer_update_mode=SKIP_PROFILED" 5 nvlink
run cache64 "$CB --xla_cmd_buffer_trace_cache_size=64" 5 nvlink
run nocb "--xla_gpu_enable_command_buffer=" 5 nvlink,xla
rm -rf /tmp/dd; XLA_FLAGS="$CB --xla_dump_to=/tmp/dd" TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,traced_command_buffer=6 \
  timeout 90 $W --inner 5 --backends nvlink > /tmp/vlog.txt 2>&1
grep -E "Update command buffer|Updated [0-9]+ commands|trace cache|create new item|Record|evict" /tmp/vlog.txt | sed 's/^.*\] //' | sort | uniq -c | sort -rn | head -20
f=$(ls /tmp/dd/*jit_program*thunk_sequence_after_thunk_passes.txt | head -1); echo "thunks: $(grep -c . $f)"; head -12 $f
cp $f $OUT/thunks.txt; cp /tmp/vlog.txt $OUT/vlog.txt
