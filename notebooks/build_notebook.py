"""Writes notebooks/explore.ipynb (outputs stripped) from the cells below: `python notebooks/build_notebook.py`."""

import os

import nbformat

CELLS = [
    ("md", """# Exploring `jax_latent_ep`

Expert-parallel dispatch and combine of a latent MoE layer, run top to bottom on whatever is here: 8 virtual
CPU devices with the XLA backend by default, the GPUs (and the NVLink backend) when present.

1. the mesh and the backend, 2. the symmetric buffer layout, 3. a dispatch and where its rows land,
4. the MXFP8 round-trip error, 5. combine on every backend, 6. the current benchmark table."""),
    ("code", """import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import sys, tempfile
import numpy as np
import jax, jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_latent_ep
from jax_latent_ep import KIMI_K3, EpLayout, ExpertParallel, stride
from jax_latent_ep.numerics import mxfp8_quantize, mxfp8_dequantize

gpus = [d for d in jax.devices() if d.platform == "gpu"]
devices = gpus if gpus else jax.devices()
N = 2 if gpus and len(gpus) >= 2 else (1 if gpus else 4)
mesh = jax.make_mesh((N,), ("ep",), devices=devices[:N])
print(f"{len(devices)} {devices[0].platform} device(s); EP mesh of N = {N}")"""),
    ("md", """## 2. The symmetric buffer layout

One buffer per rank: receive rows (MXFP8 latent, scales, ids, weights, a source word per 128-byte line),
in two halves by layer parity, the combine slots and the control words. `EpLayout` is the one definition; the
kernels evaluate the same `region_offsets` on run-time integers."""),
    ("code", """rows = []
for n in (2, 8, 32):
    for t in (1, 8, 128):
        lay = EpLayout(n, t, KIMI_K3)
        rows.append((n, t, lay.stride, {k: v[1] for k, v in lay.regions().items()}, lay.bytes))
names = list(rows[0][3])
print(f"{'N':>3} {'T':>4} {'S':>4} " + " ".join(f"{k:>10}" for k in names) + f" {'total':>11}")
for n, t, s, sizes, total in rows:
    print(f"{n:>3} {t:>4} {s:>4} " + " ".join(f"{sizes[k]:>10}" for k in names) + f" {total:>11}")

fig, ax = plt.subplots(figsize=(9, 3.5))
labels = [f"N={n}, T={t}" for n, t, *_ in rows]
bottom = np.zeros(len(rows))
for k in names:
    vals = np.array([r[3][k] for r in rows]) / 2**20
    ax.bar(labels, vals, bottom=bottom, label=k)
    bottom += vals
ax.set_ylabel("MiB per rank"); ax.set_yscale("symlog"); ax.legend(ncol=4, fontsize=8)
ax.tick_params(axis="x", rotation=45); ax.set_title("Bytes per region of one rank's buffer (Kimi K3)")
plt.tight_layout(); plt.show()"""),
    ("md", """## 3. Dispatch a small batch

Each rank sends T tokens; row `s * S + t` of rank `d` holds token `t` of source `s` if one of its 16
experts lives on `d`. The picture shows, for every rank, which of its `N * S` rows were written and by whom."""),
    ("code", """T, MAX_TOKENS = 5, 6
S = stride(MAX_TOKENS)
ep = ExpertParallel(mesh, "ep", max_tokens=MAX_TOKENS, shape=KIMI_K3, backend="auto")
print("backend:", ep.backend)
rng = np.random.default_rng(0)
x = (rng.standard_normal((N * T, KIMI_K3.latent)) * 2).astype(jnp.bfloat16)
# skewed routing: most experts of a token on the first half of the experts
ids = np.stack([rng.choice(KIMI_K3.experts // (2 if i % 2 else 1), KIMI_K3.topk, replace=False)
                for i in range(N * T)]).astype(np.int32)
w = rng.random((N * T, KIMI_K3.topk), dtype=np.float32)
w /= w.sum(-1, keepdims=True)
shard = NamedSharding(mesh, P("ep"))
xs, idss, ws = (jax.device_put(a, shard) for a in (x, ids, w))

def one_layer(x, ids, w):
    recv = ep.dispatch(x, ids, w)
    # Every dispatch is followed by its combine (of a zero expert output here), so that the NVLink backend's
    # buffers are ready for the next layer. XLA orders the calls by their data alone: the barrier makes the
    # combine's input depend on the dispatch, and both results are returned (XLA drops a call whose result is unused).
    recv, out = jax.lax.optimization_barrier((recv, jnp.zeros((N * S, KIMI_K3.latent), jnp.bfloat16)))
    return recv, ep.combine(out, ids)

recv, _ = jax.jit(jax.shard_map(one_layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(xs, idss, ws)
src = np.asarray(recv.src).reshape(N, N * S)
img = np.where(src >= 0, src >> 16, -1)
fig, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * N))
ax.imshow(img, cmap="tab10", vmin=-1, vmax=9, aspect="auto")
for d in range(N):
    for row in range(N * S):
        if src[d, row] >= 0:
            ax.text(row, d, f"{src[d, row] >> 16}:{src[d, row] & 0xFFFF}", ha="center", va="center", fontsize=6)
ax.set_xlabel("receive row (source-major)"); ax.set_ylabel("rank"); ax.set_title("source:token of each written row")
plt.tight_layout(); plt.show()
print("rows written per rank:", (src >= 0).sum(1))"""),
    ("md", """## 4. MXFP8 round-trip error

E4M3 elements with one E8M0 (power of two) scale per 32 values: the relative error of an element is at
most 2^-4, and small elements of a block with a large maximum lose more."""),
    ("code", """v = (rng.standard_normal((64, KIMI_K3.latent)) * np.exp2(rng.integers(-6, 6, (64, 1)))).astype(jnp.bfloat16)
q, sf = mxfp8_quantize(jnp.asarray(v))
back = np.asarray(mxfp8_dequantize(q, sf))
ref = np.asarray(v, np.float32)
rel = np.abs(back - ref) / np.maximum(np.abs(ref), 1e-30)
fig, axes = plt.subplots(1, 2, figsize=(10, 3))
axes[0].hist(np.log2(rel[rel > 0]), bins=60); axes[0].set_xlabel("log2 relative error"); axes[0].axvline(-4, color="k", ls="--")
blockmax = np.repeat(np.abs(ref).reshape(64, -1, 32).max(-1), 32, axis=1)
axes[1].scatter(np.log2(np.abs(ref) / blockmax + 1e-12).ravel()[::37], np.log2(rel + 1e-12).ravel()[::37], s=1)
axes[1].set_xlabel("log2 |x| / block max"); axes[1].set_ylabel("log2 relative error")
plt.tight_layout(); plt.show()
print(f"max relative error of elements >= 2^-6 of their block max: {rel[np.abs(ref) >= blockmax * 2**-6].max():.4f}")"""),
    ("md", """## 5. Combine, on every backend

A trivial expert stage (each row's dequantized latent times the sum of its local weights), then combine
with RMSNorm. The routed latent must be bit-identical across backends; the normed output within 1-2 BF16 ulp.
On a machine without GPUs the XLA backend is compared with the NumPy contract model instead."""),
    ("code", """from jax_latent_ep.testing import model
local = KIMI_K3.experts // N
norm_w = (1 + 0.1 * rng.standard_normal(KIMI_K3.latent)).astype(jnp.bfloat16)

def layer(ep_):
    def expert(r):
        mine = (r.ids // local) == jax.lax.axis_index("ep")
        wsum = jnp.sum(jnp.where(mine, r.weights, 0.0), axis=-1)
        return (mxfp8_dequantize(r.x, r.sf) * wsum[:, None]).astype(jnp.bfloat16)

    def f(x, ids, w, g):
        # Each combine needs its own dispatch: the layer twice, without and with the RMSNorm. The barrier
        # orders the second dispatch after the first combine (its input does not depend on it otherwise).
        routed = ep_.combine(expert(ep_.dispatch(x, ids, w)), ids, None)
        routed, x = jax.lax.optimization_barrier((routed, x))
        normed = ep_.combine(expert(ep_.dispatch(x, ids, w)), ids, g)
        return routed, normed
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P()), out_specs=P("ep")))

g = jax.device_put(norm_w, NamedSharding(mesh, P()))
results = {}
for name in (["xla", "nvlink"] if gpus else ["xla"]):
    with ExpertParallel(mesh, "ep", max_tokens=MAX_TOKENS, shape=KIMI_K3, backend=name) as e:
        results[name] = [np.asarray(a) for a in layer(e)(xs, idss, ws, g)]
# NumPy contract model of the same layer
mr = model.dispatch(x.reshape(N, T, -1), ids.reshape(N, T, -1), w.reshape(N, T, -1), shape=KIMI_K3, max_tokens=MAX_TOKENS)
deq = model.mxfp8_dequantize(mr.x, mr.sf)
mine = (mr.ids // local) == np.arange(N)[:, None, None]
out = (deq * np.where(mine, mr.weights, 0).sum(-1)[..., None]).astype(jnp.bfloat16)
kw = dict(shape=KIMI_K3, max_tokens=MAX_TOKENS)
results["numpy model"] = [model.combine(out, ids.reshape(N, T, -1), None, 1e-5, **kw).reshape(N * T, -1),
                          model.combine(out, ids.reshape(N, T, -1), np.asarray(norm_w), 1e-5, **kw).reshape(N * T, -1)]

def ulps(a, b):
    a, b = (np.asarray(v, jnp.bfloat16).view(np.int16).astype(np.int64) for v in (a, b))
    a, b = (np.where(v < 0, -(v & 0x7FFF), v) for v in (a, b))
    return np.abs(a - b)

base = results["xla"]
for name, (routed, normed) in results.items():
    same = np.array_equal(np.asarray(routed).view(np.uint16), np.asarray(base[0]).view(np.uint16))
    print(f"{name:>12}: routed bit-identical to xla: {same};  normed max ulp vs xla: {ulps(normed, base[1]).max()}")"""),
    ("md", """## 6. The current benchmark table

Per-layer latency (dispatch + trivial expert + combine with RMSNorm, Kimi K3, 32 layers in one jit) from
`benchmarks/results/latest.csv`, drawn by `benchmarks/bench.py`'s own `plot`: the floor, the kernels alone, the
jitted `nvlink` layer and the best XLA variant per T, at N = 1 and N = 2 (the README's figure).
`docs/performance.md` explains the numbers."""),
    ("code", """root = os.path.abspath(os.path.join(os.getcwd(), "..")) if os.path.basename(os.getcwd()) == "notebooks" else os.getcwd()
sys.path.insert(0, os.path.join(root, "benchmarks"))
import bench

rows = bench.read_rows(bench.LATEST)
backend = matplotlib.get_backend()  # bench.plot draws with Agg into a PNG; the notebook shows the PNGs
out = tempfile.mkdtemp()
paths = [os.path.join(out, f"latency_n{n}.png") for n in (1, 2)]
for n, path in zip((1, 2), paths):
    bench.plot(rows, n, path)
plt.switch_backend(backend)
fig, axes = plt.subplots(1, 2, figsize=(14, 5))
for ax, path in zip(axes, paths):
    ax.imshow(plt.imread(path)); ax.axis("off")
plt.tight_layout(); plt.show()"""),
    ("md", """## 7. The expert stage: plan, pairs per expert, and a check against the dense formulation

`experts.plan` lists the (row, local expert) pairs of a rank's receive rows, grouped by expert, with static
shapes; `experts.swiglu` runs the grouped SwiGLU on them (docs/experts.md). Here on the CPU: a small shape,
rank 1 of N = 4 receiving from sources with different live counts, some padded tokens (`-1` ids)."""),
    ("code", """import jax, jax.numpy as jnp, numpy as np, ml_dtypes, matplotlib.pyplot as plt
from jax_latent_ep import experts
from jax_latent_ep.experts.xla import activations
from jax_latent_ep.testing.experts import random_received

N, rank, T, L, E, K, I = 4, 1, 6, 128, 64, 6, 32
J = E // N
rng = np.random.default_rng(0)
recv = random_received(rng, ranks=N, rank=rank, tokens=[6, 2, 5, 0], max_tokens=T, latent=L, experts=E, topk=K,
                       pad_tokens=0.2, pad_slots=0.1, duplicates=0.2, local_bias=0.3)
recv_j = jax.tree.map(jnp.asarray, recv)
pl = experts.plan(recv_j, rank, J, max_tokens=T, ranks=N)
print(f"capacity {pl.capacity}, pairs {int(pl.count)}, live rows {int(np.sum(np.asarray(recv.src) != -1))}")
plt.figure(figsize=(7, 2.5)); plt.bar(np.arange(J) + rank * J, np.asarray(pl.group_sizes))
plt.xlabel("expert (global id)"); plt.ylabel("pairs"); plt.title(f"pairs per local expert of rank {rank}")
plt.tight_layout(); plt.show()

w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[1])).astype(ml_dtypes.bfloat16)
wg, wu, wd = w(J, L, I), w(J, L, I), w(J, I, L)
on_gpu = any(d.platform == "gpu" for d in jax.devices())  # the kernel implementation runs on NVIDIA GPUs only
got = {impl: np.asarray(experts.swiglu(recv_j, pl, wg, wu, wd, impl=impl), np.float32)
       for impl in experts.IMPLEMENTATIONS if on_gpu or impl not in experts.GPU_ONLY}
# the dense formulation: every local expert on every row, weighted by its summed routing weight
from jax_latent_ep import moe
xf = np.asarray(activations(recv_j), np.float32)
coef = np.asarray(moe.local_coefficients(recv_j.ids, jnp.where(recv_j.src[:, None] == -1, 0.0, recv_j.weights), rank * J, J))
f = lambda a: np.asarray(a, np.float32)
gate, up = np.einsum("rl,jli->rji", xf, f(wg)), np.einsum("rl,jli->rji", xf, f(wu))
h = (gate / (1 + np.exp(-gate)) * up).astype(ml_dtypes.bfloat16).astype(np.float32)
dense = np.einsum("rj,rjl->rl", coef, np.einsum("rji,jil->rjl", h, f(wd))).astype(ml_dtypes.bfloat16).astype(np.float32)
for impl, out in got.items():
    err = np.max(np.abs(out - dense)) / np.max(np.abs(dense))
    print(f"{impl:10s}: max |out - dense| / max |dense| = {err:.1e}; rows exactly equal to dense: "
          f"{np.mean(np.all(out == dense, axis=1)):.0%}; empty rows all zero: {np.all(out[np.asarray(recv.src) == -1] == 0)}")"""),
    ("md", """FP8 block-scaled weights (`experts.BlockScaled`: float8_e4m3fn values, an FP32 scale per 128 x 128 block, the
layout DeepSeek / Kimi checkpoints store): `experts.quantize_fp8` of bf16 weights (`I` a multiple of 128), the same
stage on them, each implementation against the NumPy model (`h` rounded to MXFP8 before down, docs/experts.md)."""),
    ("code", """from jax_latent_ep.testing.experts import reference_swiglu
I8 = 128
w8 = [experts.quantize_fp8(jnp.asarray(w(*s))) for s in ((J, L, I8), (J, L, I8), (J, I8, L))]
print("weight bytes: bf16", 3 * J * L * I8 * 2, "FP8", sum(a.values.nbytes + a.scale.nbytes for a in w8))
want = reference_swiglu(recv, rank, *w8, max_tokens=T, ranks=N).astype(np.float32)
for impl in [i for i in got if experts.takes(i, experts.BlockScaled)]:  # the bf16-only training path left out
    out = np.asarray(experts.swiglu(recv_j, pl, *w8, impl=impl), np.float32)
    print(f"{impl:10s} on FP8 weights: max |out - model| / max |model| = "
          f"{np.max(np.abs(out - want)) / np.max(np.abs(want)):.1e}")"""),
]


# --- Training (appended section: a few SGD steps through dispatch / combine's gradients) ---
CELLS += [
    ("md", """## 8. Training

`jax.grad` through `ep.dispatch` / `ep.combine` (straight-through MXFP8, `docs/numerics.md`): a few plain SGD
steps of the example model (jit, scan over layers, remat) with the loss going down."""),
    ("code", """from jax_latent_ep import LatentMoEShape, moe
tcfg = moe.MoEConfig(shape=LatentMoEShape(latent=64, experts=16, topk=4), hidden=32, layers=2)
tn, tt = len(mesh.devices.flat), 4
tparams = moe.shard_params(moe.init_params(jax.random.key(0), tcfg), mesh, "ep")
th = jax.device_put(jax.random.normal(jax.random.key(1), (tn * tt, tcfg.hidden)).astype(jnp.bfloat16),
                    jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep")))
ttarget = jax.random.normal(jax.random.key(2), (tn * tt, tcfg.hidden), jnp.float32)
with ExpertParallel(mesh, "ep", max_tokens=tt, shape=tcfg.shape, backend="xla") as tep:
    tforward = moe.make_forward(tep, tcfg, remat=True)
    tstep = jax.jit(jax.value_and_grad(lambda p, h: jnp.mean((tforward(p, h).astype(jnp.float32) - ttarget) ** 2)))
    for i in range(5):
        tloss, tg = tstep(tparams, th)
        tparams = jax.tree.map(lambda a, b: (a.astype(jnp.float32) - 0.05 * b.astype(jnp.float32)).astype(a.dtype), tparams, tg)
        print(f"step {i}: loss {float(tloss):.4f}, |d router| {float(jnp.abs(tg['router'].astype(jnp.float32)).max()):.3g}")"""),
]


def main():
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                for kind, src in CELLS]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "explore.ipynb")
    for i, cell in enumerate(nb.cells):  # stable ids: a rebuild changes only the cells whose text changed
        cell.id = f"cell-{i:02d}"
    nbformat.write(nb, path)
    print("wrote", path)


if __name__ == "__main__":
    main()

