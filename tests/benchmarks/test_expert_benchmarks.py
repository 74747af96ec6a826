"""The expert-stage and K3-layer benchmark scripts run end to end on tiny shapes (`--smoke`) and write their CSV."""

import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLUMNS = ["date", "device", "commit", "backend", "ranks", "tokens", "metric", "value"]


@pytest.mark.parametrize("script,must", [
    ("expert_stage.py", {"us_per_layer", "ratio", "active_experts", "us", "GBps"}),
    ("fp8_matmul.py", {"wall_us", "pipelined_us", "floor_us", "floor_spec_us", "active_experts", "best_GBps"}),
    ("k3_layer.py", {"layer_us", "layer_pipelined_us", "experts_us", "comm_us", "rest_us", "floor_us", "ratio",
                     "ratio_spec", "active_experts", "hbm_GBps"}),
    ("layer_buckets.py", {"us_per_layer", "us_per_layer_b2b", "ratio", "ratio_b2b"}),
    ("mxfp8_error.py", {"rel_l2_layer_vs_bf16", "rel_l2_model_mxfp8_vs_bf16"}),
    ("stage_memory.py", {"capacity_pairs", "weights_GB", "fwd_temp_GB", "grad_temp_GB"}),
    ("training.py", {"pairs", "layers", "fwd_ms", "fwd_bwd_ms", "fwd_of_plain", "fwd_bwd_of_plain",
                     "fwd_bwd_temp_GB"}),
])
def test_smoke(tmp_path, script, must):
    out = tmp_path / "out.csv"
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(out) as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == COLUMNS
    assert must <= {r[6] for r in rows[1:]}, proc.stdout
    assert all(float(r[7]) == float(r[7]) for r in rows[1:])  # numbers, no NaN


def test_stage_units_are_set_and_recorded(tmp_path):
    """`--stage-units GATE DOWN` sets the one launch's split targets, `--narrow-units` the FP8 kernels',
    `--tile-headroom` the FP8 stage's tile rule and `--xla-row-sum-slots` where the one launch's
    row sum is XLA's in the child and records them as rows; a non-positive target or a negative count is refused
    before anything runs."""
    out = tmp_path / "out.csv"
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
    script = os.path.join(ROOT, "benchmarks", "expert_stage.py")
    proc = subprocess.run([sys.executable, script, "--smoke", "--paths", "dense", "--stage-units", "1536", "1024",
                           "--xla-row-sum-slots", "0", "--narrow-units", "1", "--tile-headroom", "3",
                           "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(out) as fh:
        rows = list(csv.reader(fh))
    units = {r[3]: float(r[7]) for r in rows if r[3].startswith("kernel_stage_")}
    assert units == {"kernel_stage_gate_units": 1536.0, "kernel_stage_down_units": 1024.0}
    assert [float(r[7]) for r in rows if r[3] == "xla_row_sum_slots"] == [0.0]
    assert [float(r[7]) for r in rows if r[3] == "narrow_min_units"] == [1.0]
    assert [float(r[7]) for r in rows if r[3] == "tile_headroom"] == [3.0]
    for flag in (["--stage-units", "0", "1024"], ["--xla-row-sum-slots", "-1"], ["--narrow-units", "-1"],
                 ["--tile-headroom", "0"]):
        bad = subprocess.run([sys.executable, script, "--smoke", *flag, "--out", str(out)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and flag[0] in bad.stderr


def test_training_layers_fit_the_weights_budget():
    """`training.fit_layers`: the weights and their gradients (bf16) of the program's layers within the budget, at
    least one layer, at most the asked: K3 at N = 2 (2 x 19.7 GB a layer) takes one in 40 GiB, K3 at N = 8 four."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import training

    assert training.fit_layers("k3n2", 4, 40.0) == 1
    assert training.fit_layers("k3n2", 4, 1.0) == 1
    assert training.fit_layers("k3", 4, 40.0) == 4
    assert training.fit_layers("k3", 2, 40.0) == 2
    per_layer = 2 * 3 * 112 * 3584 * 2048 * 2
    assert training.fit_layers("k3", 8, 3 * per_layer / 2**30) == 3
