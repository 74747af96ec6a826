"""`nnx_layer.MoEBlock`: the NNX module holds the layer's weights as sharded `nnx.Param`s, gives the layer's bits,
and trains through `nnx.grad` (the gradient of the expert weights against `jax.grad` of the layer function)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="flax is not installed (pip install .[flax])")

from jax_latent_ep import experts, routers  # noqa: E402
from jax_latent_ep.layer import MoELayer  # noqa: E402
from jax_latent_ep.nnx_layer import MoEBlock  # noqa: E402
from jax_latent_ep.testing import layer_model  # noqa: E402

D, E, K, I = 64, 16, 4, 128


def _layer(mesh, **kw):
    return MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I, router=routers.SoftmaxTopK(K),
                    shared_intermediate=I, max_tokens=8, **kw)


def test_block_is_the_layer_and_trains():
    mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices("cpu")[:4])
    layer = _layer(mesh)
    rng = np.random.default_rng(31)
    params = layer_model.random_params(rng, hidden=D, experts=E, intermediate=I, shared_intermediate=I)
    block = MoEBlock(layer, params)
    assert block.weights["w_gate"]["value"][...].sharding.spec[0] == "ep"  # each rank holds its experts
    x = jnp.asarray(rng.standard_normal((6, D)), jnp.bfloat16)
    got = nnx.jit(lambda b, x: b(x))(block, x)
    want = jax.jit(layer)(x, params)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))

    target = jnp.asarray(rng.standard_normal((6, D)), jnp.float32)
    loss = lambda y: jnp.mean((y.astype(jnp.float32) - target) ** 2)  # noqa: E731
    grads = nnx.jit(nnx.grad(lambda b: loss(b(x))))(block)  # under jit: ExpertParallel's VJP rule
    want = jax.jit(jax.grad(lambda p: loss(layer(x, p))))(params)
    for name in ("w_gate", "w_down", "shared_up", "router"):
        g = np.asarray(grads.weights[name]["value"][...], np.float32)
        assert np.any(g != 0), name
        np.testing.assert_array_equal(g, np.asarray(want[name], np.float32), err_msg=name)


def test_block_with_random_weights_and_fp8():
    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices("cpu")[:2])
    block = MoEBlock(_layer(mesh, latent=128), rngs=nnx.Rngs(0))
    assert block.params()["latent_down"].shape == (D, 128)
    rng = np.random.default_rng(32)
    p = layer_model.random_params(rng, hidden=D, experts=E, intermediate=I, fmt="fp8", latent=128,
                                  shared_intermediate=I)
    block = MoEBlock(_layer(mesh, latent=128), p)
    assert isinstance(block.params()["w_up"], experts.BlockScaled)
    x = rng.standard_normal((3, D)).astype(np.float32)
    got = nnx.jit(lambda b, x: b(x))(block, jnp.asarray(x, jnp.bfloat16))
    ids, w = layer_model.route(routers.SoftmaxTopK(K), x, p)
    layer_model.assert_close(got, layer_model.layer(x, p, ids, w, ranks=2, latent=True, shared=True))
    with pytest.raises(ValueError, match="give params, or rngs"):
        MoEBlock(_layer(mesh))
