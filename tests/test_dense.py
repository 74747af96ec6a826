"""The decode step's router and projections: `dense.matmul` against a float64 reference and its refusals;
`moe.top_k_softmax`'s sort-free method against `lax.top_k`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_latent_ep import dense, moe

IMPLS = ["xla", pytest.param("kernel", marks=pytest.mark.gpu)]


def _data(seed, t, k, n):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (t, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    return x, w


def _reference(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t,k,n", [(1, 7168, 896), (5, 1024, 3584), (64, 512, 192), (70, 256, 128)])
def test_matmul_against_float64(impl, t, k, n):
    x, w = _data(t + k + n, t, k, n)
    ref = _reference(x, w)
    got = np.asarray(jax.jit(lambda x, w: dense.matmul(x, w, impl=impl, out_dtype=jnp.float32))(x, w), np.float64)
    # FP32 accumulation of K bf16 products: a few FP32 ulps of the sum of magnitudes, whatever the order
    bound = 8 * k * 2.0**-24 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)))
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / bound)
    y = np.asarray(jax.jit(lambda x, w: dense.matmul(x, w, impl=impl))(x, w), np.float64)
    # rounded once to bf16: within one bf16 ulp (2^-8 relative) of the FP32 sum
    assert np.all(np.abs(y - got) <= 2.0**-8 * np.abs(got) + 1e-30)


@pytest.mark.gpu
@pytest.mark.parametrize("units", [1, 264, 4096])
def test_kernel_at_any_split_target(monkeypatch, units):
    """`dense.KERNEL_MIN_UNITS` changes only how the contraction is split (one split up to the rule's most): every
    target meets the same float64 bound."""
    monkeypatch.setattr(dense, "KERNEL_MIN_UNITS", units)
    test_matmul_against_float64("kernel", 1, 7168, 896)
    test_matmul_against_float64("kernel", 8, 3584, 7168)


@pytest.mark.gpu
def test_kernel_gradient_is_xlas():
    x, w = _data(3, 4, 512, 256)
    loss = lambda impl: lambda x, w: jnp.sum(dense.matmul(x, w, impl=impl, out_dtype=jnp.float32) ** 2)  # noqa: E731
    gk = jax.jit(jax.grad(loss("kernel"), argnums=(0, 1)))(x, w)
    gx = jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(x, w)
    for a, b in zip(gk, gx):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=1e-2)


def test_auto_takes_xla_off_gpus_and_past_the_rows():
    x, w = _data(1, 8, 128, 64)
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    assert dense.kernel_fits(x, w) == on_gpu
    big, _ = _data(2, dense.KERNEL_MAX_ROWS + 1, 128, 64)
    assert not dense.kernel_fits(big, w)
    np.testing.assert_array_equal(np.asarray(dense.matmul(big, w), np.float32),
                                  np.asarray(dense.matmul(big, w, impl="xla"), np.float32))


@pytest.mark.parametrize("bad,match", [
    (dict(impl="cublas"), "impl must be one of"),
    (dict(w_shape=(96, 64)), "needs x"),
    (dict(x_dtype=jnp.float32), "x must be bfloat16"),
    (dict(impl="kernel", w_shape=(128, 96), x_shape=(2, 128)), "multiples of 64"),
])
def test_refusals_name_the_bad_value(bad, match):
    x = jnp.zeros(bad.get("x_shape", (2, 128)), bad.get("x_dtype", jnp.bfloat16))
    w = jnp.zeros(bad.get("w_shape", (128, 64)), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        dense.matmul(x, w, impl=bad.get("impl", "xla"))


@pytest.mark.parametrize("t,e,k", [(1, 896, 16), (37, 896, 16), (5, 256, 8)])
def test_top_k_by_rank_is_top_k(t, e, k):
    logits = jax.random.normal(jax.random.key(t + e), (t, e), jnp.float32)
    logits = logits.at[:, 1::7].set(jnp.round(logits[:, 1::7] * 4) / 4)  # ties among the largest too
    logits = logits.at[:, 3].set(logits[:, 10])
    ids, w = jax.jit(lambda l: moe.top_k_softmax(l, k, "rank"))(logits)
    ref_ids, ref_w = moe.top_k_softmax(logits, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    # the same logits; the softmax fused into another kernel may evaluate exp differently: a few FP32 ulps
    np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=2.0**-20, atol=0)
    auto = jax.jit(lambda l: moe.top_k_softmax(l, k, "auto"))(logits)  # rank up to RANK_MAX_TOKENS, else top_k
    want = jax.jit(lambda l: moe.top_k_softmax(l, k, "rank" if t <= moe.RANK_MAX_TOKENS else "top_k"))(logits)
    np.testing.assert_array_equal(np.asarray(auto[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(auto[1]), np.asarray(want[1]))
    with pytest.raises(ValueError, match="'sort'"):
        moe.top_k_softmax(logits, k, "sort")
