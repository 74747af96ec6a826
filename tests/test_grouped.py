"""The grouped matmul `experts.gmm` and the training path on it ("gmm", "mosaic"): values and gradients against
float64 NumPy models and against `jax.grad` of the other implementations, on fresh random groups (empty groups,
rows past the groups holding garbage). One test body per check, parametrized over the implementations."""

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_latent_ep import experts
from jax_latent_ep.experts.xla import activations
from jax_latent_ep.testing.experts import random_received, reference_swiglu_grads

GMM_IMPLS = [pytest.param(i, marks=pytest.mark.gpu) if i in experts.grouped.HOPPER_ONLY else i
             for i in experts.GMM_IMPLEMENTATIONS]
#: The differentiable stage implementations (the kernel has no VJP), "mosaic" on Hopper GPUs only.
STAGE_IMPLS = [pytest.param(i, marks=pytest.mark.gpu) if i in experts.GPU_ONLY else i
               for i in sorted(set(experts.IMPLEMENTATIONS) - experts.READS_RECEIVED)]
#: The stage implementations on `gmm`.
GMM_STAGE_IMPLS = ("gmm", "mosaic", "wgmma")


def _rng(text):
    return np.random.default_rng(zlib.crc32(text.encode()))


def _groups(rng, g, m):
    """int32 group sizes summing to less than `m` (some groups empty), and bf16 `x` `[m, K]`'s tail garbage."""
    sizes = rng.multinomial(int(m * 0.8), rng.dirichlet(np.full(g, 0.5)))
    sizes[rng.choice(g, size=max(1, g // 4), replace=False)] = 0
    return sizes.astype(np.int32)


def _bf16(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)


def _assert_bf16_close(got, want, what):
    """Within 2^-8 of |want| (the one bf16 rounding of the output) plus 1e-3 of the largest |want| (FP32
    accumulation orders)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = np.abs(want) * 2.0**-8 + 1e-3 * np.max(np.abs(want))
    bad = np.argwhere(np.abs(got - want) > tol)
    assert bad.size == 0, (f"{what}: {len(bad)} values off, first at {bad[0].tolist()}: {got[tuple(bad[0])]} vs "
                           f"{want[tuple(bad[0])]}")


@pytest.mark.parametrize("impl", GMM_IMPLS)
@pytest.mark.parametrize("transpose_w", [False, True])
def test_gmm_and_its_gradients_against_numpy(impl, transpose_w):
    rng = _rng(f"gmm/{impl}/{transpose_w}")
    # n: a 256-column block's CTAs one whole, one half; k: 18 stages, the forward's ring of 4 around 4.5 times.
    g, m, k, n = 6, 300, 1152, 384
    sizes = _groups(rng, g, m)
    x = _bf16(rng, m, k)
    x[sizes.sum():] = np.float32("nan")  # rows past the groups: never read into a used output
    w = _bf16(rng, *((g, n, k) if transpose_w else (g, k, n)), scale=k**-0.5)
    dy = _bf16(rng, m, n)
    wf = np.asarray(w, np.float64)
    wf = np.swapaxes(wf, 1, 2) if transpose_w else wf
    xf, dyf = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    ends = np.cumsum(sizes)
    want, want_dx, want_dw = np.zeros((m, n)), np.zeros((m, k)), np.zeros_like(wf)
    for e in range(g):
        s = slice(ends[e] - sizes[e], ends[e])
        want[s], want_dx[s], want_dw[e] = xf[s] @ wf[e], dyf[s] @ wf[e].T, xf[s].T @ dyf[s]
    if transpose_w:
        want_dw = np.swapaxes(want_dw, 1, 2)

    f = jax.jit(lambda x, w, gs: experts.gmm(x, w, gs, impl=impl, transpose_w=transpose_w))
    y, vjp = jax.vjp(lambda x, w: f(x, w, jnp.asarray(sizes)), jnp.asarray(x), jnp.asarray(w))
    assert y.dtype == jnp.bfloat16
    _assert_bf16_close(y, want, f"{impl} forward")
    assert np.all(np.asarray(y, np.float32)[sizes.sum():] == 0), "rows past the groups are not 0"
    dx, dw = vjp(jnp.asarray(dy))
    _assert_bf16_close(dx, want_dx, f"{impl} d x")
    _assert_bf16_close(dw, want_dw, f"{impl} d w")
    assert np.all(np.asarray(dw, np.float32)[sizes == 0] == 0), "an empty group's gradient is not 0"


@pytest.mark.gpu
def test_wgmma_weights_gradient_of_several_blocks_a_cta():
    """The weights' gradient kernel at a size where a CTA computes several 128 x 256 blocks in turn (16 groups, some
    empty, K 1024, N 4224: 2176 blocks, 2 a CTA, the last CTA of a row 1, its block half past N): against float64
    per group, within the bf16 rounding of `_assert_bf16_close`; an empty group's gradient exactly 0."""
    from jax_latent_ep.kernels import abi

    rng = _rng("wgrad-blocks")
    g, m, k, n = 16, 2400, 1024, 4224
    tile = abi.MATMUL_WGRAD_TILE_N
    blocks = -(-n // tile)
    assert g * (k // 128) * blocks >= 2 * abi.MATMUL_WGRAD_CTAS and blocks % 2 == 1 and n % tile == tile // 2
    sizes = _groups(rng, g, m)
    x, dy = _bf16(rng, m, k), _bf16(rng, m, n)
    dy[sizes.sum():] = np.float32("nan")  # rows past the groups: never read
    ends = np.cumsum(sizes)
    xf, dyf = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    want = np.stack([xf[ends[e] - sizes[e]:ends[e]].T @ dyf[ends[e] - sizes[e]:ends[e]] for e in range(g)])
    _, vjp = jax.vjp(lambda w: experts.gmm(jnp.asarray(x), w, jnp.asarray(sizes), impl="wgmma"),
                     jnp.zeros((g, k, n), jnp.bfloat16))
    (dw,) = vjp(jnp.asarray(dy))
    _assert_bf16_close(dw, want, "wgmma d w")
    assert np.all(np.asarray(dw, np.float32)[sizes == 0] == 0), "an empty group's gradient is not 0"


def _fp8_case(rng, g=6, m=200, k=256, n=256, magnitude=False):
    """MXFP8 rows (some 32-blocks all zero: scale code 0) sorted into random groups (some empty, some of several
    32-pair tiles), FP8 block-scaled weights `[G, N, K]`, and the float64 model of `gmm_fp8`; with `magnitude`
    also the model's sum of the products' absolute values (`_kernel_tolerance`)."""
    from jax_latent_ep.numerics import mxfp8_quantize
    from jax_latent_ep.testing.experts import random_fp8_weights

    sizes = _groups(rng, g, m)
    rows = rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1)))
    rows.reshape(m, k // 32, 32)[rng.random((m, k // 32)) < 0.1] = 0.0
    q, sf = mxfp8_quantize(jnp.asarray(rows, jnp.bfloat16))
    bs = random_fp8_weights(rng, g, k, n)
    w, ws = jnp.swapaxes(jnp.asarray(bs.values), 1, 2), jnp.swapaxes(jnp.asarray(bs.scale), 1, 2)
    xf = np.asarray(q, np.float64).reshape(m, k // 32, 32)
    xs = np.exp2(np.asarray(sf, np.float64) - 127) * (np.asarray(sf) > 0)
    wf = np.asarray(w, np.float64).reshape(g, n, k // 32, 32)
    wsf = np.repeat(np.repeat(np.asarray(ws, np.float64), 128, 1), 4, 2)  # [G, N, K / 32]
    want, mag, ends = np.zeros((m, n)), np.zeros((m, n)), np.cumsum(sizes)
    for e in range(g):
        for p in range(ends[e] - sizes[e], ends[e]):
            want[p] = np.sum(np.einsum("bk,nbk->nb", xf[p], wf[e]) * xs[p] * wsf[e], axis=1)
            mag[p] = np.sum(np.einsum("bk,nbk->nb", np.abs(xf[p]), np.abs(wf[e])) * xs[p] * wsf[e], axis=1)
    return ((q, sf, w, ws, jnp.asarray(sizes)), want) + ((mag,) if magnitude else ())


def _kernel_tolerance(impl, want, mag):
    """The FP8 / MXFP4 kernels' error bound against the float64 model: 2^-20 of the row's largest |value| on "xla"
    (FP32 sums of exact block products); on "wgmma" 2^-12 of the products' absolute sum: the FP8 tensor cores
    truncate a block's internal sum of 32 products to about 2^-13 of its magnitude, not of the result's."""
    if impl == "xla":
        return 2.0**-20 * np.max(np.abs(want), axis=1, keepdims=True) + 1e-30
    return 2.0**-12 * mag + 1e-30


def _load_expert_kernels(ffi):
    """Skips without a GPU, else loads the expert kernels on every local GPU (`ffi` the runtime module)."""
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs NVIDIA GPUs")
    ffi.load_expert_kernels({d for d in jax.local_devices() if d.platform == "gpu"})


#: `(K, expected_groups)` of the FP8 / MXFP4 kernel tests: one contraction pass, and K = 1024 split in two
#: (`narrow_splits`: one expected group wants many units).
NARROW_SPLITS = [(256, None), (1024, 1)]


@pytest.mark.parametrize("k,expected,m", [(*c, 200) for c in NARROW_SPLITS] + [(512, None, 900)],
                         ids=["unsplit", "split", "wide"])
@pytest.mark.parametrize("impl", [pytest.param(i, marks=pytest.mark.gpu) if i == "wgmma" else i
                                  for i in experts.grouped.GMM_FP8_IMPLEMENTATIONS])
def test_gmm_fp8_against_numpy(impl, k, expected, m):
    """`gmm_fp8` against the float64 model within `_kernel_tolerance`; "xla"'s rows past the groups exactly 0. At
    m = 900 (150 pairs a group) "wgmma" takes the prefill kernel's 128-pair tiles."""
    args, want, mag = _fp8_case(_rng(f"gmm-fp8/{impl}/{k}/{m}"), m=m, k=k, magnitude=True)
    got = np.asarray(jax.jit(lambda *a: experts.grouped.gmm_fp8(*a, impl=impl, expected_groups=expected))(*args),
                     np.float64)
    used = int(np.sum(args[-1]))
    tol = _kernel_tolerance(impl, want, mag)
    bad = np.argwhere(np.abs(got[:used] - want[:used]) > tol[:used])
    assert bad.size == 0, f"{impl}: {len(bad)} off, first {bad[0].tolist()}: {got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"
    if impl == "xla":
        assert np.all(got[used:] == 0)


def test_gmm_fp8_refuses_bad_arguments():
    (q, sf, w, ws, gs), _ = _fp8_case(_rng("gmm-fp8-bad"), m=40, k=128, n=128)
    with pytest.raises(ValueError, match=r"x_scale must be uint8\[40, 4\]"):
        experts.grouped.gmm_fp8(q, sf[:, :2], w, ws, gs)
    with pytest.raises(ValueError, match=r"w float8_e4m3fn\[G, N, K\]"):
        experts.grouped.gmm_fp8(q, sf, w.astype(jnp.bfloat16), ws, gs)


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="a CPU-only process's refusal")
def test_gmm_fp8_needs_a_hopper_gpu():
    (q, sf, w, ws, gs), _ = _fp8_case(_rng("gmm-fp8-bad"), m=40, k=128, n=128)
    with pytest.raises(ValueError, match=r"impl='wgmma'\) runs on Hopper GPUs"):
        experts.grouped.gmm_fp8(q, sf, w, ws, gs, impl="wgmma")


def test_gmm_refuses_bad_arguments():
    x, w, gs = jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((2, 64, 32), jnp.bfloat16), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="impl='cutlass' must be one of"):
        experts.gmm(x, w, gs, impl="cutlass")
    with pytest.raises(ValueError, match=r"x must be bfloat16\[M, K\] and w bfloat16\[G, K, N\], got float32"):
        experts.gmm(x.astype(jnp.float32), w, gs)
    with pytest.raises(ValueError, match="x's K=64 must match w"):
        experts.gmm(x, w, gs, transpose_w=True)
    with pytest.raises(ValueError, match=r"group_sizes must be int32\[2\]"):
        experts.gmm(x, w, gs[:1])
    with pytest.raises(ValueError, match=r"K=64 and N=32 must be multiples of 128"):
        experts.gmm(x, w, gs, impl="mosaic")


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="a CPU-only process's refusal")
def test_mosaic_needs_a_hopper_gpu():
    x, w, gs = jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((2, 128, 128), jnp.bfloat16), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"gmm\(impl='mosaic'\) runs on Hopper GPUs .*this process has \['cpu'\]"):
        experts.gmm(x, w, gs, impl="mosaic")


def _stage_case(text, fused=False):
    n, rank, tokens, mt, lat, e, k, inter = 4, 2, [3, 8, 1, 5], 8, 128, 16, 8, 128
    rng = _rng(text)
    recv = random_received(rng, ranks=n, rank=rank, tokens=tokens, max_tokens=mt, latent=lat, experts=e, topk=k,
                           pad_tokens=0.15, pad_slots=0.2, duplicates=0.3, local_bias=0.4)
    recv = jax.tree.map(jnp.asarray, recv)
    j = e // n
    w = [jnp.asarray(_bf16(rng, *s, scale=s[1] ** -0.5)) for s in ((j, lat, inter), (j, lat, inter), (j, inter, lat))]
    pl = experts.plan(recv, rank, j, max_tokens=mt, ranks=n)
    xb = activations(recv)
    target = jnp.asarray(rng.standard_normal((xb.shape[0], lat)) * 0.1, jnp.float32)
    return pl, xb, w, target


def _stage_grads(impl, pl, xb, w, dout):
    def loss(xb, *w):
        return jnp.sum(experts.swiglu_rows(pl, xb, *w, impl=impl).astype(jnp.float32) * dout)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(xb, *w)


@pytest.mark.parametrize("impl", STAGE_IMPLS)
def test_stage_gradients_against_numpy(impl):
    """`jax.grad` through the stage against the float64 model of its gradients: relative L2 within 2e-2 for each
    of the rows and the three weights (bf16 roundings of `h`, and on the "gmm" path of `gate`, `up`, each pair's
    output and the cotangent, each ~2^-9 relative, through a few chained products)."""
    pl, xb, w, _ = _stage_case(f"stage-grad/{impl}")
    dout = jnp.asarray(_rng("dout").standard_normal(xb.shape), jnp.float32)
    want = reference_swiglu_grads(pl, xb, *w, dout)
    for name, g, r in zip(("rows", "w_gate", "w_up", "w_down"), _stage_grads(impl, pl, xb, w, dout), want):
        g = np.asarray(g, np.float64)
        assert np.any(r != 0), name
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2, f"{impl}: d {name}"


@pytest.mark.parametrize("impl", [p for p in STAGE_IMPLS if getattr(p, "values", [p])[0] in GMM_STAGE_IMPLS])
def test_gmm_stage_gradients_against_the_xla_path(impl):
    """The stages on `gmm` ("gmm", "mosaic", "wgmma"): `jax.grad` against `jax.grad` of "ragged_dot" (XLA's own
    transpose rules): relative L2 within 2e-2 (the bf16 intermediates of the gmm path)."""
    pl, xb, w, _ = _stage_case(f"stage-vs-xla/{impl}")
    dout = jnp.asarray(_rng("dout2").standard_normal(xb.shape), jnp.float32)
    for name, g, r in zip(("rows", "w_gate", "w_up", "w_down"), _stage_grads(impl, pl, xb, w, dout),
                          _stage_grads("ragged_dot", pl, xb, w, dout)):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2, f"{impl}: d {name}"


@pytest.mark.parametrize("impl", [p for p in STAGE_IMPLS if getattr(p, "values", [p])[0] in GMM_STAGE_IMPLS])
@pytest.mark.parametrize("fused", [False, True])
def test_gmm_stage_routing_gradients_against_the_xla_path(impl, fused):
    """The stages' own VJP (gathers, no scatters) on a plan that drops pairs (`capacity_factor` 0.5): `jax.grad`
    with respect to the rows, the weights (gate and up fused or not) and the routing weights the plan sums, against
    `jax.grad` of "ragged_dot": relative L2 within 2e-2 (the bf16 intermediates of the gmm path)."""
    pl, xb, w, _ = _stage_case(f"stage-routing/{impl}/{fused}")
    recv = random_received(_rng(f"recv-routing/{impl}"), ranks=4, rank=2, tokens=[3, 8, 1, 5], max_tokens=8,
                           latent=128, experts=16, topk=8, pad_tokens=0.15, pad_slots=0.2, duplicates=0.3,
                           local_bias=0.6)
    recv = jax.tree.map(jnp.asarray, recv)
    xb = activations(recv)
    weights = (jnp.concatenate(w[:2], axis=2), None, w[2]) if fused else tuple(w)
    dout = jnp.asarray(_rng(f"dout-routing/{fused}").standard_normal(xb.shape), jnp.float32)

    def grads(impl):
        def loss(xb, routing, ws):
            pl = experts.plan(recv._replace(weights=routing), 2, 4, max_tokens=8, ranks=4, capacity_factor=0.5,
                              overflow="drop")
            return jnp.sum(experts.swiglu_rows(pl, xb, *ws, impl=impl).astype(jnp.float32) * dout)

        pl = experts.plan(recv, 2, 4, max_tokens=8, ranks=4, capacity_factor=0.5, overflow="drop")
        assert int(pl.dropped) > 0
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xb, recv.weights, weights)

    got, want = grads(impl), grads("ragged_dot")
    for name, g, r in zip(("rows", "routing", "weights"), got, want):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.any(b != 0), name
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2, f"{impl}: d {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["mosaic", "wgmma"])
def test_layer_trains_on_hopper_kernels(impl):
    """`MoELayer(impl=...)` ("mosaic", "wgmma") on one GPU (inside its shard_map): output and `jax.grad` against the
    same layer on "gmm" (the same roundings in XLA): relative L2 within 1e-2 (their FP32 accumulation orders)."""
    from jax_latent_ep.layer import MoELayer
    from jax_latent_ep.testing import layer_model

    gpu = [d for d in jax.devices() if d.platform == "gpu"][:1]
    mesh = jax.make_mesh((1,), ("ep",), devices=gpu)
    rng = _rng(f"layer-{impl}")
    p = layer_model.random_params(rng, hidden=256, experts=8, intermediate=256, latent=128)
    x = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(-1, 8, (40, 4)), jnp.int32)
    w = jnp.asarray(rng.random((40, 4)), jnp.float32)

    def run(impl):
        layer = MoELayer(mesh, hidden=256, experts=8, topk=4, intermediate=256, latent=128, max_tokens=64,
                         impl=impl, capacity_factor=1.5, overflow="drop")
        loss = lambda x, p: jnp.sum(layer(x, p, ids, w).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(layer)(x, p, ids, w), jax.jit(jax.grad(loss, argnums=(0, 1)))(x, p)

    (y, g), (y_ref, g_ref) = run(impl), run("gmm")
    pairs = [("y", y, y_ref), ("x", g[0], g_ref[0])] + [(k, g[1][k], g_ref[1][k]) for k in ("w_gate", "w_up",
                                                                                          "w_down", "latent_down")]
    for name, a, b in pairs:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.any(b != 0), name
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2, name


def test_wgmma_tiles_follow_the_groups():
    """`grouped.tiles` (the wgmma kernel's work list) against a NumPy enumeration on fresh random group sizes
    (empty groups, groups of exactly 128 and of one row, all rows used or few): each run of at most 128 rows of one
    group in order, then tiles of 0 rows, within the static bound `min(G, M) + M // 128`; word 3 the used tiles."""
    rng = _rng("wgmma-tiles")
    for trial in range(60):
        g, m = int(rng.integers(1, 12)), int(rng.integers(1, 900))
        sizes = rng.multinomial(int(rng.integers(0, m + 1)), rng.dirichlet(np.full(g, 0.7))).astype(np.int32)
        if trial % 4 == 0:
            sizes[rng.integers(0, g)] = 0
        if trial % 5 == 0 and m >= 128:
            sizes[:] = 0
            sizes[rng.integers(0, g)] = 128
        want, start = [], 0
        for e in range(g):
            want += [(e, start + j, min(128, sizes[e] - j)) for j in range(0, sizes[e], 128)]
            start += sizes[e]
        got = np.asarray(experts.grouped.tiles(jnp.asarray(sizes), m))
        assert got.shape == (min(g, m) + m // 128, 4) and got.dtype == np.int32
        assert [tuple(int(v) for v in r[:3]) for r in got[: len(want)]] == want, sizes
        assert np.all(got[len(want):, 2] == 0) and np.all(got[:, 3] == len(want))


@pytest.mark.parametrize("k,expected", NARROW_SPLITS, ids=["unsplit", "split"])
@pytest.mark.parametrize("impl", [pytest.param(i, marks=pytest.mark.gpu) if i == "wgmma" else i
                                  for i in experts.grouped.GMM_FP8_IMPLEMENTATIONS])
def test_gmm_mxfp4_against_numpy(impl, k, expected):
    """`gmm_mxfp4` against the float64 model on ml_dtypes' decoding of the codes (every code, both zeros, scales
    over several octaves, zero scale codes) within `_kernel_tolerance`."""
    import ml_dtypes as mld

    rng = _rng(f"gmm-mxfp4/{impl}/{k}")
    (q, sf, _, _, gs), _ = _fp8_case(rng, k=k)
    g, n, k = gs.shape[0], 256, q.shape[1]
    codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    scale = rng.integers(120, 130, (g, n, k // 32)).astype(np.uint8)
    scale[rng.random(scale.shape) < 0.05] = 0
    low = (codes & 15).view(np.uint8)
    values = np.stack([low, codes >> 4], axis=-1).reshape(g, n, k)
    e2m1 = np.asarray([float(v) for v in np.arange(16, dtype=np.uint8).view(mld.float4_e2m1fn)])
    wf = (e2m1[values] * np.repeat(np.exp2(scale.astype(np.float64) - 127) * (scale > 0), 32, axis=2))
    xf = np.asarray(q, np.float64) * np.repeat(np.exp2(np.asarray(sf, np.float64) - 127) * (np.asarray(sf) > 0), 32,
                                               axis=1)
    sizes, ends = np.asarray(gs), np.cumsum(np.asarray(gs))
    want, mag = np.zeros((q.shape[0], n)), np.zeros((q.shape[0], n))
    for e in range(g):
        s = slice(ends[e] - sizes[e], ends[e])
        want[s], mag[s] = xf[s] @ wf[e].T, np.abs(xf[s]) @ np.abs(wf[e]).T
    got = np.asarray(jax.jit(lambda *a: experts.grouped.gmm_mxfp4(*a, impl=impl, expected_groups=expected))(
        q, sf, jnp.asarray(codes), jnp.asarray(scale), gs), np.float64)
    used = int(sizes.sum())
    tol = _kernel_tolerance(impl, want, mag)
    bad = np.argwhere(np.abs(got[:used] - want[:used]) > tol[:used])
    assert bad.size == 0, f"{impl}: {len(bad)} off, first {bad[0].tolist()}: {got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"


def test_narrow_splits():
    """The FP8 / MXFP4 kernel's contraction splits: about `NARROW_MIN_UNITS` units for the expected groups, at least
    4 stages a split, every split non-empty and the splits covering K."""
    from jax_latent_ep.experts.grouped import NARROW_MIN_UNITS, narrow_splits

    assert narrow_splits(16, 512, 3584) == (5, 768)  # K3 T = 1, J = 448, I = 512: gate, 4 column tiles
    assert narrow_splits(16, 3584, 512) == (1, 512)  # its down: 28 column tiles
    assert narrow_splits(1, 128, 256) == (1, 256)  # too short to split
    for groups, n, k in [(1, 128, 7168), (3, 1024, 3584), (40, 2048, 7168), (448, 7168, 2048)]:
        s, per = narrow_splits(groups, n, k)
        assert per % 128 == 0 and per >= min(k, 512) and (s - 1) * per < k <= s * per
        assert s == 1 or groups * (n // 128) * (s - 1) < NARROW_MIN_UNITS


def test_mxfp4_widening_bytes_are_the_codes_times_2_to_the_minus_6():
    """The MXFP4 kernel's widening (`e2m1x8_to_e4m3x8_scaled`, bit-modelled on the host): every code of a random word,
    in its byte, is `2^-6 * E2M1_VALUES[code]` in e4m3, sign (and -0) kept."""
    import ml_dtypes

    pytest.importorskip("cutlass", reason="the kernels' primitives import the CuTe DSL")
    from jax_latent_ep.experts.formats import E2M1_VALUES
    from jax_latent_ep.kernels.primitives import e2m1x8_to_e4m3x8_scaled_model

    rng = np.random.default_rng(7)
    for word in [0x76543210, 0xFEDCBA98] + rng.integers(0, 2**32, 64, dtype=np.uint64).tolist():
        lo, hi = e2m1x8_to_e4m3x8_scaled_model(int(word))
        got = np.array([lo, hi], np.uint32).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        want = np.array([E2M1_VALUES[(int(word) >> (4 * i)) & 0xF] for i in range(8)]) * 2.0**-6
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _run_ptx(code: str, inputs: dict) -> dict:
    """Runs a block of 32-bit `shl` / `shr` / `and` / `lop3` / `prmt` (default mode) PTX on the host, as the PTX ISA
    defines them (`lop3`: bit `4 a + 2 b + c` of the table; `prmt`: byte `s % 8` of `{b, a}`, its sign replicated
    where `s` has bit 3); returns the registers."""
    regs = dict(inputs)
    for stmt in code.strip()[1:-1].split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        v = [int(a, 0) if a[0].isdigit() else regs[a] for a in src]
        if op == "shl.b32":
            out = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            out = v[0] >> v[1]
        elif op == "and.b32":
            out = v[0] & v[1]
        elif op == "lop3.b32":
            out = sum(((v[3] >> ((v[0] >> i & 1) << 2 | (v[1] >> i & 1) << 1 | (v[2] >> i & 1))) & 1) << i
                      for i in range(32))
        elif op == "prmt.b32":
            out = 0
            for i in range(4):
                sel = (v[2] >> (4 * i)) & 0xF
                byte = ((v[1] << 32 | v[0]) >> (8 * (sel & 7))) & 0xFF
                out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
        else:
            raise AssertionError(f"no host model of {op}")
        regs[dst] = out
    return regs


def test_mxfp4_widening_ptx_is_its_model():
    """The widening's PTX itself (`E2M1X8_TO_E4M3X8_PTX`, run by `_run_ptx`) gives `e2m1x8_to_e4m3x8_scaled_model`'s
    words: every code in every position among random neighbours, and random words."""
    pytest.importorskip("cutlass", reason="the kernels' primitives import the CuTe DSL")
    from jax_latent_ep.kernels.primitives import E2M1X8_TO_E4M3X8_PTX, e2m1x8_to_e4m3x8_scaled_model

    rng = np.random.default_rng(8)
    words = [int(w) for w in rng.integers(0, 2**32, 128, dtype=np.uint64)]
    words += [(int(rng.integers(0, 2**32)) & ~(0xF << (4 * p))) | (c << (4 * p)) for p in range(8) for c in range(16)]
    for word in words:
        regs = _run_ptx(E2M1X8_TO_E4M3X8_PTX, {"$2": word})
        assert (regs["$0"], regs["$1"]) == e2m1x8_to_e4m3x8_scaled_model(word), hex(word)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_narrow_rows_and_second_weight_are_the_gather_and_two_calls(kind):
    """The FP8 / MXFP4 kernel reading each pair's row through `x_rows` (rows shuffled, repeated, past the pairs) and
    computing two weights in one launch gives, bit for bit, the gathered rows' two separate launches (the same
    units and splits: the same FP32 sums)."""
    from jax_latent_ep.kernels.abi import MATMUL_FP8_TILE_PAIRS
    from jax_latent_ep.runtime import ffi

    _load_expert_kernels(ffi)
    rng = _rng(f"narrow-rows/{kind}")
    (q, sf, w, ws, gs), _ = _fp8_case(rng, k=512)
    rows = jnp.asarray(rng.integers(0, q.shape[0], q.shape[0] + 40), jnp.int32)  # more pairs than rows, repeats
    gs = gs.at[0].add(40)
    if kind == "mxfp4":
        w = jnp.asarray(rng.integers(0, 256, (w.shape[0], w.shape[1], w.shape[2] // 2), dtype=np.uint8))
        ws = jnp.asarray(rng.integers(120, 130, (w.shape[0], w.shape[1], q.shape[1] // 32)), jnp.uint8)
    w2, ws2 = jnp.flip(w, axis=1), jnp.flip(ws, axis=1)
    call = ffi.grouped_matmul_fp8_call if kind == "fp8" else ffi.grouped_matmul_mxfp4_call
    tiles = experts.planning.chunks(gs, rows.shape[0], MATMUL_FP8_TILE_PAIRS)
    kw = dict(splits=2, k_per_split=256)
    both = jax.jit(lambda: call(q, sf, w, ws, tiles, x_rows=rows, w_second=w2, w_second_scale=ws2, **kw))()
    one = jax.jit(lambda: call(q[rows], sf[rows], w, ws, tiles, **kw))()
    two = jax.jit(lambda: call(q[rows], sf[rows], w2, ws2, tiles, **kw))()
    used = int(np.sum(np.asarray(gs)))
    n = w.shape[1]
    np.testing.assert_array_equal(np.asarray(both)[:, :used, :n], np.asarray(one)[:, :used])
    np.testing.assert_array_equal(np.asarray(both)[:, :used, n:], np.asarray(two)[:, :used])


def test_tile_pairs_follow_the_pairs_an_expert():
    """`tile_pairs`: the smallest tile of at least `TILE_HEADROOM` times the pairs an active expert expects."""
    rule = experts.grouped.tile_pairs
    assert experts.grouped.TILE_HEADROOM == 2.0
    assert [rule(pairs, 112) for pairs in (16, 448, 449, 896, 897, 2048)] == [8, 8, 16, 16, 32, 32]
    assert rule(512, 448) == 8 and rule(2048, 448) == 16
    # FP8 weights from FP8_WIDE_FROM pairs an expert: the prefill kernel's tiles; MXFP4 has none
    wide = experts.grouped.FP8_WIDE_FROM * 112
    assert rule(wide - 1, 112, fp8=True) == 32 and rule(wide, 112, fp8=True) == 128 and rule(wide, 112) == 32
    assert rule(2048, 112, fp8=True) == 32 and rule(16, 112, fp8=True) == 8


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
@pytest.mark.parametrize("tile", [16, 8])
def test_small_tiles_are_the_large_tiles_bits(kind, tile):
    """The kernels of 16- and 8-pair tiles (`m64n16k32`, `m64n8k32`) give the 32-pair tiles' bits: each output is
    one pair's sum of the same 32-deep block products in the same order; groups of 0 to over 32 pairs, rows
    through `x_rows`, two weights, two splits."""
    from jax_latent_ep.kernels import abi
    from jax_latent_ep.runtime import ffi

    _load_expert_kernels(ffi)
    rng = _rng(f"small-tiles/{kind}/{tile}")
    (q, sf, w, ws, gs), _ = _fp8_case(rng, k=512)
    rows = jnp.asarray(rng.permutation(q.shape[0]), jnp.int32)
    if kind == "mxfp4":
        w = jnp.asarray(rng.integers(0, 256, (w.shape[0], w.shape[1], w.shape[2] // 2), dtype=np.uint8))
        ws = jnp.asarray(rng.integers(120, 130, (w.shape[0], w.shape[1], q.shape[1] // 32)), jnp.uint8)
    call = ffi.grouped_matmul_fp8_call if kind == "fp8" else ffi.grouped_matmul_mxfp4_call
    kw = dict(x_rows=rows, w_second=jnp.flip(w, axis=1), w_second_scale=jnp.flip(ws, axis=1), splits=2,
              k_per_split=256)
    small = experts.planning.chunks(gs, rows.shape[0], tile)
    large = experts.planning.chunks(gs, rows.shape[0], abi.MATMUL_FP8_TILE_PAIRS)
    got = jax.jit(lambda: call(q, sf, w, ws, small, tile_pairs=tile, **kw))()
    want = jax.jit(lambda: call(q, sf, w, ws, large, **kw))()
    used = int(np.sum(np.asarray(gs)))
    assert np.max(np.asarray(gs)) > abi.MATMUL_FP8_TILE_PAIRS and np.any(np.asarray(want)[:, :used] != 0)
    np.testing.assert_array_equal(np.asarray(got)[:, :used], np.asarray(want)[:, :used])


@pytest.mark.gpu
def test_wide_tiles_are_the_decode_tiles_bits():
    """The FP8 kernel of prefill sizes (128-pair tiles, the pairs `wgmma`'s m) gives the decode kernel's bits (its
    32-pair tiles, the pairs `wgmma`'s n): each output one pair's FMAs of the same 32-deep block sums in the same
    order; groups of 0 to over 128 pairs, rows through `x_rows`, two weights, two splits, more units than CTAs (the
    persistent grid's strides)."""
    from jax_latent_ep.kernels import abi
    from jax_latent_ep.runtime import ffi

    _load_expert_kernels(ffi)
    rng = _rng("wide-tiles")
    (q, sf, w, ws, gs), _ = _fp8_case(rng, g=7, m=1000, k=512, n=1024)
    rows = jnp.asarray(rng.integers(0, q.shape[0], q.shape[0]), jnp.int32)  # shuffled and repeated
    kw = dict(x_rows=rows, w_second=jnp.flip(w, axis=1), w_second_scale=jnp.flip(ws, axis=1), splits=2,
              k_per_split=256)
    wide = experts.planning.chunks(gs, rows.shape[0], abi.MATMUL_FP8_WIDE_TILE_PAIRS)
    decode = experts.planning.chunks(gs, rows.shape[0], abi.MATMUL_FP8_TILE_PAIRS)
    call = ffi.grouped_matmul_fp8_call
    got = jax.jit(lambda: call(q, sf, w, ws, wide, tile_pairs=abi.MATMUL_FP8_WIDE_TILE_PAIRS, **kw))()
    want = jax.jit(lambda: call(q, sf, w, ws, decode, **kw))()
    used, sizes = int(np.sum(np.asarray(gs))), np.asarray(gs)
    units = 2 * int(np.asarray(wide)[0, 3]) * (2 * w.shape[1] // 128)
    assert sizes.max() > abi.MATMUL_FP8_WIDE_TILE_PAIRS and sizes.min() == 0 and units > 132
    assert np.any(np.asarray(want)[:, :used] != 0)
    np.testing.assert_array_equal(np.asarray(got)[:, :used], np.asarray(want)[:, :used])


@pytest.mark.gpu
def test_wide_glu_is_the_swiglu_kernels_bits():
    """The prefill kernel's SwiGLU form (gate and up of the same columns in a unit, `h`'s MXFP8 from the registers)
    gives `swiglu_mxfp8_call` of the prefill kernel's unsplit FP32 gate and up, bit for bit: elements and scales
    of every used pair (groups of 0 to over 128 pairs, rows through `x_rows`, I = 384: 6 units a tile)."""
    from jax_latent_ep.kernels import abi
    from jax_latent_ep.runtime import ffi

    _load_expert_kernels(ffi)
    rng = _rng("wide-glu")
    (q, sf, w, ws, gs), _ = _fp8_case(rng, g=7, m=1000, k=512, n=384)
    w_up, ws_up = jnp.flip(w, axis=1), jnp.flip(ws, axis=1)
    rows = jnp.asarray(rng.integers(0, q.shape[0], q.shape[0]), jnp.int32)
    wide = experts.planning.chunks(gs, rows.shape[0], abi.MATMUL_FP8_WIDE_TILE_PAIRS)
    used = int(np.sum(np.asarray(gs)))

    def unfused():
        gate_up = ffi.grouped_matmul_fp8_call(q, sf, w, ws, wide, splits=1, k_per_split=q.shape[1], x_rows=rows,
                                              w_second=w_up, w_second_scale=ws_up,
                                              tile_pairs=abi.MATMUL_FP8_WIDE_TILE_PAIRS)
        return ffi.swiglu_mxfp8_call(gate_up, None, jnp.asarray([used], jnp.int32))

    want = jax.jit(unfused)()
    got = jax.jit(lambda: ffi.grouped_matmul_fp8_glu_call(q, sf, w, ws, w_up, ws_up, wide, x_rows=rows))()
    (gq, gs_), (wq, ws_) = ([np.asarray(a)[:used].view(np.uint8) for a in pair] for pair in (got, want))
    assert np.max(np.asarray(gs)) > abi.MATMUL_FP8_WIDE_TILE_PAIRS and np.any(wq != 0) and len(np.unique(ws_)) > 1
    np.testing.assert_array_equal(gq, wq)
    np.testing.assert_array_equal(gs_, ws_)


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_w", [False, True])
def test_wgmma_rows_are_the_gather(transpose_w):
    """The bf16 grouped matmul reading each pair's row through `x_rows` (rows shuffled, repeated, more pairs than
    rows) gives the gathered rows' bits: the same tiles, the same sums."""
    from jax_latent_ep.runtime import ffi

    _load_expert_kernels(ffi)
    rng = _rng(f"wgmma-rows/{transpose_w}")
    g, m, k, n = 5, 300, 256, 384
    sizes = jnp.asarray(_groups(rng, g, m))
    x = jnp.asarray(_bf16(rng, m - 60, k))
    w = jnp.asarray(_bf16(rng, g, n, k) if transpose_w else _bf16(rng, g, k, n))
    rows = jnp.asarray(rng.integers(0, x.shape[0], m), jnp.int32)
    work = experts.grouped.tiles(sizes, m)
    got = jax.jit(lambda: ffi.grouped_matmul_call(x, w, work, w_k_major=transpose_w, x_rows=rows))()
    want = jax.jit(lambda: ffi.grouped_matmul_call(x[rows], w, work, w_k_major=transpose_w))()
    used = int(np.sum(np.asarray(sizes)))
    assert np.any(np.asarray(want, np.float32)[:used] != 0)
    np.testing.assert_array_equal(np.asarray(got, np.float32)[:used], np.asarray(want, np.float32)[:used])


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True])
def test_wgmma_swiglu_block_against_the_two_products(residual):
    """The grouped matmul's SwiGLU block (gate and up one launch, `w_up`): its `gate_up` equals the two products'
    bits (the same sums), and `h` is XLA's `bf16(silu(gate) * up)` of them within one bf16 ulp (its silu within
    FP32 ulps of XLA's, then one rounding), on groups of 0, 1, 128 and over 128 rows, shuffled receive rows."""
    from jax_latent_ep.runtime import ffi

    _load_expert_kernels(ffi)
    rng = _rng(f"wgmma-swiglu/{residual}")
    g, m, k, n = 6, 520, 640, 384  # k: 10 stages, the ring's barriers in both phases
    sizes = np.array([0, 1, 128, 200, *rng.integers(1, 90, g - 4)], np.int32)[rng.permutation(g)]  # 200: 2 tiles
    sizes, used = jnp.asarray(sizes), int(np.sum(sizes))
    x = jnp.asarray(_bf16(rng, m - 100, k))
    w_gate, w_up = (jnp.asarray(_bf16(rng, g, k, n, scale=k**-0.5)) for _ in range(2))
    rows = jnp.asarray(rng.integers(0, x.shape[0], m), jnp.int32)
    work = experts.grouped.tiles(sizes, m)
    out = jax.jit(lambda: ffi.grouped_matmul_call(x, w_gate, work, w_k_major=False, x_rows=rows, w_up=w_up,
                                                  residual=residual))()
    h = out[0] if residual else out
    gate, up = (jax.jit(lambda w: ffi.grouped_matmul_call(x, w, work, w_k_major=False, x_rows=rows))(w)
                for w in (w_gate, w_up))
    if residual:
        got_gate, got_up = ffi.split_gate_up(out[1])
        np.testing.assert_array_equal(np.asarray(got_gate, np.float32)[:used], np.asarray(gate, np.float32)[:used])
        np.testing.assert_array_equal(np.asarray(got_up, np.float32)[:used], np.asarray(up, np.float32)[:used])
    want = np.asarray(experts.xla._glu(gate.astype(jnp.float32), up.astype(jnp.float32), n), np.float64)[:used]
    got = np.asarray(h, np.float64)[:used]
    assert np.count_nonzero(want) > want.size // 2
    off = np.abs(got - want) > np.abs(want) * 2.0**-7
    assert not np.any(off), f"{np.count_nonzero(off)} of h off by more than a bf16 ulp, first {np.argwhere(off)[0]}"
    assert np.mean(got == want) > 0.99


def test_split_gate_up_reads_alternating_blocks():
    """`ffi.split_gate_up` against the kernel's layout built in NumPy (gate's block b of `h = FORWARD_TILE_N / 2`
    columns at columns 2 h b, up's at 2 h b + h), on fresh random values; and `grouped_matmul_call` refuses a
    residual without `w_up` before any kernel runs."""
    from jax_latent_ep.kernels import abi
    from jax_latent_ep.runtime import ffi

    rng = _rng("split-gate-up")
    p, n, h = 7, 512, abi.MATMUL_FORWARD_TILE_N // 2
    gate, up = _bf16(rng, p, n), _bf16(rng, p, n)
    gate_up = np.concatenate([gate.reshape(p, n // h, 1, h), up.reshape(p, n // h, 1, h)], axis=2)
    got_gate, got_up = ffi.split_gate_up(jnp.asarray(gate_up.reshape(p, 2 * n)))
    np.testing.assert_array_equal(np.asarray(got_gate), gate)
    np.testing.assert_array_equal(np.asarray(got_up), up)
    x, w = jnp.zeros((4, 128), jnp.bfloat16), jnp.zeros((2, 128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="residual=True needs w_up"):
        ffi.grouped_matmul_call(x, w, jnp.zeros((1, 4), jnp.int32), w_k_major=False, residual=True)
    with pytest.raises(ValueError, match=r"w_up \[2, 128, 256\] must match w"):
        ffi.grouped_matmul_call(x, w, jnp.zeros((1, 4), jnp.int32), w_k_major=False,
                                w_up=jnp.zeros((2, 128, 256), jnp.bfloat16))
