"""`benchmarks/bench.py`, the parts that run without a GPU: the table (the best XLA variant per T, each NVLink
backend's speed-up over it, the kernels over the floor) on the recorded run and on made-up rows with known answers,
the suites' passes and steps, the floor rows, the plot, publishing a run, and the recorded CSVs' form."""

import argparse
import contextlib
import csv
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks", "bench.py")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
LATEST = os.path.join(RESULTS, "latest.csv")
HISTORY = os.path.join(RESULTS, "history.csv")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench  # noqa: E402


def _cli(*args, check=True):
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, check=check)


def _table(*args):
    return _cli("table", *args).stdout


def _row(out, name, ranks="2"):
    return next(line for line in out.splitlines() if line.startswith(name) and line.split()[len(name.split())] == ranks)


def _printed(fn, *args, **kwargs):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args, **kwargs)
    return buf.getvalue().splitlines()


def _write(path, rows, columns=bench.COLUMNS):
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([columns] + [tuple(r) for r in rows])


# --- the table ------------------------------------------------------------------------------------------------


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


def test_table_of_latest_csv_is_the_readme_table():
    """The README's speed-up rows (benchmark flags, any flags) and kernels / floor come out of results/latest.csv,
    which `table` reads by default."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    bench_flags = _row(_table(LATEST, "--exclude", "collectives"), "speed-up of nvlink ").split()[-8:]
    assert bench_flags == ["5.9x", "4.7x", "5.7x", "4.8x", "5.6x", "4.5x", "4.6x", "3.4x"], bench_flags
    everything = _table()
    assert everything == _table(LATEST)
    any_flags = _row(everything, "speed-up of nvlink ").split()[-8:]
    assert any_flags == ["3.7x", "4.0x", "3.8x", "4.8x", "5.3x", "4.5x", "4.2x", "3.4x"], any_flags
    ratio = _row(everything, "kernels / floor").split()[-8:]
    assert ratio == ["1.97x", "1.96x", "1.90x", "1.90x", "1.87x", "1.85x", "1.81x", "1.72x"], ratio
    assert " | ".join(any_flags) in readme, any_flags  # the README's speed-up row (best XLA with any flags)


def test_table_reads_several_csvs_as_one(tmp_path):
    """`table A B C` prints what `table` prints for the rows of A, B and C in one file (latest.csv split as the
    readme suite's three passes write it)."""
    rows = bench.read_rows(LATEST)
    parts = {"cmdbuf": [r for r in rows if r[3].endswith("-collectives-cmdbuf")],
             "buf128": [r for r in rows if r[3].endswith("-buf128")]}
    parts["main"] = [r for r in rows if r not in parts["cmdbuf"] and r not in parts["buf128"]]
    assert all(parts.values()) and sum(map(len, parts.values())) == len(rows)
    paths = []
    for name, part in parts.items():
        paths.append(str(tmp_path / f"{name}.csv"))
        _write(paths[-1], part)
    assert _table(*paths) == _table(LATEST)
    assert _table(paths[-1]) != _table(LATEST)  # the XLA rows in command buffers change the best XLA variant


def test_table_refuses_a_csv_without_the_columns(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("metric,bytes,value\nflag_round_trip_us,0,1.2\n")
    out = _cli("table", str(path), check=False)
    assert out.returncode != 0 and "no column" in out.stderr


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
             ("d", "dev", "c", "nvlink", "2", "1", "our_launches_per_layer", "2.00"),
             ("d", "dev", "c", "floor.cu", "2", "0", "skeleton_layer_us_s2_pdl1_g16", "2.46")]  # not a table row
    lines = _printed(bench.print_table, rows)
    ratio = next(line for line in lines if line.startswith("kernels / floor")).split()[-3:]
    want = [f"{float(f'{kernels[t]:.2f}') / float(f'{floor[t]:.3f}'):.2f}x" for t in tokens]
    assert ratio == want, (ratio, want)
    assert next(line for line in lines if line.startswith("floor ")).split()[-3:] == [f"{floor[t]:.1f}" for t in tokens]
    assert not any(line.startswith("floor.cu") for line in lines)
    head = lines.index(next(line for line in lines if line.startswith("launches per layer")))
    assert lines[head + 1].split()[-1] == "3.00" and lines[head + 2].split()[:2] == ["nvlink", "(ours)"]


def test_markdown_tables_carry_the_same_cells():
    """`table --markdown` renders the fixed-width table's rows as markdown, cell for cell (empty for a missing T)."""
    rows = [("d", "dev", "c", "floor", "2", str(t), "floor_us", v) for t, v in ((1, "2.43"), (8, "2.64"))]
    rows += [("d", "dev", "c", "kernels", "2", "1", "kernel_us_median", "5.02")]
    rows += [("d", "dev", "c", b, "2", str(t), "layer_us_median", v)
             for b, t, v in (("nvlink", 1, "6.3"), ("nvlink", 8, "6.7"), ("xla", 1, "31.5"), ("xla", 8, "40.2"))]
    md = _printed(bench.print_table, rows, markdown=True)
    assert md[0] == "| backend (N = 2) | T=1 | T=8 |"
    assert "| kernels only | 5.0 |  |" in md
    assert "| speed-up of nvlink | 5.0x | 6.0x |" in md
    assert f"| kernels / floor | {5.02 / 2.43:.2f}x |  |" in md


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


# --- suites -----------------------------------------------------------------------------------------------------


def _run_args(*argv):
    args = bench.parser().parse_args(["run", *argv])
    args.tokens_given = any(a.startswith("--tokens") for a in argv)
    return args


def test_readme_suite_is_the_table_run_and_its_variants():
    passes = bench.suite_passes("readme", _run_args())
    assert [p.tag for p in passes] == ["", "-collectives-cmdbuf", "-buf128"]
    main, cmdbuf, buf128 = passes
    assert main.stages == "floor,kernels,layers" and main.backends == "nvlink,xla,xla-allgather"
    assert (main.layers, main.repeats, main.max_tokens, main.tokens) == (32, 10, -1, [1, 2, 5, 8, 16, 32, 64, 128])
    assert "command_buffer_update_mode=SKIP_TEMP" in main.xla_flags and "COLLECTIVES" not in main.xla_flags
    assert cmdbuf.stages == "layers" and cmdbuf.backends == "xla,xla-allgather" and cmdbuf.only_ranks == [2]
    assert "COLLECTIVES" in cmdbuf.xla_flags and cmdbuf.count_tokens == []
    assert (buf128.backends, buf128.max_tokens, buf128.only_ranks, buf128.only_procs) == ("nvlink", 128, [2], [2])


def test_readme_suite_writes_the_backends_of_latest_csv():
    """The backend names the readme suite's passes write at N = 2 (each backend in both process modes, with the
    pass's tag) are the ones in latest.csv's per-layer rows, neither more nor fewer."""
    want = set()
    for p in bench.suite_passes("readme", _run_args()):
        for b in p.backends.split(","):
            for procs in (1, 2):
                if not p.only_procs or procs in p.only_procs:
                    want.add(b + ("-1proc" if procs == 1 else "") + p.tag)
    got = {r[3] for r in bench.read_rows(LATEST) if r[6] == "layer_us_median" and r[4] == "2"}
    assert got == want


def test_experts_suite_steps():
    """The experts suite: the expert stage's GPU tests, then the four benchmarks, their CSVs beside `out`."""
    steps = bench.SUITES["experts"][2]("/tmp/run.csv", "abc1234", 1)
    assert [name for name, *_ in steps] == ["expert stage tests", "expert stage, every format",
                                           "K3 layer, every format", "dense projections", "training step"]
    assert "tests/test_grouped.py" in steps[0][1] and steps[0][1][-1] == "tests/gpu/test_experts_gpu.py"
    for (_, argv, _, _), name in zip(steps[1:], ("expert_stage", "k3_layer", "dense_projections", "training")):
        assert argv[1].endswith(f"{name}.py") and argv[-2:] == ["--out", f"/tmp/run.{name}.csv"]
        assert os.path.exists(argv[1])
    assert all("--device-time" in argv for _, argv, _, _ in steps[1:4])
    assert {"wgmma-fp8", "wgmma-mxfp4", "kernel"} <= set(steps[1][1])


def test_suite_options_and_command_line():
    quick = bench.suite_passes("quick", _run_args())
    assert len(quick) == 1 and quick[0].tokens == [1, 8, 128] and "floor" not in quick[0].stages
    assert bench.suite_passes("quick", _run_args("--tokens", "2,4"))[0].tokens == [2, 4]  # --tokens wins
    assert [p.tag for p in bench.suite_passes("xla-variants", _run_args())] == ["-collectives-cmdbuf", "-buf128"]
    assert bench.suite_passes("gpu-suite", _run_args()) == []
    with pytest.raises(SystemExit):
        bench.suite_passes("nonsense", _run_args())
    assert _cli("run", "--suite", "nonsense", check=False).returncode != 0
    listed = _cli("suites").stdout.split("\n")
    assert sorted(line.split()[0] for line in listed if line.strip()) == sorted(bench.SUITES)


def test_gpu_suite_steps_are_harness_modes_that_exist():
    """Every harness step of the gpu-suite runs a mode and shape that the kernel harness offers; the two-GPU steps
    appear only with two GPUs; the rows go into the run's CSV."""
    one, two = bench.check_commands("x.csv", "abc", 1), bench.check_commands("x.csv", "abc", 2)
    assert {name for name, *_ in one} < {name for name, *_ in two}
    assert {"harness devices N=2", "stress N=2, 20000 layers", "timeout combine"} <= {name for name, *_ in two}
    from tools.kernel_harness.cli import MODES
    for name, argv, env, timeout in two:
        assert timeout > 0 and isinstance(env, dict)
        if "tools.kernel_harness" not in argv:
            continue
        mode = argv[argv.index("--mode") + 1]
        assert mode in MODES, (name, mode)
        if mode in ("virtual", "devices", "stress", "sequence"):
            assert argv[argv.index("--csv") + 1] == "x.csv", name
    assert two[-1][1][-len(bench.GPU_TESTS):] == list(bench.GPU_TESTS)
    for path in bench.GPU_TESTS:
        assert os.path.exists(os.path.join(ROOT, path)), path


def test_kernel_buffers_follow_the_layer_benchmark():
    """The kernels alone are timed with the buffer the jitted layer of the same T gets (`--max-tokens`)."""
    tokens = [1, 2, 8, 16, 128]
    per_t = bench._kernel_buffers(argparse.Namespace(tokens=tokens, max_tokens=-1))
    assert per_t == {t: [t] for t in tokens}
    assert bench._kernel_buffers(argparse.Namespace(tokens=tokens, max_tokens=0)) == {128: tokens}
    assert bench._kernel_buffers(argparse.Namespace(tokens=tokens, max_tokens=256)) == {256: tokens}


# --- the floor --------------------------------------------------------------------------------------------------


def test_floor_rows_of_latest_csv_follow_from_its_floor_cu_rows(tmp_path):
    """latest.csv's `floor_us` rows are two round trips plus a token's bytes at the peer bandwidth, computed from the
    same run's floor.cu figures (rebuilt here as floor.cu's own `metric,bytes,value` file and fed to `floor --raw`)."""
    rows = bench.read_rows(LATEST)
    raw = []
    for r in rows:
        if r[3] == "floor.cu":
            m = re.fullmatch(r"(.*)_(\d+)B", r[6])
            raw.append((m.group(1), m.group(2), r[7]) if m else (r[6], "0", r[7]))
    path = tmp_path / "floor_raw.csv"
    _write(path, raw, ("metric", "bytes", "value"))
    out = list(csv.DictReader(io.StringIO(_cli("floor", "--raw", str(path), "--commit", "x").stdout)))
    got = {r["tokens"]: r["value"] for r in out if r["metric"] == "floor_us"}
    want = {r[5]: r[7] for r in rows if r[6] == "floor_us"}
    assert got == want and len(want) == 8
    rt = next(float(v) for m, b, v in raw if m == "flag_round_trip_us")
    bw = max((int(b), float(v)) for m, b, v in raw if m == "peer_store_GBps")[1]
    assert float(got["128"]) == pytest.approx(2 * rt + 128 * (3828 + 7168) / (bw * 1e3), abs=1e-3)
    assert {r["metric"] for r in out if r["backend"] == "floor.cu"} == {r[6] for r in rows if r[3] == "floor.cu"}


# --- the plot ---------------------------------------------------------------------------------------------------


def _small_rows():
    rows = []
    for t, floor, kern, nv, xla, xla_cb, nv1 in ((1, 2.5, 4.9, 6.4, 37.9, 23.6, 6.3), (8, 2.7, 5.1, 6.5, 43.7, 31.1, 6.6),
                                               (128, 6.3, 10.8, 12.7, 43.5, 49.4, 12.7)):
        rows += [("d", "dev", "c", "floor", "2", str(t), "floor_us", str(floor)),
                 ("d", "2x dev", "c", "kernels", "2", str(t), "kernel_us_median", str(kern)),
                 ("d", "dev", "c", "nvlink", "2", str(t), "layer_us_median", str(nv)),
                 ("d", "dev", "c", "nvlink-1proc", "2", str(t), "layer_us_median", str(nv1)),
                 ("d", "dev", "c", "xla", "2", str(t), "layer_us_median", str(xla)),
                 ("d", "dev", "c", "xla-collectives-cmdbuf", "2", str(t), "layer_us_median", str(xla_cb)),
                 ("d", "dev", "c", "nvlink", "1", str(t), "layer_us_median", "4.5"),
                 ("d", "dev", "c", "xla", "1", str(t), "layer_us_median", "3.5")]
    return rows


def test_plot_draws_only_the_current_table(tmp_path):
    """The plot's series are the floor, the kernels, `nvlink` and the best XLA variant per T, nothing else (no
    `-1proc` or other variants); at N = 1 there is no floor."""
    rows = _small_rows()
    data = bench.current_series(rows, 2)
    assert list(data) == list(bench.PLOT_SERIES)
    assert data["best XLA"] == {1: 23.6, 8: 31.1, 128: 43.5}
    assert data["nvlink"] == {1: 6.4, 8: 6.5, 128: 12.7} and data["floor"][128] == 6.3
    assert list(bench.current_series(rows, 1)) == ["nvlink", "best XLA"]
    path = tmp_path / "small.csv"
    _write(path, rows)
    out = _cli("plot", "--csv", str(path), "--out-dir", str(tmp_path / "png"))
    for n in (1, 2):
        png = tmp_path / "png" / f"latency_n{n}.png"
        assert str(png) in out.stdout and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    seen = {}
    real = plt.Figure.savefig

    def keep(fig, *a, **k):
        seen["labels"] = [line.get_label() for line in fig.axes[0].get_lines()]
        seen["texts"] = [t.get_text() for t in fig.axes[0].texts]
        return real(fig, *a, **k)

    plt.Figure.savefig = keep
    try:
        bench.plot(rows, 2, str(tmp_path / "n2.png"))
    finally:
        plt.Figure.savefig = real
    assert len(seen["labels"]) == 4  # one line per series, one legend entry each
    assert seen["texts"] == [f"{23.6 / 6.4:.1f}x", f"{31.1 / 6.5:.1f}x", f"{43.5 / 12.7:.1f}x"]


# --- the recorded CSVs and publishing --------------------------------------------------------------------------


def test_history_csv_is_well_formed():
    """Every row of history.csv has every column, ranks and tokens integers, a number as value and an ISO date;
    every row of latest.csv is in it, under the files that published it."""
    with open(HISTORY, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        rows = list(reader)
    assert tuple(header) == bench.HISTORY_COLUMNS
    assert len(rows) > 4000
    for i, r in enumerate(rows):
        assert len(r) == len(header) and all(v.strip() for v in r), (i, r)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r[0]), (i, r)
        int(r[4]), int(r[5]), float(r[7])
    sources = {r[8] for r in rows}
    assert "bench_v15_2026-12-01.csv" in sources and "stress.csv" in sources
    published = {tuple(r[:8]) for r in rows}
    missing = [r for r in bench.read_rows(LATEST) if r not in published]
    assert not missing, missing[:3]


def test_publish_makes_latest_history_and_plots(tmp_path, monkeypatch):
    recorded = [open(path, "rb").read() for path in (LATEST, HISTORY)]
    latest, history = tmp_path / "latest.csv", tmp_path / "history.csv"
    _write(history, [("2026-01-01", "dev", "c", "nvlink", "2", "1", "layer_us_median", "7.0", "old.csv")],
           bench.HISTORY_COLUMNS)
    monkeypatch.setattr(bench, "LATEST", str(latest))
    monkeypatch.setattr(bench, "HISTORY", str(history))
    monkeypatch.setattr(bench, "RESULTS", str(tmp_path))
    run = tmp_path / "run.csv"
    rows = _small_rows()
    _write(run, rows)
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench.cmd_publish(argparse.Namespace(csv=str(run), source="run1")) == 0
    assert bench.read_rows(str(latest)) == [tuple(r) for r in rows]
    hist = list(csv.DictReader(open(history)))
    assert len(hist) == 1 + len(rows) and {r["source"] for r in hist[1:]} == {"run1"}
    assert (tmp_path / "latency_n1.png").exists() and (tmp_path / "latency_n2.png").exists()
    with pytest.raises(SystemExit):  # the same run twice
        bench.cmd_publish(argparse.Namespace(csv=str(run), source="run1"))
    assert [open(path, "rb").read() for path in (LATEST, HISTORY)] == recorded  # the recorded files untouched


def test_results_hold_only_the_current_run_and_its_history():
    assert sorted(os.listdir(RESULTS)) == ["README.md", "history.csv", "latency_n1.png", "latency_n2.png",
                                           "latest.csv"]


# --- on this machine --------------------------------------------------------------------------------------------


def test_run_on_cpu(tmp_path):
    """`bench.py run` on this machine's CPU (the XLA backends; the floor and the kernels say why they are skipped):
    every backend and T gets its per-layer rows, with finite positive times; a second run replaces the CSV."""
    out = tmp_path / "bench.csv"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, BENCH, "run", "--tokens", "1,3", "--layers", "2", "--repeats", "2", "--inner", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "floor: skipped" in proc.stdout and "kernels: skipped (no GPU)" in proc.stdout
    assert "nvlink: skipped (no GPU)" in proc.stdout
    rows = list(csv.DictReader(open(out)))
    got = {(r["backend"], r["tokens"], r["metric"]): float(r["value"]) for r in rows}
    for backend in ("xla", "xla-allgather"):
        for t in ("1", "3"):
            for metric in ("layer_us_median", "enqueue_us_per_layer"):
                assert 0 < got[(backend, t, metric)] < 1e7, (backend, t, metric)
    assert {r["ranks"] for r in rows} == {"1"} and {r["device"] for r in rows} == {"cpu"}
    assert len(rows) == 8
    assert os.listdir(tmp_path / "bench.logs")  # the worker's log
    proc = subprocess.run(cmd[:-2] + ["--backends", "xla", "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {r["backend"] for r in csv.DictReader(open(out))} == {"xla"}


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
