"""`benchmarks/bench.py`'s table: the best XLA variant per T and each NVLink backend's speed-up over it, as the
README's speed-up rows are made (on a recorded CSV and on made-up rows with known answers)."""

import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench  # noqa: E402


def test_best_xla_is_the_minimum_over_every_xla_backend_and_mode():
    rng = np.random.default_rng(7)
    tokens = [1, 8, 128]
    values = {(b, 2): {t: float(rng.uniform(5, 60)) for t in tokens}
              for b in ("nvlink", "nvlink-1proc", "xla", "xla-1proc", "xla-allgather", "xla-allgather-1proc")}
    values[("xla", 4)] = {1: 1.0}  # another rank count never competes
    lines = bench._speedups(values, tokens)
    best = {t: min(values[(b, 2)][t] for b in ("xla", "xla-1proc", "xla-allgather", "xla-allgather-1proc"))
            for t in tokens}
    got = {}
    for line in lines:
        fields = line.split()
        name = "best xla" if line.startswith("best xla") else fields[2]  # "speed-up of <backend>"
        got[(name, fields[-len(tokens) - 1])] = fields[-len(tokens):]
    assert got[("best xla", "2")] == [f"{best[t]:.1f}" for t in tokens]
    assert got[("best xla", "4")][0] == "1.0"
    for b in ("nvlink", "nvlink-1proc"):
        want = [f"{best[t] / values[(b, 2)][t]:.1f}x" for t in tokens]
        assert got[(b, "2")] == want, (b, got[(b, "2")], want)


def _table(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "table", *args],
                          capture_output=True, text=True, check=True).stdout


def _row(out, name, ranks="2"):
    return next(line for line in out.splitlines() if line.startswith(name) and line.split()[len(name.split())] == ranks)


def test_table_command_on_the_recorded_benchmark():
    """The README's speed-up rows (benchmark flags, any flags) and kernels / floor come out of the recorded CSV."""
    csv = os.path.join(ROOT, "benchmarks", "results", "bench_v15_2026-12-01.csv")
    readme = open(os.path.join(ROOT, "README.md")).read()
    bench_flags = _row(_table(csv, "--exclude", "collectives"), "speed-up of nvlink ").split()[-8:]
    assert bench_flags == ["5.9x", "4.7x", "5.7x", "4.8x", "5.6x", "4.5x", "4.6x", "3.4x"], bench_flags
    assert "| speed-up of `nvlink` over the best XLA variant (benchmark flags) | " + " | ".join(bench_flags) in readme
    everything = _table(csv)
    any_flags = _row(everything, "speed-up of nvlink ").split()[-8:]
    assert any_flags == ["3.7x", "4.0x", "3.8x", "4.8x", "5.3x", "4.5x", "4.2x", "3.4x"], any_flags
    assert "| speed-up of `nvlink` over the best XLA variant (any flags above) | " + " | ".join(any_flags) in readme
    ratio = _row(everything, "kernels / floor").split()[-8:]
    assert "| kernels only / floor | " + " | ".join(ratio) + " |" in readme


def test_table_reads_several_csvs_as_one():
    """`table A B C` prints what `table` prints for the rows of A, B and C in one file (bench_v14 is the three raw
    CSVs of its run put together)."""
    raw = os.path.join(ROOT, "benchmarks", "results", "raw", "gpu_bench_all_b2be505")
    parts = [os.path.join(raw, name) for name in ("bench.csv", "bench_xlacb.csv", "bench_buf128.csv")]
    joined = os.path.join(ROOT, "benchmarks", "results", "bench_v14_2026-12-01.csv")
    assert _table(*parts) == _table(joined)
    assert _table(*parts) != _table(parts[0])  # the XLA rows in command buffers change the best XLA variant


def test_floor_and_kernel_rows_in_the_table():
    """`floor_us` and `kernel_us_median` rows of the same CSV give the table's floor and kernels rows and the kernels'
    ratio to the floor per T (made-up values with known answers)."""
    rng = np.random.default_rng(11)
    tokens = [1, 5, 128]
    floor = {t: float(rng.uniform(2, 7)) for t in tokens}
    kernels = {t: float(rng.uniform(4, 12)) for t in tokens}
    rows = [("d", "dev", "c", "floor", "2", str(t), "floor_us", f"{floor[t]:.3f}") for t in tokens]
    rows += [("d", "dev", "c", "kernels", "2", str(t), "kernel_us_median", f"{kernels[t]:.2f}") for t in tokens]
    rows += [("d", "dev", "c", "nvlink", "2", str(t), "layer_us_median", "6.0") for t in tokens]
    rows += [("d", "dev", "c", "nvlink", "2", "1", "launches_per_layer", "3.00"),
             ("d", "dev", "c", "nvlink", "2", "1", "our_launches_per_layer", "2.00")]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        bench._print_table(rows)
    lines = buf.getvalue().splitlines()
    ratio = next(line for line in lines if line.startswith("kernels / floor")).split()[-3:]
    want = [f"{float(f'{kernels[t]:.2f}') / float(f'{floor[t]:.3f}'):.2f}x" for t in tokens]
    assert ratio == want, (ratio, want)
    assert next(line for line in lines if line.startswith("floor ")).split()[-3:] == [f"{floor[t]:.1f}" for t in tokens]
    head = lines.index(next(line for line in lines if line.startswith("launches per layer")))
    assert lines[head + 1].split()[-1] == "3.00" and lines[head + 2].split()[:2] == ["nvlink", "(ours)"]


def test_launch_counts_from_a_device_trace():
    """Per-layer launches count the stream lines' events only, and ours by the cubins' kernel names."""
    layers = 4
    events = []
    for _ in range(layers):
        events += [("Stream #24(Compute)", "ep_dispatch_0"), ("Stream #24(Compute)", "wrapped_convert"),
                   ("Stream #24(Compute)", "ep_combine_0")]
        events += [("XLA Ops", "custom-call.1"), ("XLA Ops", "convert.2")]  # derived lines: not launches
    events += [("Stream #30(MemcpyD2D)", "MemcpyD2D")]
    counts = bench.launch_counts(events, layers)
    assert counts["launches_per_layer"] == (3 * layers + 1) / layers
    assert counts["our_launches_per_layer"] == 2
    assert counts["by_name"]["wrapped_convert"] == 1 and counts["by_name"]["MemcpyD2D"] == 1 / layers


def test_all_runs_on_cpu(tmp_path):
    """`bench.py all` on this machine's CPU (the XLA backends; the floor and the kernels say why they are skipped):
    every backend and T gets its per-layer rows, with finite positive times."""
    out = tmp_path / "bench.csv"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "all", "--tokens", "1,3",
                           "--layers", "2", "--repeats", "2", "--inner", "2", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "floor: skipped" in proc.stdout and "kernels: skipped (no GPU)" in proc.stdout
    assert "nvlink: skipped (no GPU)" in proc.stdout
    import csv

    rows = list(csv.DictReader(open(out)))
    got = {(r["backend"], r["tokens"], r["metric"]): float(r["value"]) for r in rows}
    for backend in ("xla", "xla-allgather"):
        for t in ("1", "3"):
            for metric in ("layer_us_median", "enqueue_us_per_layer"):
                assert 0 < got[(backend, t, metric)] < 1e7, (backend, t, metric)
    assert {r["ranks"] for r in rows} == {"1"} and {r["device"] for r in rows} == {"cpu"}


def test_trace_launches_returns_the_program_output_and_counts_gpu_launches():
    """The program runs once and its output comes back; without GPUs the launch count is None (no GPU planes in
    the device trace), on a GPU it is the one fused kernel of this program, none of them ours."""
    import jax
    import jax.numpy as jnp

    fn = jax.jit(lambda x, y: x * 2 + y)
    x, counts = bench.trace_launches(fn, (jnp.arange(4.0), jnp.ones(4)), layers=1)
    if jax.devices()[0].platform == "gpu":
        assert counts is not None and counts["launches_per_layer"] == 1.0, counts
        assert counts["our_launches_per_layer"] == 0.0, counts
    else:
        assert counts is None
    np.testing.assert_array_equal(np.asarray(x), np.arange(4.0) * 2 + 1)


def test_markdown_tables_carry_the_same_cells():
    """`table --markdown` renders the fixed-width table's rows as markdown, cell for cell (empty for a missing T)."""
    rows = [("d", "dev", "c", "floor", "2", str(t), "floor_us", v) for t, v in ((1, "2.43"), (8, "2.64"))]
    rows += [("d", "dev", "c", "kernels", "2", "1", "kernel_us_median", "5.02")]
    rows += [("d", "dev", "c", b, "2", str(t), "layer_us_median", v)
             for b, t, v in (("nvlink", 1, "6.3"), ("nvlink", 8, "6.7"), ("xla", 1, "31.5"), ("xla", 8, "40.2"))]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        bench._print_table(rows, markdown=True)
    md = buf.getvalue().splitlines()
    assert md[0] == "| backend (N = 2) | T=1 | T=8 |"
    assert "| kernels only | 5.0 |  |" in md
    assert "| speed-up of nvlink | 5.0x | 6.0x |" in md
    assert f"| kernels / floor | {5.02 / 2.43:.2f}x |  |" in md


def test_kernel_buffers_follow_the_layer_benchmark():
    """The kernels alone are timed with the buffer the jitted layer of the same T gets (`--max-tokens`)."""
    import argparse

    tokens = [1, 2, 8, 16, 128]
    per_t = bench._kernel_buffers(argparse.Namespace(tokens=tokens, max_tokens=-1))
    assert per_t == {t: [t] for t in tokens}
    assert bench._kernel_buffers(argparse.Namespace(tokens=tokens, max_tokens=0)) == {128: tokens}
    assert bench._kernel_buffers(argparse.Namespace(tokens=tokens, max_tokens=256)) == {256: tokens}
