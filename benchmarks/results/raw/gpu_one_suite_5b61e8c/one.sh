# One H200, session 15: the shipped kernels of HEAD on one GPU (virtual-rank correctness, sequence/timeout guards,
# the GPU test suite).   GIT_COMMIT=<sha> bash .carry/one.sh
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
H="python3 -m jax_latent_ep.testing.harness"
mkdir -p $OUT/one
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import jax,jaxlib;print('jax',jax.__version__)"
python3 -m jax_latent_ep.build --check-installed --out jax_latent_ep/_artifacts 2>&1 | tail -2
for args in "--ranks 1 --max-tokens 128 --layers 200" "--ranks 2 --max-tokens 128 --layers 300" "--ranks 2 --max-tokens 8 --layers 300" "--ranks 4 --max-tokens 32 --layers 200" "--ranks 8 --max-tokens 16 --layers 200" "--shape deepseek_v3 --ranks 4 --max-tokens 16 --layers 100"; do
  echo "== virtual $args"; timeout 120 $H --mode virtual $args --csv $OUT/one/check.csv --commit ${GIT_COMMIT:-unknown} 2>&1 | grep -E -- "->|rror" | cut -c1-160
done
for c in dispatch_twice combine_twice; do echo "== sequence $c"; timeout 60 $H --mode sequence --sequence-case $c --csv $OUT/one/sequence.csv --commit ${GIT_COMMIT:-unknown} 2>&1 | tail -1; done
echo "== GPU suite"; timeout 400 python3 -m pytest -q -m gpu tests -rs -p no:cacheprovider 2>&1 | tail -40; } 2>&1 | tee $OUT/one/suite.txt
