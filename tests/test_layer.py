"""`MoELayer` on 8 virtual CPU devices against the float64 NumPy model (`testing/layer_model.py`): both routers, both
token layouts over the EP axis, meshes (ep), (dp, ep), (dp, ep, tp), token counts that do not divide the shards, bf16 /
FP8 / int8 weights, a latent projection, a shared expert, the norm; the replicated layout's expert work counted once.

Tolerance: `layer_model.assert_close` (relative L2 1e-2, 5 % of the RMS at worst: float64 sums against FP32 ones may
move an intermediate bf16 rounding by one ulp)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_latent_ep import experts, routers
from jax_latent_ep.layer import MoELayer, expert_weights
from jax_latent_ep.testing import layer_model

D, E, K, I, IS, L = 64, 16, 4, 128, 128, 128


def _mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, devices=jax.devices("cpu")[:n])


def _params(rng, fmt="bf16", latent=False, shared=False, bias=False, inter=I):
    return layer_model.random_params(rng, hidden=D, experts=E, intermediate=inter, fmt=fmt,
                                     latent=L if latent else None, shared_intermediate=IS if shared else 0, bias=bias)


_route_model, _check = layer_model.route, layer_model.assert_close


ROUTERS = {
    "sigmoid_group": routers.SigmoidGroupTopK(K, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    "softmax": routers.SoftmaxTopK(K, renormalize=True),
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("layout", ["replicated", "sharded"])
@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4), (2, 2, 2)], ids=["ep", "dp-ep", "dp-ep-tp"])
def test_layer_matches_the_float64_model(router, layout, mesh_shape):
    names = {1: ("ep",), 2: ("dp", "ep"), 3: ("dp", "ep", "tp")}[len(mesh_shape)]
    mesh = _mesh(mesh_shape, names)
    tp = "tp" if "tp" in names else None
    data = tuple(a for a in names if a == "dp")
    token_axes = data + (("ep",) if layout == "sharded" else ())
    shards = int(np.prod([dict(zip(names, mesh_shape))[a] for a in token_axes])) if token_axes else 1
    rng = np.random.default_rng(len(mesh_shape) * 10 + len(layout))
    p = _params(rng, latent=True, shared=True, bias=router == "sigmoid_group")
    layer = MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I, router=ROUTERS[router], latent=L,
                     shared_intermediate=IS, norm=True, tp_axis=tp, token_axes=token_axes, max_tokens=8)
    tokens = 3 * shards if layout == "sharded" else 6 * shards  # 6 tokens a data shard over 4 EP ranks: uneven
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    xs = jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, P(token_axes or None)))
    got, pairs, _ = jax.jit(lambda x, p: layer(x, p, with_pairs=True))(xs, p)
    ids, w = _route_model(ROUTERS[router], x, p)
    want = layer_model.layer(x, p, ids, w, ranks=layer.ranks, norm=True, eps=layer.eps, latent=True, shared=True)
    _check(got, want)
    # every token's expert work once: one pair per (token, distinct expert), over the whole mesh's data shards
    distinct = sum(len(set(row)) for row in ids.tolist())
    assert int(pairs) == distinct


#: The implementation the layer runs each checkpoint format on in `test_quantized_weights_over_tp` (FP8 kept
#: `[out, in]`, `expert_weights(..., impl="gmm")`: the layout the FP8 tensor cores take).
FORMAT_IMPLS = {"fp8-out-in": "gmm", "mxfp4": "ragged_dot", "int8": "ragged_dot"}


@pytest.mark.parametrize("fmt,impl", [("bf16", "ragged_dot"), ("fp8", "ragged_dot"), ("fp8-out-in", "gmm"),
                                      ("mxfp4", "ragged_dot"), ("mxfp4", "gmm"), ("int8", "ragged_dot")])
def test_weight_formats(fmt, impl):
    mesh = _mesh((4,), ("ep",))
    rng = np.random.default_rng({"bf16": 1, "fp8": 2, "fp8-out-in": 2, "mxfp4": 4, "int8": 3}[fmt])
    p = _params(rng, fmt=fmt, latent=True)  # L = 128: FP8 blocks are 128 x 128
    if fmt == "fp8-out-in":
        assert isinstance(p["w_down"], experts.BlockScaledOutIn)
    layer = MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I, router=ROUTERS["softmax"], latent=L,
                     norm=True, max_tokens=4, impl=impl)
    x = rng.standard_normal((5, D)).astype(np.float32)  # 5 tokens on 4 ranks (replicated over ep)
    got = jax.jit(layer)(jnp.asarray(x, jnp.bfloat16), p)
    ids, w = _route_model(ROUTERS["softmax"], x, p)
    _check(got, layer_model.layer(x, p, ids, w, ranks=4, norm=True, eps=layer.eps, latent=True))


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8-out-in", "int8"])
def test_quantized_weights_over_tp(fmt):
    """Quantized weights split over a TP axis (`param_specs`: MXFP4 and `[out, in]` FP8 keep the checkpoint's
    layout, so `I` is another dim of their values and scales) against the float64 model."""
    mesh = _mesh((2, 2, 2), ("dp", "ep", "tp"))
    rng = np.random.default_rng({"mxfp4": 5, "fp8-out-in": 7, "int8": 6}[fmt])
    inter = 2 * I if fmt == "fp8-out-in" else I  # a rank's I / TP: whole 128 x 128 FP8 blocks
    p = _params(rng, fmt=fmt, latent=True, inter=inter)
    layer = MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=inter, router=ROUTERS["softmax"], latent=L,
                     norm=True, tp_axis="tp", token_axes=("dp",), max_tokens=4, impl=FORMAT_IMPLS[fmt])
    x = rng.standard_normal((6, D)).astype(np.float32)
    got = jax.jit(layer)(jnp.asarray(x, jnp.bfloat16), layer.shard_params(p))
    ids, w = _route_model(ROUTERS["softmax"], x, p)
    _check(got, layer_model.layer(x, p, ids, w, ranks=2, norm=True, eps=layer.eps, latent=True))


def test_replicated_layout_does_each_tokens_work_once():
    """The replicated layout splits the tokens over the EP ranks: the pairs planned over all ranks are the distinct
    (token, expert) pairs, not N times them (what the same tokens sent from every rank would cost)."""
    mesh = _mesh((4,), ("ep",))
    rng = np.random.default_rng(11)
    p = _params(rng)
    x = jnp.asarray(rng.standard_normal((7, D)), jnp.bfloat16)
    layer = MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I, router=ROUTERS["softmax"], max_tokens=8)
    y, pairs, dropped = jax.jit(lambda x, p: layer(x, p, with_pairs=True))(x, p)
    ids, _ = _route_model(ROUTERS["softmax"], np.asarray(x, np.float32), p)
    assert int(pairs) == sum(len(set(r)) for r in ids.tolist()) and int(dropped) == 0
    # inside the model's own shard_map, tokens replicated over ep: found from the varying axes (check_vma=True)
    p = layer.shard_params(p)
    inner = jax.jit(jax.shard_map(lambda x, p: layer(x, p, with_pairs=True), mesh=mesh,
                                  in_specs=(P(), layer.param_specs(p)), out_specs=(P(), P(), P())))
    y2, pairs2, _ = inner(x, p)
    assert int(pairs2) == int(pairs)
    np.testing.assert_array_equal(np.asarray(y2).view(np.uint16), np.asarray(y).view(np.uint16))


def test_layout_must_be_named_without_check_vma():
    mesh = _mesh((4,), ("ep",))
    rng = np.random.default_rng(12)
    p = _params(rng)
    layer = MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I, router=ROUTERS["softmax"], max_tokens=8)
    p = layer.shard_params(p)
    f = lambda t: jax.jit(jax.shard_map(lambda x, p: layer(x, p, tokens=t), mesh=mesh,  # noqa: E731
                                        in_specs=(P(), layer.param_specs(p)), out_specs=P(), check_vma=False))
    x = jnp.asarray(rng.standard_normal((6, D)), jnp.bfloat16)
    with pytest.raises(ValueError, match="cannot tell whether x is sharded or replicated over 'ep'"):
        f("auto")(x, p)
    got = f("replicated")(x, p)
    want = jax.jit(layer)(x, p)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_given_routing_and_bad_input():
    mesh = _mesh((2,), ("ep",))
    rng = np.random.default_rng(13)
    p = _params(rng)
    layer = MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I, max_tokens=4)
    x = rng.standard_normal((2, 3, D)).astype(np.float32)  # [B, S, D]
    ids = rng.integers(-1, E, (2, 3, K)).astype(np.int32)
    w = rng.random((2, 3, K)).astype(np.float32)
    got = jax.jit(layer)(jnp.asarray(x, jnp.bfloat16), p, ids, w)
    assert got.shape == (2, 3, D)
    want = layer_model.layer(x.reshape(6, D), p, ids.reshape(6, K), w.reshape(6, K), ranks=2)
    _check(np.asarray(got).reshape(6, D), want)
    with pytest.raises(ValueError, match="give both ids and weights, or neither"):
        layer(x, p)
    with pytest.raises(ValueError, match=r"exceed the largest bucket 4"):
        jax.jit(layer)(jnp.zeros((10, D), jnp.bfloat16), p, jnp.zeros((10, K), jnp.int32), jnp.zeros((10, K)))
    with pytest.raises(ValueError, match=r"the format float16 is not supported"):
        expert_weights(jnp.zeros((E, I, D), jnp.float16))


def test_buckets_follow_the_call():
    """One layer serves every T: each call runs on the smallest bucket that holds it (its own receive rows)."""
    mesh = _mesh((2,), ("ep",))
    layer = MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I, router=ROUTERS["softmax"], max_tokens=128)
    assert layer.buckets == (1, 2, 4, 8, 16, 32, 64, 128)
    rows = {b: ep.rows for b, ep in layer.eps_by_bucket.items()}
    assert rows[1] == 2 * 8 and rows[128] == 2 * 128
    rng = np.random.default_rng(14)
    p = _params(rng)
    f = jax.jit(layer)
    for t in (1, 2, 5):  # replicated over ep: ceil(t / 2) tokens a rank
        x = rng.standard_normal((t, D)).astype(np.float32)
        ids, w = _route_model(ROUTERS["softmax"], x, p)
        _check(f(jnp.asarray(x, jnp.bfloat16), p), layer_model.layer(x, p, ids, w, ranks=2))


def test_small_calls_cost_their_bucket():
    """A layer serving up to 128 tokens compiles T = 1 to the program of a layer built for T = 1 alone (the same
    operations and bytes, from the compiled cost analysis), not to the 128-token one."""
    mesh = _mesh((2,), ("ep",))
    p = _params(np.random.default_rng(15))
    make = lambda mt, buckets=None: MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I,  # noqa: E731
                                             router=ROUTERS["softmax"], max_tokens=mt, buckets=buckets)
    x = jnp.zeros((2, D), jnp.bfloat16)  # replicated over ep: 1 token a rank

    def cost(layer):
        c = jax.jit(layer).lower(x, p).compile().cost_analysis()
        c = c[0] if isinstance(c, (list, tuple)) else c
        return c["flops"], c["bytes accessed"]

    served, alone, unbucketed = cost(make(128)), cost(make(1)), cost(make(128, [128]))
    assert served == alone
    assert unbucketed[0] > 8 * served[0], (unbucketed, served)


def _jax_reference(x, p, ids, w, *, latent, norm, eps):
    """The layer in plain JAX on one device (every expert on every token, FP32), the MXFP8 round trip of the
    dispatched rows with a straight-through gradient (as the layer's `dispatch(dequantize=True)`)."""
    from jax_latent_ep.numerics import mxfp8_dequantize, mxfp8_quantize

    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    xb = x.astype(jnp.bfloat16)
    a = (f32(xb) @ f32(p["latent_down"])).astype(jnp.bfloat16) if latent else xb
    a = f32(a) + jax.lax.stop_gradient(f32(mxfp8_dequantize(*mxfp8_quantize(a))) - f32(a))
    g = jnp.einsum("tl,eli->tei", a, f32(p["w_gate"]))
    u = jnp.einsum("tl,eli->tei", a, f32(p["w_up"]))
    h = f32((jax.nn.silu(g) * u).astype(jnp.bfloat16))
    y = jnp.einsum("tei,eil->tel", h, f32(p["w_down"]))
    onehot = (ids[..., None] == jnp.arange(E)) * w[..., None]  # [T, K, E]
    out = jnp.einsum("tke,tel->tl", onehot, y).astype(jnp.bfloat16)
    if norm:
        o = f32(out)
        out = (o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + eps) * f32(p["norm"])).astype(jnp.bfloat16)
    yf = f32(out) @ f32(p["latent_up"]) if latent else f32(out)
    sg, su = f32(xb) @ f32(p["shared_gate"]), f32(xb) @ f32(p["shared_up"])
    yf = yf + f32((jax.nn.silu(sg) * su).astype(jnp.bfloat16)) @ f32(p["shared_down"])
    return yf.astype(jnp.bfloat16)


@pytest.mark.parametrize("impl", ["ragged_dot", "gmm"])
@pytest.mark.parametrize("mesh_shape,layout", [((4,), "replicated"), ((2, 2, 2), "sharded")],
                         ids=["ep-replicated", "dp-ep-tp-sharded"])
def test_training_is_the_same_call(mesh_shape, layout, impl):
    """`jax.grad` through the layer (the router's choice held fixed: ids and weights given; the weights'
    gradient too) against `jax.grad` of the plain-JAX layer: relative L2 within 2e-2 per gradient (the layer rounds each rank's partial and the
    routed sum to bf16 where the reference sums in FP32; "gmm" rounds its grouped matmuls' outputs too)."""
    names = {1: ("ep",), 3: ("dp", "ep", "tp")}[len(mesh_shape)]
    mesh = _mesh(mesh_shape, names)
    data = tuple(a for a in names if a == "dp") + (("ep",) if layout == "sharded" else ())
    # all on the CPU, in FP32: a GPU's XLA drops the reference's bf16 round trips (excess precision), uses TF32
    with jax.default_device(jax.devices("cpu")[0]), jax.default_matmul_precision("highest"):
        rng = np.random.default_rng(41)
        p = _params(rng, latent=True, shared=True)
        layer = MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I, latent=L, shared_intermediate=IS,
                         norm=True, tp_axis="tp" if "tp" in names else None, token_axes=data, max_tokens=8, impl=impl)
        x = jnp.asarray(rng.standard_normal((8, D)), jnp.float32)
        ids = jnp.asarray(rng.integers(-1, E, (8, K)), jnp.int32)
        w = jnp.asarray(rng.random((8, K)), jnp.float32)
        target = jnp.asarray(rng.standard_normal((8, D)), jnp.float32)
        loss = lambda y: jnp.sum((y.astype(jnp.float32) - target) ** 2)  # noqa: E731
        got = jax.jit(jax.grad(lambda x, p, w: loss(layer(x, p, ids, w)), argnums=(0, 1, 2)))(x, p, w)
        ref = jax.jit(jax.grad(lambda x, p, w: loss(_jax_reference(x, p, ids, w, latent=True, norm=True,
                                                                   eps=layer.eps)), argnums=(0, 1, 2)))(x, p, w)
    keys = ("w_gate", "w_down", "latent_down", "latent_up", "norm", "shared_up")
    for name, g, r in [("x", got[0], ref[0]), ("routing weights", got[2], ref[2])] + [(k, got[1][k], ref[1][k])
                                                                                     for k in keys]:
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.any(r != 0), name
        rel = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert rel < 2e-2, (name, rel)


def test_capacity_factor_counts_what_it_drops():
    """A layer whose plans hold a quarter of the uniform expectation drops pairs and says how many: the pairs
    computed and dropped add up to the distinct (token, expert) pairs; with the default policy it raises."""
    mesh = _mesh((4,), ("ep",))
    rng = np.random.default_rng(51)
    p = _params(rng)
    x = jnp.asarray(rng.standard_normal((16, D)), jnp.bfloat16)
    make = lambda **kw: MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I,  # noqa: E731
                                 router=ROUTERS["softmax"], max_tokens=4, capacity_factor=0.25, **kw)
    y, pairs, dropped = jax.jit(lambda x, p: make(overflow="drop")(x, p, with_pairs=True))(x, p)
    ids, _ = _route_model(ROUTERS["softmax"], np.asarray(x, np.float32), p)
    assert int(dropped) > 0 and int(pairs) + int(dropped) == sum(len(set(r)) for r in ids.tolist())
    from jax_latent_ep import host_checks

    with pytest.raises(experts.CapacityError, match="over its capacity of 4"):
        host_checks.checked(jax.jit(make()))(x, p)
