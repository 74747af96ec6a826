# Session 15, one H200: out-of-range ids in the kernels (expert_rank_bit) and the FFI registry's shared ranks.
# old = .carry/old_art (5b61e8c's artifacts), new = jax_latent_ep/_artifacts (this tree).   GIT_COMMIT=<sha>
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
H="python3 -m jax_latent_ep.testing.harness"; NEW=jax_latent_ep/_artifacts; OLD=.carry/old_art; C=${GIT_COMMIT:-unknown}
mkdir -p $OUT/r
{
echo "== SASS instructions (cuobjdump -sass), old -> new"
for k in dispatch combine; do for n in 1 2 4 8; do f=${k}_kimi_k3_n${n}_sm_90a.cubin
  a=$(cuobjdump -sass $OLD/cubins/$f | grep -c -E '^\s+/\*[0-9a-f]{4}\*/'); b=$(cuobjdump -sass $NEW/cubins/$f | grep -c -E '^\s+/\*[0-9a-f]{4}\*/')
  echo "$f: $a -> $b"; done; done
for side in old new; do art=$OLD; [ $side = new ] && art=$NEW
  for args in "--ranks 1 --max-tokens 128 --layers 100" "--ranks 2 --max-tokens 128 --layers 200" "--ranks 2 --max-tokens 8 --layers 200" "--ranks 4 --max-tokens 32 --layers 100" "--ranks 8 --max-tokens 16 --layers 100"; do
    echo "== $side bad-ids virtual $args"; timeout 120 $H --mode virtual $args --bad-ids --artifacts $art --csv $OUT/r/check_badids_$side.csv --commit $C 2>&1 | grep -E -- "->|rror|mismatch" | head -4 | cut -c1-200
  done
done
for args in "--ranks 2 --max-tokens 128 --layers 300" "--ranks 4 --max-tokens 32 --layers 200" "--shape deepseek_v3 --ranks 4 --max-tokens 16 --layers 100"; do
  echo "== new virtual $args"; timeout 120 $H --mode virtual $args --artifacts $NEW --csv $OUT/r/check_new.csv --commit $C 2>&1 | grep -E -- "->|rror" | cut -c1-160
done
for c in dispatch_twice combine_twice; do echo "== sequence $c"; timeout 60 $H --mode sequence --sequence-case $c --artifacts $NEW 2>&1 | tail -1; done
echo "== old artifacts: test_reference out_of_range"; JAX_LATENT_EP_ARTIFACTS=$PWD/$OLD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_reference.py -k "out_of_range and nvlink" 2>&1 | tail -4
echo "== latency A/B (kernels alone; N=1 and two virtual ranks), 2 rounds"
for round in 1 2; do for side in old new; do art=$OLD; [ $side = new ] && art=$NEW
  for mt in 8 128; do
    timeout 100 $H --mode latency --ranks 1 --max-tokens $mt --artifacts $art --tag=-$side-r$round-max$mt --csv $OUT/r/lat.csv --commit $C 2>&1 | grep -E "T=|rror" | awk -v s="$side r$round n1 mt$mt" '{print s": "$0}'
    timeout 100 $H --mode latency --ranks 2 --latency-virtual --max-tokens $mt --artifacts $art --tag=-$side-r$round-max$mt-virtual --csv $OUT/r/lat.csv --commit $C 2>&1 | grep -E "T=|rror" | awk -v s="$side r$round n2v mt$mt" '{print s": "$0}'
  done; done; done
echo "== GPU suite, new artifacts"; timeout 300 python3 -m pytest -q -m gpu tests -rs -p no:cacheprovider 2>&1 | tail -25
} 2>&1 | tee $OUT/r/two.txt
