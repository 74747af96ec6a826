export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout 200 python3 benchmarks/bench.py all --only-ranks 1 --backends nvlink --tokens 1,2 --layers 8 --repeats 2 --inner 2 --max-tokens -1 --out $OUT/b.csv > /dev/null 2>&1
for f in $OUT/b.N*.log; do echo "## $f"; grep -v "^\s*$" $f | grep -v "Source Location\|cuda_status.cc\|Failed to unload\|^\[" | head -40; done
