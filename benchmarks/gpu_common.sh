# The preamble the device scripts share (sourced by gpu_guard.sh, gpu_iter.sh, gpu_final.sh, run from the repo
# root): $OUT (results that come back), $W (scratch), the environment, the commit flag $C of CSV rows, the
# harness command $H, `log` (a timestamped stage line) and `has STAGE` (STAGE is named in $stages).
set -u
OUT="${OUT:-$PWD/out}"; W=/tmp/w; rm -rf $W; mkdir -p $W "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
C="--commit ${GIT_COMMIT:-unknown}"
H="python3 -m jax_latent_ep.testing.harness"
log() { echo "=== $(date +%T) $*"; }
has() { [[ " $stages " == *" $1 "* ]]; }
