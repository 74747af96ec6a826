#!/usr/bin/env bash
# One device call: the 1000-layer NVLink-vs-XLA checks in both process modes, then the per-layer benchmark.
set -u
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "=== $(date +%T) nvlink 1000 layers, one process"
timeout 150 python3 benchmarks/nvlink_layers.py --procs 1 --layers 1000 --csv $OUT/results.csv 2>&1 | tail -4
echo "=== $(date +%T) nvlink 1000 layers, two processes"
timeout 150 python3 benchmarks/nvlink_layers.py --procs 2 --layers 1000 --csv $OUT/results.csv 2>&1 | tail -6
echo "=== $(date +%T) bench"
python3 benchmarks/bench.py all --repeats ${REPEATS:-10} --out $OUT/bench.csv
echo "=== $(date +%T) done"
