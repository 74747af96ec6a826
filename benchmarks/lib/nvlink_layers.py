"""Many consecutive layers of the NVLink backend checked against the XLA backend inside one jitted program.

    python benchmarks/lib/nvlink_layers.py --procs 1 --layers 1000 --csv checks.csv
    python benchmarks/lib/nvlink_layers.py --procs 2 --layers 1000 --csv ...   # one process per GPU

One program: `lax.scan` over `layers / 8` steps; each step runs 8 layers whose token counts T are drawn at
random (1..max_tokens, fixed per position at trace time), with fresh random tokens (`jax.random`, a key per
step, layer and rank) and fresh top-k routing every layer, and the next layer's tokens depend on this
layer's output (so XLA orders the layers by data flow). In each layer both backends dispatch the same
tokens; the receive rows are compared bit for bit (x and sf of the rows with `src != -1`; ids, weights, src
of every row); one expert output (from the NVLink rows) is combined by both, the routed latent compared bit
for bit, and on odd layers the RMS-normed output compared within 2 BF16 ulp (each backend is within 1 ulp of
exact; the kernel's rsqrt.approx and summation order differ from XLA's). Counts of mismatching elements
are summed on the device; every rank prints its figures, rank 0 appends CSV rows
(`backend nvlink`, metrics `layers`, `mismatches`, `normed_max_ulp`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
PER_STEP = 8


def worker(args):
    if args.procs > 1:
        import jax

        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.procs,
                                   process_id=args.process_id, local_device_ids=[args.process_id])
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jax_latent_ep
    from jax_latent_ep import numerics
    from jax_latent_ep.shapes import KIMI_K3

    shape = KIMI_K3
    devices = jax.devices()[: args.ranks]
    n = len(devices)
    mesh = jax.make_mesh((n,), ("ep",), devices=devices, axis_types=(jax.sharding.AxisType.Explicit,))
    max_tokens = args.max_tokens
    local = shape.experts // n
    rng = np.random.default_rng(args.seed)
    token_counts = [int(t) for t in rng.integers(1, max_tokens + 1, PER_STEP)]
    token_counts[0] = max_tokens  # the largest call is always among them
    ep_nv = jax_latent_ep.ExpertParallel(mesh, "ep", max_tokens=max_tokens, shape=shape, backend=args.backend)
    ep_x = jax_latent_ep.ExpertParallel(mesh, "ep", max_tokens=max_tokens, shape=shape, backend="xla")
    steps = args.layers // PER_STEP

    def ulps(a, b):
        ai = lax.bitcast_convert_type(a, jnp.int16).astype(jnp.int32)
        bi = lax.bitcast_convert_type(b, jnp.int16).astype(jnp.int32)
        ai = jnp.where(ai < 0, -(ai & 0x7FFF), ai)
        bi = jnp.where(bi < 0, -(bi & 0x7FFF), bi)
        return jnp.abs(ai - bi)

    def differ(a, b):
        """Number of elements whose bits differ."""
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
        return jnp.sum(lax.bitcast_convert_type(a, unsigned) != lax.bitcast_convert_type(b, unsigned))

    def step(carry, step_index):
        seed_row, mism, max_ulp = carry
        rank = lax.axis_index("ep")
        for j, t in enumerate(token_counts):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(args.seed), step_index * PER_STEP + j),
                                     rank)
            kx, ki, kw, kn = jax.random.split(key, 4)
            scale = jnp.exp2(jax.random.randint(kn, (t, 1), -8, 8).astype(jnp.float32))
            x = (jax.random.normal(kx, (t, shape.latent)) * scale + seed_row[None, :] * 2.0**-20)
            x = x.astype(jnp.bfloat16)
            _, ids = lax.top_k(jax.random.uniform(ki, (t, shape.experts)), shape.topk)
            ids = ids.astype(jnp.int32)
            w = jax.random.uniform(kw, (t, shape.topk), jnp.float32)
            rn = ep_nv.dispatch(x, ids, w)
            rx = ep_x.dispatch(x, ids, w)
            valid = rx.src != -1
            m = differ(rn.ids, rx.ids) + differ(rn.weights, rx.weights) + differ(rn.src, rx.src)
            m += differ(jnp.where(valid[:, None], lax.bitcast_convert_type(rn.x, jnp.uint8), 0),
                        jnp.where(valid[:, None], lax.bitcast_convert_type(rx.x, jnp.uint8), 0))
            m += differ(jnp.where(valid[:, None], rn.sf, 0), jnp.where(valid[:, None], rx.sf, 0))
            # Expert stage: dequantized row times the sum of its local weights.
            mine = (rn.ids // local) == rank
            wsum = jnp.sum(jnp.where(mine, rn.weights, 0.0), axis=-1)
            out = (numerics.mxfp8_dequantize(rn.x, rn.sf) * wsum[:, None]).astype(jnp.bfloat16)
            norm = None
            if j % 2:
                norm = (1.0 + 0.01 * jax.random.normal(kn, (shape.latent,))).astype(jnp.bfloat16)
            yn = ep_nv.combine(out, ids, norm)
            yx = ep_x.combine(out, ids, norm)
            if norm is None:
                m += differ(yn, yx)
            else:
                u = ulps(yn, yx)
                m += jnp.sum(u > 2)
                max_ulp = jnp.maximum(max_ulp, jnp.max(u))
            mism = mism + m.astype(jnp.int32)
            seed_row = yn[0].astype(jnp.float32)
        return (seed_row, mism, max_ulp), None

    def program(steps_array):
        init = (jnp.zeros((shape.latent,), jnp.float32), jnp.int32(0), jnp.int32(0))
        (_, mism, max_ulp), _ = lax.scan(step, init, steps_array)
        return mism[None], max_ulp[None]

    fn = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=P(), out_specs=(P("ep"), P("ep")),
                               check_vma=False))
    mism, max_ulp = fn(jnp.arange(steps, dtype=jnp.int32))
    mism = np.asarray(jax.device_get(mism.addressable_shards[0].data)) if args.procs > 1 else np.asarray(mism)
    max_ulp = np.asarray(jax.device_get(max_ulp.addressable_shards[0].data)) if args.procs > 1 \
        else np.asarray(max_ulp)
    layers = steps * PER_STEP
    result = {"rank": args.process_id, "procs": args.procs, "ranks": n, "layers": layers,
              "token_counts": token_counts, "mismatches": mism.tolist(), "normed_max_ulp": max_ulp.tolist()}
    print("RESULT " + json.dumps(result), flush=True)
    ep_nv.close()
    ep_x.close()
    if args.procs > 1:
        jax.distributed.shutdown()
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=61)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--csv", default=None)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--coordinator", default=None)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--backend", default="nvlink", help="backend under test (xla only to smoke-test the script)")
    args = p.parse_args()
    if args.worker or args.procs == 1:
        results = [worker(args)]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--procs", str(args.procs),
                                   "--ranks", str(args.ranks), "--layers", str(args.layers),
                                   "--max-tokens", str(args.max_tokens), "--seed", str(args.seed), "--backend", args.backend,
                                   "--process-id", str(i), "--coordinator", f"127.0.0.1:{port}"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(args.procs)]
        results = []
        for i, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=900)
            print(f"--- rank {i} (exit {proc.returncode}) ---\n{out[-3000:]}")
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    results.append(json.loads(line[7:]))
            if proc.returncode:
                sys.exit(f"worker {i} failed")
    mism = sum(sum(r["mismatches"]) for r in results)
    layers = results[0]["layers"]
    max_ulp = max(max(r["normed_max_ulp"]) for r in results)
    print(f"procs={args.procs} ranks={args.ranks} layers={layers} mismatches={mism} normed_max_ulp={max_ulp}")
    if args.csv:
        import jax

        device = jax.devices()[0].device_kind
        commit = os.environ.get("GIT_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        date = datetime.date.today().isoformat()
        new = not os.path.exists(args.csv)
        backend = "nvlink" if args.procs > 1 else "nvlink-1proc"
        with open(args.csv, "a") as f:
            if new:
                f.write("date,device,commit,backend,ranks,tokens,metric,value\n")
            for metric, value in (("layers", layers), ("mismatches", mism), ("normed_max_ulp", max_ulp)):
                f.write(f"{date},{device},{commit},{backend},{args.ranks},{args.max_tokens},{metric},{value}\n")
    return 0 if mism == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
