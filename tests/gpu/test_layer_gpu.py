"""`MoELayer` on one GPU (`@pytest.mark.gpu`): the nvlink backend at N = 1 at DeepSeek-V3's compiled shape (hidden
7168, 256 experts, top-8; a small I), with the grouped GEMM kernel and with `ragged_dot`, bf16 / FP8 / int8
weights, token counts across buckets, against the float64 NumPy model (`layer_model.assert_close`) and against the
XLA backend's layer with the same expert implementation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_latent_ep import routers
from jax_latent_ep.layer import MoELayer
from jax_latent_ep.testing import layer_model

pytestmark = pytest.mark.gpu

D, E, K, I = 7168, 256, 8, 128  # the shipped kernels' DeepSeek-V3 shape (L = D); I small: the model is float64
ROUTER = routers.SigmoidGroupTopK(K, n_group=8, topk_group=4, routed_scaling_factor=2.5)


@functools.cache
def _params(fmt):
    rng = np.random.default_rng({"bf16": 1, "fp8": 2, "int8": 3}[fmt])
    return layer_model.random_params(rng, hidden=D, experts=E, intermediate=I, fmt=fmt, shared_intermediate=I,
                                     bias=True)


def _layer(backend, impl):
    mesh = jax.make_mesh((1,), ("ep",), devices=[d for d in jax.devices() if d.platform == "gpu"][:1])
    return MoELayer(mesh, hidden=D, experts=E, topk=K, intermediate=I, router=ROUTER, shared_intermediate=I,
                    max_tokens=8, backend=backend, impl=impl)


@pytest.mark.parametrize("impl,fmt", [("kernel", "bf16"), ("kernel", "fp8"), ("ragged_dot", "bf16"),
                                      ("ragged_dot", "int8")])
def test_layer_nvlink_against_the_float64_model(impl, fmt):
    p = _params(fmt)
    layer = _layer("nvlink", impl)
    assert layer.backend == "nvlink"
    f = jax.jit(layer)
    rng = np.random.default_rng(len(impl) + len(fmt))
    for t in (1, 3, 8):  # buckets 1, 4, 8
        x = rng.standard_normal((t, D)).astype(np.float32)
        got = f(jnp.asarray(x, jnp.bfloat16), p)
        ids, w = layer_model.route(ROUTER, x, p)
        layer_model.assert_close(got, layer_model.layer(x, p, ids, w, ranks=1, shared=True))


def test_layer_nvlink_is_the_xla_layer():
    """The nvlink layer against the XLA backend's with the same expert implementation: their dispatch and combine
    give the same bits (tests/backends), but XLA picks each program's GEMM algorithms, which may move a bf16
    rounding of the experts' output by one ulp, so they agree within the model's tolerance, not bit for bit."""
    p = _params("bf16")
    x = jnp.asarray(np.random.default_rng(5).standard_normal((5, D)), jnp.bfloat16)
    got = jax.jit(_layer("nvlink", "ragged_dot"))(x, p)
    want = jax.jit(_layer("xla", "ragged_dot"))(x, p)
    layer_model.assert_close(got, want)
