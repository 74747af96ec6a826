"""The floor rows of `results/floor.csv` from `floor.cu`'s raw output: the flag round trip, the peer store
bandwidth, and `floor_us` of one dispatch + combine at each T (two flag round trips plus the bytes one rank sends
at N = 2 at that bandwidth).

    python benchmarks/floor_rows.py floor_raw.csv --commit <sha> --device "2x NVIDIA H200 (NV18)" >> floor.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime
import sys

#: Bytes one rank sends per token at N = 2 (Kimi K3): a dispatch row (3584 MXFP8 bytes, 112 scales, 16 ids and
#: 16 weights, 4 bytes of source) and a combine partial (3584 BF16).
DISPATCH_ROW_BYTES = 3584 + 112 + 16 * 4 * 2 + 4
COMBINE_PARTIAL_BYTES = 3584 * 2
TOKENS = (1, 2, 5, 8, 16, 32, 64, 128)


def floor_rows(raw_rows, date: str, device: str, commit: str):
    """CSV rows (lists) from `floor.cu`'s `metric,bytes,value` rows: the round trip, the bandwidth of the largest
    transfer, and `floor_us` per T."""
    round_trip = next(float(r["value"]) for r in raw_rows if r["metric"] == "flag_round_trip_us")
    peer = [r for r in raw_rows if r["metric"] == "peer_store_GBps"]
    bandwidth = float(max(peer, key=lambda r: int(r["bytes"]))["value"])  # GB/s = bytes per ns
    head = [date, device, commit, "floor", "2"]
    rows = [head + ["0", "flag_round_trip_us", f"{round_trip:.3f}"],
            head + ["0", "peer_store_GBps", f"{bandwidth:.3f}"]]
    for t in TOKENS:
        us = 2 * round_trip + t * (DISPATCH_ROW_BYTES + COMBINE_PARTIAL_BYTES) / (bandwidth * 1e3)
        rows.append(head + [str(t), "floor_us", f"{us:.3f}"])
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--device", default="2x NVIDIA H200 (NV18)")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    a = p.parse_args()
    with open(a.raw) as f:
        raw_rows = list(csv.DictReader(f))
    csv.writer(sys.stdout, lineterminator="\n").writerows(floor_rows(raw_rows, a.date, a.device, a.commit))


if __name__ == "__main__":
    main()
