"""The harness's command line, `python -m tools.kernel_harness --mode ...` (`--help`; the modes are described in
`tools/kernel_harness/__init__.py`): runs a mode, prints its figures, appends them to `--csv`."""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import time

from jax_latent_ep.shapes import SHAPES
from tools.kernel_harness.modes.latency import latency
from tools.kernel_harness.modes.layers import run_layers
from tools.kernel_harness.modes.sequence import sequence_test
from tools.kernel_harness.modes.stress import stress
from tools.kernel_harness.modes.timeout import timeout_test
from tools.kernel_harness.runtime import DEFAULT_ARTIFACTS, System, device_name

#: `--mode` values: "virtual" and "devices" run `modes.layers`, the others the module of their name.
MODES = ("virtual", "devices", "latency", "timeout", "sequence", "stress")


def _description():
    return importlib.import_module("tools.kernel_harness").__doc__.split("\n\n")[0]


def _csv_rows(path, rows):
    if not path:
        return
    path = pathlib.Path(path)
    new = not path.exists()
    with path.open("a") as f:
        if new:
            f.write("date,device,commit,backend,ranks,tokens,metric,value\n")
        for row in rows:
            f.write(",".join(str(v) for v in row) + "\n")


def _stress_cli(args, n, device, date):
    """`--mode stress` for N = n: runs, prints, appends the CSV rows; returns `(failed, error)`."""
    mode = "virtual" if args.stress_virtual else "devices"
    system = System(args.shape, n, args.max_tokens, mode, args.artifacts)
    system.timeout_ns = args.timeout_ns
    where = "1 GPU (virtual ranks)" if mode == "virtual" else f"{n} GPUs"
    print(f"stress: {args.shape} N={n} on {where}, max_tokens {system.max_tokens}, {args.layers} layers", flush=True)
    layers, mismatches, info = stress(
        system, args.layers, seed=args.seed + n, pool_size=args.stress_pool, batch=args.stress_batch,
        delay_prob=args.stress_delay_prob, max_delay_us=args.stress_delay_us, log_every=args.stress_log_every,
    )
    for line in info["details"][:20]:
        print("   ", line)
    if info["error"]:
        print(f"  ERROR {info['error']}; host status record {{code, rank, peer, layer}} = {info['status']}", flush=True)
    print(f"  {info['ulp1']} normed elements at 1 ulp; ctrl {info['ctrl']}")
    print(f"stress: {layers} layers, {mismatches} mismatches, {info['delayed']} delayed launches, "
          f"{info['seconds']:.1f} s", flush=True)
    backend_device = f"1x {device} ({n} virtual ranks)" if mode == "virtual" else f"{n}x {device}"
    _csv_rows(args.csv, [
        (date, backend_device, args.commit, "stress", n, system.max_tokens, metric, value)
        for metric, value in (("layers", layers), ("mismatches", mismatches), ("delayed_layers", info["delayed"]),
                              ("seconds", f"{info['seconds']:.1f}"))
    ])
    failed = mismatches != 0 or layers != args.layers or info["error"] is not None
    return failed, info["error"] is not None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tools.kernel_harness", description=_description())
    parser.add_argument("--mode", choices=MODES, default="virtual")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="kimi_k3")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout-ns", type=int, default=10_000_000_000, help="flag-wait bound (0: forever)")
    parser.add_argument("--nonfinite-every", type=int, default=50, help="every k-th layer has NaN/Inf blocks")
    parser.add_argument("--bad-ids", action="store_true",
                        help="virtual/devices: every layer's routing also holds ids outside [0, E) (they reach no rank)")
    parser.add_argument("--artifacts", default=str(DEFAULT_ARTIFACTS))
    parser.add_argument("--csv", default=None, help="append figures to this CSV")
    parser.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-tokens", type=int, nargs="+", default=None,
                        help="latency mode: the T values (default 1 5 32 128, each at most --max-tokens)")
    parser.add_argument("--grid-cap", type=int, default=0, help="latency mode: grids min(this, max(T, N * S))")
    parser.add_argument("--tag", default="", help="suffix of the CSV rows' backend name (latency mode)")
    parser.add_argument("--trace", action="store_true", help="latency mode with a trace build: print its stamps")
    parser.add_argument("--latency-delay-ns", type=int, default=0,
                        help="latency mode, an experiment: rank 1 spins this long before each dispatch (the late rank)")
    parser.add_argument("--latency-virtual", action="store_true",
                        help="latency mode: all ranks on one GPU, one stream each (the peers' stores stay on the "
                             "device: no NVLink in the times)")
    parser.add_argument("--sequence-case", choices=("dispatch_twice", "combine_twice"), default="dispatch_twice")
    parser.add_argument("--timeout-case", choices=("dispatch", "combine"), default="dispatch",
                        help="--mode timeout: the kernel whose poll must time out")
    group = parser.add_argument_group("stress mode")
    group.add_argument("--stress-virtual", action="store_true", help="all ranks on one GPU (default: one per GPU)")
    group.add_argument("--stress-pool", type=int, default=8, help="input sets per rank, uploaded once")
    group.add_argument("--stress-batch", type=int, default=64, help="layers launched between two syncs")
    group.add_argument("--stress-delay-prob", type=float, default=0.5, help="fraction of layers with a rank held back")
    group.add_argument("--stress-delay-us", type=float, default=200.0, help="longest hold-back (host busy-wait)")
    group.add_argument("--stress-log-every", type=int, default=10_000, help="progress line every k layers")
    args = parser.parse_args(argv)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    failed = False
    if args.mode == "timeout":
        ok, record, err = timeout_test(args.artifacts, args.shape, args.timeout_case)
        print("TIMEOUT TEST", args.timeout_case, "PASS" if ok else "FAIL")
        return 0 if ok else 1
    if args.mode == "sequence":
        ok, record, changed = sequence_test(args.sequence_case, args.artifacts, args.shape)
        print("SEQUENCE TEST", args.sequence_case, "PASS" if ok else "FAIL")
        _csv_rows(args.csv, [(date, f"1x {device_name()} (2 virtual ranks)", args.commit, "stress", 2, 8,
                              f"{args.sequence_case}_peer_bytes_changed", changed)])
        return 0 if ok else 1
    device = device_name()
    for n in args.ranks:
        if args.mode == "stress":
            bad, error = _stress_cli(args, n, device, date)
            failed |= bad
            if error:
                break  # a trapped context is unusable
            continue
        if args.mode == "latency":
            system = System(args.shape, n, args.max_tokens, "virtual" if args.latency_virtual else "devices",
                            args.artifacts)
            system.timeout_ns = args.timeout_ns
            if args.grid_cap:
                system.grid_cap = min(args.grid_cap, system.cap)
            where = "1 GPU (virtual ranks)" if args.latency_virtual else f"{n} GPUs"
            print(f"latency {args.shape} N={n} on {where}, grids min({system.grid_cap}, max(T, N * S))", flush=True)
            counts = tuple(args.latency_tokens) if args.latency_tokens else (1, 5, 32, 128)
            res = latency(system, token_counts=counts, trace=args.trace, delay_ns=args.latency_delay_ns)
            backend_device = f"1x {device} ({n} virtual ranks)" if args.latency_virtual else f"{n}x {device}"
            rows = []
            for t, row in res.items():
                rows.append((date, backend_device, args.commit, "kernel-harness" + args.tag, n, t, "kernel_us_median", f"{row['layer'][0]:.2f}"))
                rows.append((date, backend_device, args.commit, "kernel-harness" + args.tag, n, t,
                             "kernel_replay_us_median", f"{row['layer'][2]:.2f}"))
                for part in ("dispatch", "combine"):
                    if part in row:
                        rows.append((date, backend_device, args.commit, "kernel-harness" + args.tag, n, t, f"{part}_us_median", f"{row[part][0]:.2f}"))
            _csv_rows(args.csv, rows)
            continue
        system = System(args.shape, n, args.max_tokens, args.mode, args.artifacts)
        system.timeout_ns = args.timeout_ns
        where = "1 GPU (virtual ranks)" if args.mode == "virtual" else f"{n} GPUs"
        print(f"{args.mode}: {args.shape} N={n} on {where}, max_tokens {system.max_tokens}, {args.layers} layers", flush=True)
        started = time.perf_counter()
        layers, mismatches, info = run_layers(system, args.layers, seed=args.seed + n, nonfinite_every=args.nonfinite_every,
                                              bad_ids=args.bad_ids)
        print(f"  -> {layers} layers, {mismatches} mismatches, {info['ulp1']} normed elements at 1 ulp, "
              f"{time.perf_counter() - started:.1f} s; ctrl {info['ctrl'][0]}", flush=True)
        for line in info["details"][:20]:
            print("   ", line)
        failed |= mismatches != 0 or layers != args.layers
        backend_device = f"1x {device} ({n} virtual ranks)" if args.mode == "virtual" else f"{n}x {device}"
        _csv_rows(args.csv, [
            (date, backend_device, args.commit, "kernel-harness", n, system.max_tokens, "layers", layers),
            (date, backend_device, args.commit, "kernel-harness", n, system.max_tokens, "mismatches", mismatches),
        ])
    return 1 if failed else 0

