export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
H="python3 -m jax_latent_ep.testing.harness"
{ for c in dispatch combine; do echo "== timeout $c"; timeout 60 $H --mode timeout --timeout-case $c --ranks 2 2>&1 | tail -2; done
for c in dispatch_twice combine_twice; do echo "== sequence $c"; timeout 60 $H --mode sequence --sequence-case $c --ranks 2 2>&1 | tail -2; done
echo "== GPU suite"; timeout 400 python3 -m pytest -q -m gpu tests/test_nvlink_gpu.py tests/test_kernels_gpu.py tests/test_moe.py   tests/test_notebook.py tests/test_api.py tests/test_reference.py -rs 2>&1 | tail -45; } 2>&1 | tee $OUT/suite.txt
