export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
W="python3 benchmarks/bench.py worker --ranks 1 --backends nvlink --layers 4 --repeats 2 --inner 1 --max-tokens -1"
for flags in "" "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" "--xla_gpu_enable_command_buffer="; do
  for t in 8 4 16; do
    echo "## flags=[$flags] T=$t: $(XLA_FLAGS="$flags" timeout 60 $W --tokens $t 2>&1 | grep -E "RESULT|JaxRuntimeError" | head -1 | cut -c1-200)"
  done
done
rm -rf /tmp/d8; XLA_FLAGS="--xla_dump_to=/tmp/d8 --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" timeout 60 $W --tokens 8 > /dev/null 2>&1
tar czf $OUT/d8.tgz -C /tmp/d8 $(cd /tmp/d8 && ls | grep -E "jit_program.*(after_optimizations.txt|thunk_sequence)" )
