# The preamble the device scripts share (sourced by gpu_guard.sh, gpu_iter.sh, gpu_final.sh, run from the repo
# root): $OUT (results that come back), $W (scratch), the environment, the commit flag $C of CSV rows, the
# harness command $H, `log` (a timestamped stage line), `has STAGE` (STAGE is named in $stages) and
# `harness_check` (the harness's correctness runs).
set -u
OUT="${OUT:-$PWD/out}"; W=/tmp/w; rm -rf $W; mkdir -p $W "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
C="--commit ${GIT_COMMIT:-unknown}"
H="python3 -m jax_latent_ep.testing.harness"
log() { echo "=== $(date +%T) $*"; }
has() { [[ " $stages " == *" $1 "* ]]; }

# harness_check CSV [HARNESS ARGS...]: the harness's correctness runs, rows into CSV: N = 1 and 8 virtual ranks on
# GPU 0, N = 4 and DeepSeek-V3 at N = 4 on GPU 1 (in parallel), then N = 2 on two GPUs (DEVICE_MAX_TOKENS, default
# 128; CHECK_LAYERS layers, default 300). Prints each run's verdict line.
harness_check() {
  local csv=$1; shift
  ( CUDA_VISIBLE_DEVICES=0 $H "$@" --mode virtual --ranks 1 --max-tokens 128 --layers 200 --csv $csv $C &&
    CUDA_VISIBLE_DEVICES=0 $H "$@" --mode virtual --ranks 8 --max-tokens 16 --layers 200 --csv $csv $C ) > $W/h0.log 2>&1 &
  local p0=$!
  ( CUDA_VISIBLE_DEVICES=1 $H "$@" --mode virtual --ranks 4 --max-tokens 32 --layers 200 --csv $csv $C &&
    CUDA_VISIBLE_DEVICES=1 $H "$@" --shape deepseek_v3 --mode virtual --ranks 4 --max-tokens 16 --layers 100 \
      --csv $csv $C ) > $W/h1.log 2>&1 &
  local p1=$!
  wait $p0; echo "virtual (GPU 0) rc=$?"; wait $p1; echo "virtual (GPU 1) rc=$?"
  grep -E -- "->|Error" $W/h0.log $W/h1.log | cut -c1-150
  timeout 120 $H "$@" --mode devices --ranks 2 --max-tokens ${DEVICE_MAX_TOKENS:-128} --layers ${CHECK_LAYERS:-300} \
    --csv $csv $C > $W/h2.log 2>&1
  echo "devices rc=$?"; grep -E -- "->|Error" $W/h2.log | cut -c1-150
}
