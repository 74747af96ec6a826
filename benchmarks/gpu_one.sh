# One H200: correctness of this tree's kernels (virtual ranks) and N = 1 kernel latency of three trees (old: .carry/old,
# early: .carry/early, new: this tree).   NEW_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu_one.sh
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
H="python3 -m jax_latent_ep.testing.harness"
NEW=$PWD; mkdir -p $OUT/one
( export PYTHONPATH=$NEW
for args in "--ranks 1 --max-tokens 128 --layers 200" "--ranks 2 --max-tokens 128 --layers 300" "--ranks 4 --max-tokens 32 --layers 200" "--ranks 8 --max-tokens 16 --layers 200" "--shape deepseek_v3 --ranks 4 --max-tokens 16 --layers 100"; do
  timeout 120 $H --mode virtual $args --csv $OUT/one/check.csv --commit ${NEW_COMMIT:-unknown} 2>&1 | grep -E -- "->|rror" | cut -c1-120
done
for c in dispatch_twice combine_twice; do timeout 60 $H --mode sequence --sequence-case $c --csv $OUT/one/sequence.csv --commit ${NEW_COMMIT:-unknown} 2>&1 | tail -1; done )
for round in 1 2; do for side in old early new; do
  case $side in old) d=$NEW/.carry/old; c=4f558c5;; early) d=$NEW/.carry/early; c=fc18f1b;; new) d=$NEW; c=${NEW_COMMIT:-unknown};; esac
  for mt in 8 128; do
    echo "-- $side ($c) N=1 max_tokens $mt round $round"
    (cd $d && PYTHONPATH=$d timeout 60 $H --mode latency --ranks 1 --max-tokens $mt --tag=-$side-max$mt-r$round --csv $OUT/one/latency.csv --commit $c 2>&1 | grep -E "T=|rror")
  done
done; done
