"""Gradients through dispatch and combine (`jax_latent_ep.autodiff`): the sharded model against the one-device
reference with the same straight-through rule, padding and duplicate ids at the API, `check_grads` where no
quantization is in the path, the float8 path refused, and a few training steps (jit, scan, remat)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_devices
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

from jax_latent_ep import ExpertParallel, LatentMoEShape, moe
from jax_latent_ep.autodiff import mxfp8_round_trip, positive_zero
from jax_latent_ep.backends.xla import destination_mask
from jax_latent_ep.numerics import mxfp8_dequantize, rms_norm

SHAPE = LatentMoEShape(latent=64, experts=16, topk=4)
CFG = moe.MoEConfig(shape=SHAPE, hidden=32, intermediate=16, layers=2)
#: Replicated parameters' gradients are BF16 sums over ranks (a psum in shard_map, a scan's accumulation in the
#: reference) and a token's hidden-state gradient sums three BF16 contributions (router, down, residual) in an
#: order each program picks: a few BF16 ulps of the largest entry, carried into the earlier layer.
MODEL_RTOL = 2e-2


def _mesh(n):
    return jax.make_mesh((n,), ("ep",), devices=xla_devices(n))


def _put(mesh, a, axis):
    """`a` (or a tuple of arrays, with a tuple of axes) sharded over its first dimension by `axis` (None: replicated)."""
    if isinstance(a, tuple):
        return tuple(_put(mesh, v, ax) for v, ax in zip(a, axis))
    return jax.device_put(a, NamedSharding(mesh, P(axis) if axis else P()))


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def model_grads(n, t, seed, remat=False):
    """(sharded grads, reference grads, sharded loss, reference loss) of `sum(forward(params, h) * target)`."""
    mesh = _mesh(n)
    params = moe.init_params(jax.random.key(seed), CFG)
    h = jax.random.normal(jax.random.key(seed + 1), (n * t, CFG.hidden)).astype(jnp.bfloat16)
    target = jax.random.normal(jax.random.key(seed + 2), (n * t, CFG.hidden), jnp.float32)

    def loss_of(forward):
        return lambda p, h: jnp.sum(forward(p, h).astype(jnp.float32) * target)

    with ExpertParallel(mesh, "ep", max_tokens=t, shape=SHAPE, backend="xla") as ep:
        forward = moe.make_forward(ep, CFG, remat=remat)
        sharded = moe.shard_params(params, mesh, "ep")
        loss, grads = jax.jit(jax.value_and_grad(loss_of(forward)))(sharded, jax.device_put(h, NamedSharding(mesh, P("ep"))))
    one = mesh.devices.flat[0]
    want_loss, want = jax.jit(jax.value_and_grad(loss_of(moe.make_reference_forward(CFG, n))))(
        jax.device_put(params, one), jax.device_put(h, one))
    return jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, want), float(loss), float(want_loss)


@pytest.mark.parametrize("n,t", [(1, 3), (2, 3), (4, 2), (8, 2)])
def test_model_grads_match_one_device_reference(n, t):
    got, want, loss, want_loss = model_grads(n, t, seed=10 + n)
    figures = {k: (float(np.abs(np.float32(got[k]) - np.float32(want[k])).max()), _rel(got[k], want[k])) for k in want}
    print(f"N={n}: max abs / relative difference per parameter: " +
          ", ".join(f"{k} {a:.3g} / {r:.2g}" for k, (a, r) in sorted(figures.items())))
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss) + 1e-5
    for k in want:
        assert np.all(np.isfinite(np.float32(got[k]))), k
        assert np.abs(np.float32(want[k])).max() > 0, f"{k}: the reference's gradient is 0"
        assert figures[k][1] <= MODEL_RTOL, f"{k}: {figures[k]}"
    # The last layer's expert gradients (sharded, not summed over ranks) see the same cotangents in the same order.
    for k in ("w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(got[k][-1], want[k][-1], err_msg=k)


def _api_case(n, t, seed):
    """Random x, ids (with -1 padding and duplicate ids), weights, expert scales, norm weight, loss target."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, SHAPE.experts, (n, t, SHAPE.topk)).astype(np.int32)
    ids[:, 0, 1] = ids[:, 0, 0]  # a duplicate id
    ids[:, 1 % t, 2:] = -1  # padding: no expert
    ids[:, t - 1, :] = -1  # a token that reaches no rank
    ids[0, 0, 3] = ids[0, 0, 0]
    x = jnp.asarray(rng.standard_normal((n * t, SHAPE.latent)), jnp.bfloat16)
    w = jnp.asarray(rng.random((n * t, SHAPE.topk)), jnp.float32)
    scale = jnp.asarray(rng.standard_normal((SHAPE.experts, SHAPE.latent)), jnp.bfloat16)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(SHAPE.latent), jnp.bfloat16)
    target = jnp.asarray(rng.standard_normal((n * t, SHAPE.latent)), jnp.float32)
    return x, jnp.asarray(ids.reshape(n * t, -1)), w, scale, norm, target


def _coefficients(ids, w, experts):
    """f32 [R, len(experts)]: each row's summed weight of each expert (duplicates add up)."""
    return jnp.sum(jnp.where(ids[:, :, None] == experts[None, None, :], w[:, :, None], 0.0), axis=1)


def _api_loss_sharded(ep, n, target):
    local = SHAPE.num_local_experts(n)

    def body(x, ids, w, scale, norm, target):
        recv, xf = ep.dispatch(x, ids, w, dequantize=True)
        rank = jax.lax.axis_index("ep")
        coef = _coefficients(recv.ids, recv.weights, rank * local + jnp.arange(local))
        out = jnp.einsum("rj,jl,rl->rl", coef, scale.astype(jnp.float32), xf).astype(jnp.bfloat16)
        y = ep.combine(out, ids, norm)
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * target), "ep")

    f = jax.shard_map(body, mesh=ep.mesh, in_specs=(P("ep"), P("ep"), P("ep"), P("ep"), P(), P("ep")), out_specs=P())
    return lambda x, w, scale, norm, ids: f(x, ids, w, scale, norm, target)


def _api_loss_reference(n, t, target):
    """The same layer on one device: each token's partial on every rank it reaches, FP32 in ascending rank."""
    local = SHAPE.num_local_experts(n)

    def loss(x, w, scale, norm, ids):
        xf = mxfp8_round_trip(x)
        member = destination_mask(ids, SHAPE.experts, n)  # [N*T, N]
        acc = jnp.zeros(xf.shape, jnp.float32)
        for d in range(n):
            coef = _coefficients(ids, w, d * local + jnp.arange(local))
            part = jnp.einsum("rj,jl,rl->rl", coef, scale[d * local:(d + 1) * local].astype(jnp.float32), xf)
            acc = jnp.where(member[:, d, None], acc + part.astype(jnp.bfloat16).astype(jnp.float32), acc)
        y = rms_norm(jax.lax.optimization_barrier(positive_zero(acc).astype(jnp.bfloat16)), norm)
        return jnp.sum(y.astype(jnp.float32) * target)

    return loss


@pytest.mark.parametrize("n,t", [(2, 3), (4, 5)])
def test_api_grads_with_padding_and_duplicate_ids(n, t):
    x, ids, w, scale, norm, target = _api_case(n, t, seed=n)
    mesh = _mesh(n)
    with ExpertParallel(mesh, "ep", max_tokens=t + 1, shape=SHAPE, backend="xla") as ep:
        args = _put(mesh, (x, w, scale, norm, ids), ("ep", "ep", "ep", None, "ep"))
        got = jax.jit(jax.grad(_api_loss_sharded(ep, n, _put(mesh, target, "ep")), argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(_api_loss_reference(n, t, target), argnums=(0, 1, 2, 3)))(x, w, scale, norm, ids)
    for name, a, b in zip(("x", "weights", "scale", "norm"), got, want):
        assert np.abs(np.float32(b)).max() > 0, name
        # FP32 sums of up to N terms in another order, then one BF16 rounding (x, scale, norm): 1 BF16 ulp.
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=1e-2, atol=1e-2 * np.abs(np.float32(b)).max(),
                                   err_msg=name)
    dead = np.asarray(ids).reshape(n, t, -1)[:, t - 1]  # the token that reached no rank: no gradient
    assert np.all(dead == -1)
    np.testing.assert_array_equal(np.float32(got[0]).reshape(n, t, -1)[:, t - 1], 0)
    np.testing.assert_array_equal(np.float32(got[1]).reshape(n, t, -1)[:, t - 1], 0)


def test_check_grads_combine_and_rms_norm():
    """No quantization in combine's path: its VJP against numerical differences (BF16 inputs, so a coarse step
    and tolerance: the BF16 rounding of inputs and outputs is noise of 2^-9 relative, divided by the step; fixed seed)."""
    n, t = 2, 3
    mesh = _mesh(n)
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(-1, SHAPE.experts, (n * t, SHAPE.topk)), jnp.int32)
    with ExpertParallel(mesh, "ep", max_tokens=t, shape=SHAPE, backend="xla") as ep:
        def body(x, dw, o, i, w):  # o, i, w replicated (check_grads makes unsharded ones): each rank its block
            r = jax.lax.axis_index("ep")
            i = jax.lax.dynamic_slice_in_dim(i, r * t, t)
            recv = ep.dispatch(x, i, dw)  # the layer's dispatch: out scaled by its received weights derives from it
            o = jax.lax.dynamic_slice_in_dim(o, r * ep.rows, ep.rows) * recv.weights[:, :1].astype(o.dtype)
            return ep.combine(o, i, w).astype(jnp.float32)

        f = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 2 + (P(), P(), P()), out_specs=P("ep"))
        x0, w0 = _put(mesh, _api_case(n, t, seed=1)[:3:2], ("ep", "ep"))
        out = jnp.asarray(rng.standard_normal((n * ep.rows, SHAPE.latent)), jnp.float32)  # N*S rows a rank
        norm = jnp.asarray(1 + 0.1 * rng.standard_normal(SHAPE.latent), jnp.float32)
        g = jax.jit(lambda o, w: f(x0, w0, o.astype(jnp.bfloat16), ids, w.astype(jnp.bfloat16)))
        check_grads(g, (out, norm), order=1, modes=["rev"], eps=0.05, atol=5e-2, rtol=5e-2)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((5, SHAPE.latent)), jnp.float32)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(SHAPE.latent), jnp.float32)
    check_grads(lambda a, w: rms_norm(a.astype(jnp.bfloat16), w.astype(jnp.bfloat16)).astype(jnp.float32),
                (x, norm), order=1, modes=["rev"], eps=0.02, atol=5e-2, rtol=5e-2)


def test_gradient_through_float8_rows_is_refused():
    n, t = 2, 2
    mesh = _mesh(n)
    x, ids, w, _, _, _ = _api_case(n, t, seed=3)
    x, ids, w = _put(mesh, (x, ids, w), ("ep", "ep", "ep"))
    with ExpertParallel(mesh, "ep", max_tokens=t, shape=SHAPE, backend="xla") as ep:

        def body(x, ids, w):
            recv = ep.dispatch(x, ids, w)
            out = (mxfp8_dequantize(recv.x, recv.sf) * recv.weights[:, :1]).astype(jnp.bfloat16)
            return jax.lax.psum(jnp.sum(ep.combine(out, ids).astype(jnp.float32)), "ep")

        f = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P())
        with pytest.raises(ValueError, match=r"Received\.x .*dequantize=True"):
            jax.jit(jax.grad(f))(x, ids, w)
        # Only the weights' path: allowed, and not zero.
        gw = jax.jit(jax.grad(lambda w: f(jax.lax.stop_gradient(x), ids, w)))(w)
        assert np.abs(np.asarray(gw)).max() > 0


def test_training_steps_lower_the_loss():
    """jit + scan over layers + remat + value_and_grad, plain SGD: the loss goes down, and remat changes no
    gradient."""
    n, t = 2, 3
    mesh = _mesh(n)
    params = moe.init_params(jax.random.key(0), CFG)
    h = jax.random.normal(jax.random.key(1), (n * t, CFG.hidden)).astype(jnp.bfloat16)
    target = jax.random.normal(jax.random.key(2), (n * t, CFG.hidden), jnp.float32)
    with ExpertParallel(mesh, "ep", max_tokens=t, shape=SHAPE, backend="xla") as ep:
        forward = moe.make_forward(ep, CFG, scan=True, remat=True)
        plain = moe.make_forward(ep, CFG, scan=True)

        def loss_fn(p, h, fwd=forward):
            return jnp.mean((fwd(p, h).astype(jnp.float32) - target) ** 2)

        value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
        p, hs = moe.shard_params(params, mesh, "ep"), jax.device_put(h, NamedSharding(mesh, P("ep")))
        g_plain = jax.jit(jax.grad(lambda p, h: loss_fn(p, h, plain)))(p, hs)
        losses = []
        for i in range(5):
            loss, g = value_and_grad(p, hs)
            if i == 0:
                for k in g_plain:
                    np.testing.assert_array_equal(np.float32(g[k]), np.float32(g_plain[k]), err_msg=k)
            p = jax.tree.map(lambda a, b: (a.astype(jnp.float32) - 0.05 * b.astype(jnp.float32)).astype(a.dtype), p, g)
            losses.append(float(loss))
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
