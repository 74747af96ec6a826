"""The expert-stage and K3-layer benchmark scripts run end to end on tiny shapes (`--smoke`) and write their CSV."""

import csv
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLUMNS = ["date", "device", "commit", "backend", "ranks", "tokens", "metric", "value"]


@pytest.mark.parametrize("script,must", [
    ("expert_stage.py", {"us_per_layer", "ratio", "active_experts", "us", "GBps"}),
    ("dense_projections.py", {"us_per_layer", "pipelined_us_per_layer", "floor_us", "floor_spec_us", "ratio",
                              "hbm_GBps"}),
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
    if script == "training.py":  # the FP8 prefill forward and its FP8 GEMM reference (`--fp8`)
        assert {"training/tiny/fp8/plain", "training/tiny/fp8/gmm"} <= {r[3] for r in rows[1:]}, proc.stdout
    if script == "k3_layer.py":  # the layer's costliest instructions, each printed with its operations' lines
        assert any(r[6].startswith("op_us:") for r in rows[1:]), proc.stdout
        assert re.search(r"us  x[\d.]+  \w+@\w+\.py:\d+", proc.stdout), proc.stdout


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


def test_stage_child_past_its_bound_is_reported_and_its_csv_written(tmp_path):
    """A measuring child that passes `--child-timeout` is killed and named in a FAIL line; the CSV is still written
    (each row goes to disk as it comes), and the run exits non-zero."""
    out = tmp_path / "out.csv"
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "expert_stage.py"), "--smoke",
                           "--child-timeout", "1", "--out", str(out)],  # jax alone takes longer to import
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAIL group default (rc -9): timed out after 1 s" in proc.stdout
    with open(out) as fh:
        assert next(csv.reader(fh)) == COLUMNS


def test_back_to_back_samples_span_the_steady_state(monkeypatch):
    """`expert_stage._time_pipelined`: without `calls`, a sample spans `PIPELINED_SECONDS` of calls, 8 to 64 (one
    call first to size it); the host's share is at most the whole."""
    import time

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import expert_stage
    import jax.numpy as jnp

    (jnp.ones(4) + 1).block_until_ready()  # warm, as the benchmark's programs are
    # Each span is far from the clamp it tests, so a loaded machine's slow first call cannot move it.
    for seconds, pause, calls in ((1e3, 0.0, 64), (0.04, 0.02, 8)):
        monkeypatch.setattr(expert_stage, "PIPELINED_SECONDS", seconds)
        count = []

        def fn(x, pause=pause, count=count):
            count.append(1)
            time.sleep(pause)
            return x + 1

        b2b, host = expert_stage._time_pipelined(fn, (jnp.ones(4),), repeats=2)
        assert len(count) == 1 + 2 * calls
        assert 0 < host <= b2b and b2b >= pause


def test_stage_layers_fit_each_formats_weights():
    """`expert_stage.format_layers`: each weight format gets the layers its own bytes fit (K3 J 448 / I 2048: 19.7 GB
    a layer in bf16, 9.9 in FP8, 5.2 in MXFP4), at least one, at most the asked; paths grouped by format."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import expert_stage

    paths = ["kernel", "wgmma-fp8", "wgmma-mxfp4", "dense"]
    got = expert_stage.format_layers(paths, 448, 3584, 2048, 12, 120.0)
    assert got == {"bf16": (["kernel", "dense"], 6), "fp8-out-in": (["wgmma-fp8"], 12), "mxfp4": (["wgmma-mxfp4"], 12)}
    got = expert_stage.format_layers(paths, 448, 3584, 2048, 12, 40.0)
    assert {f: n for f, (_, n) in got.items()} == {"bf16": 2, "fp8-out-in": 4, "mxfp4": 8}
    assert {f: n for f, (_, n) in expert_stage.format_layers(paths, 448, 3584, 2048, 12, 1.0).items()} == {
        "bf16": 1, "fp8-out-in": 1, "mxfp4": 1}


def test_layer_weights_need_no_temporary_beyond_their_bytes():
    """`expert_stage._layer_weights` makes each format's weights one expert at a time: the program's temporaries stay
    within the weights' own bytes (1.25x for XLA's loop buffers), where drawing MXFP4's uint8 codes for every expert
    at once took 32-bit words, 10x (an H100 ran out of memory at K3's J = 448)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import expert_stage
    import jax

    for fmt in ("bf16", "fp8-out-in", "mxfp4"):
        make = lambda key, fmt=fmt: expert_stage._layer_weights(key, 16, 256, 512, fmt)  # noqa: E731
        key = jax.random.key(0)
        temp = jax.jit(make).lower(key).compile().memory_analysis().temp_size_in_bytes
        out = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(jax.eval_shape(make, key)))
        assert temp <= 1.25 * out, (fmt, temp, out)


@pytest.mark.filterwarnings("ignore:builtin type event_stats:DeprecationWarning")  # the profiler's C++ type
def test_profile_names_each_instruction_and_its_source_lines():
    """`event_ops` sums a trace's events by the HLO instruction each ran and `op_sources` names that instruction's
    JAX operations with the lines that traced them: on XLA:CPU the host plane's events carry the same `hlo_op`
    statistic as the GPU's kernels. A slice, a conversion and an add fused into one instruction name their lines."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import glob
    import tempfile

    import expert_stage
    import jax
    import jax.numpy as jnp

    def layer(x, w):
        y = jnp.tanh(x @ w)
        return y[:, :8].astype(jnp.bfloat16) + 1  # the fused tail: slice, convert, add

    first = layer.__code__.co_firstlineno
    fn = jax.jit(layer)
    args = (jax.random.normal(jax.random.key(1), (4, 64)), jax.random.normal(jax.random.key(2), (64, 32)))
    jax.block_until_ready(fn(*args))
    sources = expert_stage.op_sources(fn.lower(*args).compile().as_text())
    tail = [v for v in sources.values() if "slice@" in v]
    assert len(tail) == 1 and f"slice@test_expert_benchmarks.py:{first + 2}" in tail[0], sources
    assert f"convert_element_type@test_expert_benchmarks.py:{first + 2}" in tail[0]
    assert any(f"dot_general@test_expert_benchmarks.py:{first + 1}" in v for v in sources.values()), sources
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
        events = [e for p in jax.profiler.ProfileData.from_file(path).planes if p.name.startswith("/host:CPU")
                  for line in p.lines for e in line.events if any(k == "hlo_op" for k, _ in e.stats)]
    ops = expert_stage.event_ops(events)
    assert ops and set(ops) <= set(sources), (ops, sources)
    assert all(us >= 0 for us in ops.values())


def test_op_sources_name_ffi_targets_and_source_lines():
    """A custom call is named by its FFI target; metadata with a source file and line but no stack frame still
    gives the line; a fusion lists its computation's operations, each once."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import expert_stage

    hlo = "\n".join([
        "%fused_add (p0: f32[4]) -> f32[4] {",
        '  %p0 = f32[4]{0} parameter(0), metadata={op_name="jit(f)/add" source_file="/x/k3_layer.py" source_line=7}',
        '  ROOT %add.1 = f32[4]{0} add(%p0, %p0), metadata={op_name="jit(f)/add" source_file="/x/k3_layer.py" '
        'source_line=7}',
        "}",
        "",
        "ENTRY %main (a: f32[4]) -> f32[4] {",
        "  %a = f32[4]{0} parameter(0)",
        '  %custom-call.3 = f32[4]{0} custom-call(%a), custom_call_target="jax_latent_ep_expert_plan_rec", '
        'metadata={op_name="jit(f)/ffi_call" source_file="/y/ffi.py" source_line=504}',
        "  ROOT %fusion.2 = f32[4]{0} fusion(%custom-call.3), kind=kLoop, calls=%fused_add",
        "}",
        "",
    ])
    sources = expert_stage.op_sources(hlo)
    assert sources["custom-call.3"] == "jax_latent_ep_expert_plan_rec:ffi_call@ffi.py:504", sources
    assert sources["fusion.2"] == "add@k3_layer.py:7", sources


def test_stage_table_reads_runs_and_scales_to_the_spec(tmp_path):
    """`stage_table.py`: each cell is GPU / back to back / wall over the run's floor, and over the GPU's HBM spec
    (the same times over a faster stream: larger by spec / floor_GBps); a later run's point replaces an earlier's;
    a run without its floor or of an unknown GPU is refused."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import stage_table

    def run(path, device, floor, points):
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(COLUMNS)
            if floor:
                w.writerow(["2026-12-06", device, "c0", "floor_GBps", 1, 0, "GBps", floor])
            for backend, t, ratios in points:
                for metric, v in zip(stage_table.RATIOS, ratios):
                    w.writerow(["2026-12-06", device, path.stem, backend, 2, t, metric, v])
        return str(path)

    a = run(tmp_path / "a.csv", "NVIDIA H200", 4000.0, [("kernel/J448/I512", 1, (1.2, 1.5, 2.0)),
                                                        ("wgmma-fp8/J448/I512", 8, (1.1, 1.2, 1.3))])
    b = run(tmp_path / "b.csv", "NVIDIA H200", 4000.0, [("wgmma-fp8/J448/I512", 8, (1.05, 1.15, 1.25))])
    table = stage_table.cells([stage_table.read_run(a), stage_table.read_run(b)])
    assert table[("J448/I512", "bf16", 1)][0] == (1.2, 1.5, 2.0)
    assert table[("J448/I512", "FP8", 8)][0] == (1.05, 1.15, 1.25) and table[("J448/I512", "FP8", 8)][2] == "b"
    np_spec = [v * 4800.0 / 4000.0 for v in (1.2, 1.5, 2.0)]
    assert all(abs(x - y) < 1e-12 for x, y in zip(table[("J448/I512", "bf16", 1)][1], np_spec))
    text = stage_table.markdown(table)
    assert "| 448 / 512 | bf16 | 1.20 / 1.50 / 2.00 | - |" in text
    assert "| 448 / 512 | FP8 | - | 1.05 / 1.15 / 1.25 |" in text
    assert "1.44 / 1.80 / 2.40" in text  # over 4.8 TB/s
    with pytest.raises(SystemExit, match="floor_GBps"):
        stage_table.cells([stage_table.read_run(run(tmp_path / "c.csv", "NVIDIA H200", None, []))])
    with pytest.raises(SystemExit, match="no HBM spec"):
        stage_table.cells([stage_table.read_run(run(tmp_path / "d.csv", "MI300X", 4000.0,
                                                    [("kernel/J448/I512", 1, (1.2, 1.5, 2.0))]))])
