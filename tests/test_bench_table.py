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


def test_table_command_on_the_recorded_benchmark():
    """The README's speed-up row (benchmark flags) comes out of the recorded CSV."""
    csv = os.path.join(ROOT, "benchmarks", "results", "bench_v11_2026-12-01.csv")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "table", csv, "--exclude",
                          "collectives"], capture_output=True, text=True, check=True).stdout
    row = next(line for line in out.splitlines() if line.startswith("speed-up of nvlink ") and line.split()[3] == "2")
    assert row.split()[-8:] == ["4.5x", "5.2x", "5.4x", "5.9x", "4.7x", "3.3x", "3.7x", "3.1x"], row
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "| speed-up of `nvlink` over the best XLA variant (benchmark flags) | " + " | ".join(row.split()[-8:]) in readme
