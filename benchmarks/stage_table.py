"""The expert stage's results table: every point of `expert_stage.py` runs, per weight format, GPU time, calls back to
back and wall time per layer against the run's own floor and against its GPU's HBM spec, as markdown.

    python benchmarks/stage_table.py RUN [RUN ...]

A RUN is an `expert_stage.py` CSV, or `SOURCE[@COMMIT]`: history.csv's rows of that source (and commit). A later
RUN's point replaces an earlier's. A cell is `GPU / back to back / wall`, each time over the floor: the active
experts' weight bytes (bf16 2 a weight, FP8 1 plus its block scales, MXFP4 a half plus its scales) at the run's
`floor_GBps` (the fastest stream it measured; a run of several processes, their largest), or at the GPU's spec
(`SPEC_GBPS`: the H200's 4.8 TB/s, the H100's 3.35).
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import HISTORY  # noqa: E402  (benchmarks/ on the path: this script's folder)

#: device name contains -> its HBM spec, GB/s
SPEC_GBPS = {"H200": 4800.0, "H100": 3350.0}
#: backend path -> the format's name in the table
FORMATS = {"kernel": "bf16", "wgmma-fp8": "FP8", "wgmma-mxfp4": "MXFP4"}
#: the cell's ratios, in order
RATIOS = ("device_ratio", "pipelined_ratio", "ratio")


def read_run(run: str, history: str = HISTORY) -> list[dict]:
    """The rows of one RUN (module docstring) as dicts of the CSV's columns."""
    if os.path.exists(run):
        with open(run, newline="") as fh:
            return list(csv.DictReader(fh))
    source, _, commit = run.partition("@")
    with open(history, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["source"] == source and (not commit or r["commit"] == commit)]
    if not rows:
        raise SystemExit(f"stage_table: no rows of {run!r} in {history}")
    return rows


def cells(runs: list[list[dict]]) -> dict:
    """`{(point "J448/I512", format, T): (ratios to the floor, ratios to the spec, commit, device)}` over the runs, a
    later run's point replacing an earlier's."""
    out = {}
    for rows in runs:
        gbps = [float(r["value"]) for r in rows if r["backend"] == "floor_GBps"]
        if not gbps or max(gbps) > 1.02 * min(gbps):  # a source of several processes: their floors within 2 %
            raise SystemExit(f"stage_table: a run needs floor_GBps rows within 2 %, found {gbps}")
        gbps = [max(gbps)]  # the larger: the spec ratio no smaller than any process's
        got = collections.defaultdict(dict)
        for r in rows:
            path, _, point = r["backend"].partition("/")
            if path in FORMATS and r["metric"] in RATIOS:
                got[(point, FORMATS[path], int(r["tokens"]), r["commit"], r["device"])][r["metric"]] = float(r["value"])
        for (point, fmt, t, commit, device), ratio in got.items():
            spec = next((v for k, v in SPEC_GBPS.items() if k in device), None)
            if spec is None:
                raise SystemExit(f"stage_table: no HBM spec for {device!r} (SPEC_GBPS)")
            if all(m in ratio for m in RATIOS):
                own = tuple(ratio[m] for m in RATIOS)
                out[(point, fmt, t)] = (own, tuple(v * spec / gbps[0] for v in own), commit, device)
    return out


def markdown(table: dict) -> str:
    """Two markdown tables of `cells`' output: against the runs' floors, then against the GPUs' spec."""
    points = sorted({k[0] for k in table}, key=lambda p: (-int(p.split("/")[0][1:]), int(p.split("/I")[1])))
    tokens = sorted({k[2] for k in table})
    formats = [f for f in FORMATS.values() if any(k[1] == f for k in table)]
    lines = []
    devices = sorted({c[3] for c in table.values()})
    specs = ", ".join(f"{v / 1000:g} TB/s" for k, v in SPEC_GBPS.items() if any(k in d for d in devices))
    for which, title in ((0, "the run's floor"), (1, f"the HBM spec ({specs})")):
        lines += [f"GPU / back to back / wall, over {title}:", "",
                  "| J / I | format | " + " | ".join(f"T = {t}" for t in tokens) + " |",
                  "|---|---|" + "---|" * len(tokens)]
        for point in points:
            for fmt in formats:
                row = [table.get((point, fmt, t)) for t in tokens]
                if any(row):
                    lines.append(f"| {point.replace('J', '').replace('/I', ' / ')} | {fmt} | " + " | ".join(
                        " / ".join(f"{v:.2f}" for v in c[which]) if c else "-" for c in row) + " |")
        lines.append("")
    commits = sorted({c[2] for c in table.values()})
    lines.append("Commits: " + ", ".join(f"`{c}`" for c in commits) + "; " + ", ".join(devices) + ".")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="expert_stage.py CSVs or SOURCE[@COMMIT] of history.csv")
    p.add_argument("--history", default=HISTORY)
    args = p.parse_args(argv)
    print(markdown(cells([read_run(r, args.history) for r in args.runs])))


if __name__ == "__main__":
    sys.exit(main())
