export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
export XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
timeout 120 python3 benchmarks/bench.py worker --ranks 2 --backends nvlink --tokens 1,8 --layers 8 --repeats 3 --max-tokens -1 > $OUT/w1.log 2>&1; echo "rc=$?" >> $OUT/w1.log
grep -v "^\s*$" $OUT/w1.log | grep -iv "warning" | head -60
timeout 300 python3 -m pytest -q -m gpu tests/test_nvlink_gpu.py tests/test_kernels_gpu.py tests/test_reference.py tests/test_api.py 2>&1 | tail -15
