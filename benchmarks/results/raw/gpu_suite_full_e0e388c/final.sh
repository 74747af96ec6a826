# Session 15, one H200, the final tree: the stress harness on two virtual ranks, then the whole test suite on the GPU
# machine (CPU-marked tests run with JAX's GPU platform there).   GIT_COMMIT=<sha> OUT=<dir>
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
H="python3 -m jax_latent_ep.testing.harness"; mkdir -p $OUT/f
{ python3 -m jax_latent_ep.build --check-installed --out jax_latent_ep/_artifacts 2>&1 | tail -1
echo "== stress, two virtual ranks, random T <= 128, delayed rank"; timeout 200 $H --mode stress --stress-virtual --ranks 2 --max-tokens 128 --layers 20000 --csv $OUT/f/stress.csv --commit ${GIT_COMMIT:-unknown} 2>&1 | tail -4
echo "== whole suite"; timeout 350 python3 -m pytest -q tests -rs -p no:cacheprovider 2>&1 | tail -30; } 2>&1 | tee $OUT/f/final.txt
