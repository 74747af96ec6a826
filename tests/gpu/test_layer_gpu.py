"""`MoELayer` on one GPU (`@pytest.mark.gpu`): the nvlink backend at N = 1 with the grouped GEMM kernel and with
`ragged_dot`, bf16 / FP8 / int8 weights, token counts across buckets, against the float64 NumPy model
(`layer_model.assert_close`), and bit for bit the XLA backend's layer with the same expert implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_latent_ep import routers
from jax_latent_ep.layer import MoELayer
from jax_latent_ep.testing import layer_model

pytestmark = pytest.mark.gpu

D, E, K, I, IS, L = 256, 16, 4, 128, 128, 128
ROUTER = routers.SigmoidGroupTopK(K, n_group=4, topk_group=2, routed_scaling_factor=2.5)


def _layer(backend, impl):
    mesh = jax.make_mesh((1,), ("ep",), devices=[d for d in jax.devices() if d.platform == "gpu"][:1])
    return MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I, router=ROUTER, latent=L, norm=True,
                    shared_intermediate=IS, max_tokens=8, backend=backend, impl=impl)


@pytest.mark.parametrize("impl,fmt", [("kernel", "bf16"), ("kernel", "fp8"), ("ragged_dot", "bf16"),
                                      ("ragged_dot", "int8")])
def test_layer_nvlink_against_the_float64_model(impl, fmt):
    rng = np.random.default_rng(len(impl) * 10 + len(fmt))
    p = layer_model.random_params(rng, hidden=D, experts=E, intermediate=I, fmt=fmt, latent=L,
                                  shared_intermediate=IS, bias=True)
    layer = _layer("nvlink", impl)
    assert layer.backend == "nvlink"
    f = jax.jit(layer)
    for t in (1, 3, 8):  # buckets 1, 4, 8
        x = rng.standard_normal((t, D)).astype(np.float32)
        got = f(jnp.asarray(x, jnp.bfloat16), p)
        ids, w = layer_model.route(ROUTER, x, p)
        want = layer_model.layer(x, p, ids, w, ranks=1, norm=True, eps=layer.eps, latent=True, shared=True)
        layer_model.assert_close(got, want)


def test_layer_nvlink_is_the_xla_layer():
    """The backends' dispatch and combine give the same bits, so the layers do with the same expert implementation."""
    rng = np.random.default_rng(5)
    p = layer_model.random_params(rng, hidden=D, experts=E, intermediate=I, latent=L, shared_intermediate=IS)
    x = jnp.asarray(rng.standard_normal((5, D)), jnp.bfloat16)
    got = jax.jit(_layer("nvlink", "ragged_dot"))(x, p)
    want = jax.jit(_layer("xla", "ragged_dot"))(x, p)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
