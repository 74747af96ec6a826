export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
H="python3 -m jax_latent_ep.testing.harness --mode latency --ranks 2 --max-tokens 8 --trace --csv $OUT/drain.csv --commit f396ad3"
for v in tracew2 tracew2_drain tracew2 tracew2_drain; do echo "== $v"; JAX_LATENT_EP_KERNEL_TRACE=2 timeout 60 $H --artifacts .carry/$v --tag=-$v 2>&1 | grep -v "^note"; done > $OUT/drain.txt 2>&1
grep -E "==|T=|rank |  1[0-3] |warp trace|combine wait" $OUT/drain.txt | cut -c1-150
