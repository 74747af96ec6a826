S=${S:-unknown}
source benchmarks/gpu_common.sh
H="python3 -m jax_latent_ep.testing.harness"
L="$H --mode latency --ranks 2 --max-tokens 128 --latency-tokens 1 5 8 16 32 64 128 --csv $OUT/ab.csv $C"
{
log "A/B kernels alone, N = 2: shipped (b2be505), late trigger from T >= 64 (new), from T >= 32, always late"
for r in 1 2; do
  for v in shipped new pdl32 latepdl; do
    a="--artifacts .carry/$v"; [ $v = new ] && a=""
    echo "== $v run $r"; timeout 100 $L $a --tag=-$v-r$r 2>&1 | grep -E "T=|rror" | cut -c1-60
  done
done
log "correctness of the new kernels"
harness_check $OUT/check.csv
timeout 100 $H --mode stress --ranks 2 --layers 30000 --max-tokens 128 --stress-log-every 10000 --csv $OUT/check.csv $C 2>&1 | tail -3
log "jitted nvlink layer, N = 2, new then shipped then new"
for v in new shipped new2; do
  e=""; [ $v = shipped ] && e="JAX_LATENT_EP_ARTIFACTS=$PWD/.carry/shipped"
  env $e GIT_COMMIT=$S timeout 150 python3 benchmarks/bench.py all --stages layers --backends nvlink --layers 32 --repeats 10 \
    --max-tokens -1 --only-ranks 2 --count-tokens none --xla-flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP \
    --tag=-$v --out $OUT/jit.csv 2>&1 | grep -E "^nvlink"
done
log done
} 2>&1 | tee $OUT/summary.txt
