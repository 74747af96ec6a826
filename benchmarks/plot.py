"""Plots per-layer latency against T (one line per backend, the floor dashed) from benchmarks/results/*.csv,
or from the CSVs named by `--csv` (e.g. the output of `bench.py all --out bench.csv`).

    python benchmarks/plot.py [--ranks 2] [--csv PATH ...] [--out PNG] [--table]

Without `--csv` it reads benchmarks/results/*.csv and writes benchmarks/results/latency_n<ranks>.png; with it,
it reads only the files named and writes <first CSV>_n<ranks>.png unless `--out` says otherwise. Either way the
per-layer rows of every backend come from one file, the last (newest) that has them for `--ranks`, so that the
backends drawn side by side were measured in one run; the kernels-alone and floor rows come from that file too
where it has them, else from the others (for one series and T, a later file's row wins).
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))


def _version_key(path: str):
    """Sort key of a results file: its name with every run of digits compared as a number."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in re.split(r"(\d+)", os.path.basename(path))]


def load(ranks: int, paths=None):
    """{series name: {T: us}} of `layer_us_median` (the newest `bench_*.csv`), `kernel_us_median` (kernel harness)
    and `floor_us` rows."""
    series = {}
    explicit = bool(paths)
    if explicit:
        paths = list(paths)  # the files named, in the order given (see the module docstring)
    else:
        # Oldest first by version: `bench_v10_*` after `bench_v9_*` (numbers compared as numbers, not as text).
        paths = sorted(glob.glob(os.path.join(HERE, "results", "*.csv")), key=_version_key)
    # Per-layer rows from the newest benchmark file that has rows for `ranks` only (every backend of one run,
    # side by side).
    def has_rows(path):
        with open(path) as f:
            return any(r.get("ranks") == str(ranks) and r.get("metric") == "layer_us_median" for r in csv.DictReader(f))

    newest_bench = [p for p in paths
                    if (explicit or os.path.basename(p).startswith("bench_")) and has_rows(p)][-1:]
    # `bench.py all` writes the kernels alone and the floor into the same CSV: where the newest run has them for
    # `ranks`, they come from that run only.
    own_metrics = set()
    for path in newest_bench:
        with open(path) as f:
            own_metrics = {r["metric"] for r in csv.DictReader(f)
                           if r.get("ranks") == str(ranks) and r.get("metric") in ("kernel_us_median", "floor_us")}
    for path in paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                if r.get("metric") == "layer_us_median" and path not in newest_bench:
                    continue
                if r.get("metric") in own_metrics and path not in newest_bench:
                    continue
                if r.get("ranks") != str(ranks) or r.get("metric") not in ("layer_us_median", "kernel_us_median",
                                                                            "floor_us"):
                    continue
                if r["metric"] == "kernel_us_median" and "2x" not in r["device"] and ranks > 1 and path not in newest_bench:
                    continue
                if any(k in r["backend"] for k in ("cta0-guard", "strided", "mergedbarriers", "grid128", "grid256",
                                                    "-ll8-", "wide-staged", "-ab", "-trace-max")):
                    continue  # variants and trace builds kept for comparison only (kernel_harness_v3/v4/v5.csv, v11)
                if r["metric"] == "kernel_us_median" and "max128" in r["backend"] and int(r["tokens"]) <= 8:
                    continue  # T <= 8: the rows measured with a buffer for 8 tokens (the benchmark sizes per T)
                name = {"floor_us": "floor (2 flag round trips + bytes at peer bandwidth)",
                        "kernel_us_median": "kernels only (CUDA graph, harness)"}.get(r["metric"], r["backend"])
                series.setdefault(name, {})[int(r["tokens"])] = float(r["value"])  # the newest row wins
    return series


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--csv", action="append", default=None, metavar="PATH",
                   help="a CSV of bench.py rows to plot (repeatable; per-layer rows from the last file that has "
                        "them, the other rows merged, later files winning); "
                        "default: every benchmarks/results/*.csv")
    p.add_argument("--out", default=None,
                   help="the PNG to write (default: benchmarks/results/latency_n<ranks>.png, "
                        "with --csv: <first CSV>_n<ranks>.png)")
    p.add_argument("--table", action="store_true", help="print a markdown table instead of plotting")
    args = p.parse_args()
    for path in args.csv or ():
        if not os.path.isfile(path):
            p.error(f"--csv {path}: no such file")
    series = load(args.ranks, args.csv)
    if not series:
        p.error(f"no layer_us_median, kernel_us_median or floor_us rows for ranks {args.ranks} in "
                + (", ".join(args.csv) if args.csv else "benchmarks/results/*.csv"))
    if args.table:
        tokens = sorted({t for s in series.values() for t in s})
        print("| backend (N = %d) | " % args.ranks + " | ".join(f"T={t}" for t in tokens) + " |")
        print("|---|" + "---|" * len(tokens))
        for name, pts in sorted(series.items()):
            print(f"| {name} | " + " | ".join(f"{pts[t]:.1f}" if t in pts else "" for t in tokens) + " |")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    colors = plt.get_cmap("tab20").colors
    for i, (name, pts) in enumerate(sorted(series.items())):
        ts = sorted(pts)
        if name.startswith("floor"):
            style, kw = "k--", {}
        elif name.startswith("kernels"):
            style, kw = "s:", {"color": "black"}
        elif name.startswith("nvlink"):
            style, kw = "o-", {"color": colors[(2 * i) % 20]}
        else:  # the XLA variants; with NCCL's collectives in XLA's command buffers dotted
            style = "^:" if "collectives-cmdbuf" in name else "v-."
            kw = {"color": colors[(2 * i + 1) % 20], "alpha": 0.8}
        ax.plot(ts, [pts[t] for t in ts], style, label=name, **kw)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank T")
    ax.set_ylabel("us per layer (median)")
    ax.set_title(f"Kimi K3 dispatch + expert + combine(+RMSNorm), N = {args.ranks}, H200")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    if args.out:
        out = args.out
    elif args.csv:
        out = f"{os.path.splitext(args.csv[0])[0]}_n{args.ranks}.png"
    else:
        out = os.path.join(HERE, "results", f"latency_n{args.ranks}.png")
    fig.savefig(out, dpi=120)
    print("wrote", out)


if __name__ == "__main__":
    main()
