#!/usr/bin/env bash
# Kernel-only latency (the harness, N = 1 and 2, buffers of 8 and 128) of several builds, alternated ROUNDS times in
# one device call: rows into $OUT/lat.csv tagged -<side>-r<round>-max<mt>, one line per T in the output.
#   OUT=<dir> [ROUNDS=2] SIDES="name=tree_dir:artifacts_dir:commit ..." bash benchmarks/gpu_lat_variants.sh
# (a tree with another buffer layout runs from its own directory, with its own package).
H="python3 -m jax_latent_ep.testing.harness"; export PYTHONUNBUFFERED=1
for round in $(seq ${ROUNDS:-2}); do for spec in $SIDES; do for mt in 8 128; do
  side=${spec%%=*}; rest=${spec#*=}; dir=${rest%%:*}; rest=${rest#*:}; art=${rest%%:*}; c=${rest#*:}
  (cd $dir && PYTHONPATH=$dir timeout 100 $H --mode latency --ranks 1 2 --max-tokens $mt --artifacts $art \
    --tag=-$side-r$round-max$mt --csv $OUT/lat.csv --commit $c 2>&1 | grep -E "T=|rror" \
    | awk -v s="$side r$round mt$mt" '{print s": "$0}' | sed 's/ per dispatch + combine//')
done; done; done
