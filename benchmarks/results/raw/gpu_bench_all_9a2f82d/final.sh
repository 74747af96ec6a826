source benchmarks/gpu_common.sh
{ log "stress: N = 2 on two GPUs, max_tokens 128 (random T per layer), one rank delayed at random"
timeout 125 python3 -m jax_latent_ep.testing.harness --mode stress --ranks 2 --layers 30000 --max-tokens 128   --stress-log-every 10000 --csv $OUT/stress.csv --commit 9a2f82dd22a4f2b13010ec48184500c9a46fb98b 2>&1 | tail -4; } 2>&1 | tee $OUT/stress.txt
GIT_COMMIT=9a2f82dd22a4f2b13010ec48184500c9a46fb98b OUT=$OUT bash benchmarks/gpu_table.sh
