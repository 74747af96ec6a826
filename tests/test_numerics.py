"""MXFP8 and RMSNorm in jnp against an independent NumPy model of numerics.md (float64 + ml_dtypes)."""

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_latent_ep import numerics

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
R = np.frombuffer(np.uint32(0x3B124925).tobytes(), np.float32)[0]
TINY = 2.0**-126


def ref_quantize(x):
    """NumPy model of numerics.md: the literal algorithm in IEEE float32 (no FTZ mode: flushes are explicit),
    elements through ml_dtypes' direct float32 -> e4m3 rounding. Non-finite blocks: sf 255, q = e4m3(x * 0)."""
    x = np.asarray(x, BF16)
    rows, width = x.reshape(-1, x.shape[-1]).shape
    values = x.reshape(rows, width // 32, 32).astype(np.float64)
    nonfinite = ~np.isfinite(values).all(axis=-1)
    values = np.where(np.abs(values) < TINY, np.copysign(0.0, values), values)
    with np.errstate(invalid="ignore"):
        amax = np.nan_to_num(np.abs(values), nan=0.0, posinf=0.0).max(axis=-1).astype(np.float32)
    s = (amax * R).astype(np.float32)
    s = np.where(s < TINY, np.float32(0), s)
    bits = s.view(np.uint32)
    biased = (bits >> 23) & 0xFF
    e = np.where(biased == 0, 0, np.minimum(254, biased + ((bits & 0x7FFFFF) != 0))).astype(np.int64)
    e = np.where(nonfinite, 255, e)
    inv = np.where((e == 0) | (e == 255), 0.0, np.ldexp(1.0, 127 - e))
    with np.errstate(invalid="ignore"):
        p = values * inv[..., None]  # exact: a power of two times an 8-bit mantissa
    p = np.where(np.abs(p) < TINY, np.copysign(0.0, p), p)
    q = np.clip(p, -448.0, 448.0).astype(np.float32).astype(E4M3)
    return q.reshape(x.shape), e.astype(np.uint8).reshape(*x.shape[:-1], width // 32)


def closed_form_exponent(amax):
    """e = min(254, ceil(log2(amax / 448)) + 127), exactly, for amax >= 448 * 2^-126 (numerics.md)."""
    amax = np.asarray(amax, np.float64)
    k = np.floor(np.log2(amax / 448.0)).astype(np.int64)
    for _ in range(2):  # fix float64 log2 rounding with exact comparisons: smallest k with 448 * 2^k >= amax
        k = np.where(np.ldexp(448.0, k) < amax, k + 1, k)
        k = np.where(np.ldexp(448.0, k - 1) >= amax, k - 1, k)
    return np.minimum(254, k + 127)


def bits8(a):
    return np.asarray(a).view(np.uint8)


def quantize(x):
    q, sf = numerics.mxfp8_quantize(jnp.asarray(x, jnp.bfloat16))
    return np.asarray(q), np.asarray(sf)


def test_every_finite_bf16_block_maximum():
    # One block per positive finite bf16 value: that value (random sign) at a random position, the rest
    # random values no larger.
    rng = np.random.default_rng(0)
    top_bits = np.arange(1, 0x7F80, dtype=np.uint16)
    top = top_bits.view(BF16).astype(np.float64)
    fill = rng.uniform(-1, 1, (top.size, 32)) * top[:, None]
    where = rng.integers(0, 32, top.size)
    fill[np.arange(top.size), where] = top * rng.choice([-1.0, 1.0], top.size)
    x = fill.astype(BF16)
    q, sf = quantize(x)
    ref_q, ref_sf = ref_quantize(x)
    np.testing.assert_array_equal(sf, ref_sf)
    np.testing.assert_array_equal(bits8(q), bits8(ref_q))
    normal = top >= 448.0 * TINY
    np.testing.assert_array_equal(sf[normal, 0], closed_form_exponent(top[normal]))
    assert (sf[top < 448.0 * 2.0**-127, 0] == 0).all()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_rows_kimi_width(seed):
    rng = np.random.default_rng(seed)
    # Values spread over many binades, per-block magnitudes from tiny to huge.
    mags = np.exp2(rng.integers(-140, 120, (64, 3584 // 32, 1)))
    x = (rng.standard_normal((64, 3584 // 32, 32)) * mags).reshape(64, 3584).astype(BF16)
    q, sf = quantize(x)
    ref_q, ref_sf = ref_quantize(x)
    np.testing.assert_array_equal(sf, ref_sf)
    np.testing.assert_array_equal(bits8(q), bits8(ref_q))
    assert len(np.unique(sf)) > 100  # really exercised many scales


def test_tiny_amax_blocks_with_subnormals():
    rng = np.random.default_rng(4)
    blocks = []
    for top_exp in range(-133, -110):  # around 448 * 2^-116 and below 2^-126: FP32 and BF16 subnormals
        block = rng.standard_normal(32) * 2.0**top_exp
        block[rng.integers(0, 32, 4)] = rng.choice([1, -1], 4) * 2.0 ** rng.integers(-140, -127, 4)
        blocks.append(block)
    x = np.array(blocks).astype(BF16)
    q, sf = quantize(x)
    ref_q, ref_sf = ref_quantize(x)
    np.testing.assert_array_equal(sf, ref_sf)
    np.testing.assert_array_equal(bits8(q), bits8(ref_q))
    assert (sf == 0).any() and (sf > 0).any()
    # a block of only BF16 subnormals flushes to zero with scale 0
    sub = (np.arange(1, 33, dtype=np.uint16)).view(BF16).reshape(1, 32)
    q, sf = quantize(sub)
    assert sf[0, 0] == 0 and (q.astype(np.float32) == 0).all()


def test_power_of_two_boundaries():
    amaxes = []
    for k in range(-115, 120):
        center = np.float64(BF16(448.0 * 2.0**k))
        below = np.nextafter(BF16(center), BF16(0))
        above = np.nextafter(BF16(center), BF16(np.inf))
        amaxes += [center, np.float64(below), np.float64(above)]
    amaxes = np.array(amaxes)
    x = np.zeros((amaxes.size, 32))
    x[:, 7] = amaxes
    x[:, 0] = -amaxes / 3
    x = x.astype(BF16)
    q, sf = quantize(x)
    ref_q, ref_sf = ref_quantize(x)
    np.testing.assert_array_equal(sf, ref_sf)
    np.testing.assert_array_equal(bits8(q), bits8(ref_q))
    finite_top = x[:, 7].astype(np.float64)
    np.testing.assert_array_equal(sf[:, 0], closed_form_exponent(finite_top))
    # The block maximum always lands within e4m3's range, at most 448.
    assert (np.abs(q[:, 7].astype(np.float32)) <= 448).all()


def test_dequantize_round_trip_error():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 3584)) * 3).astype(BF16)
    q, sf = numerics.mxfp8_quantize(jnp.asarray(x))
    back = np.asarray(numerics.mxfp8_dequantize(q, sf))
    sf = np.asarray(sf)
    ref = x.astype(np.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for values in the normal range of the block
    # (e4m3 subnormals, below 2^-6 of the scale, have an absolute error of at most half of 2^-9).
    scale = np.repeat(np.exp2(sf.astype(np.float64) - 127), 32, axis=-1)
    err = np.abs(back - ref)
    assert (err <= np.maximum(np.abs(ref) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)).all()


def test_nonfinite_blocks_stay_visible_and_local():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 256)).astype(BF16)
    clean_q, clean_sf = quantize(x)
    bad = x.copy()
    bad[0, 40] = np.nan  # block 1 of row 0
    bad[1, 255] = np.inf  # block 7 of row 1
    bad[2, 0] = -np.inf  # block 0 of row 2
    q, sf = quantize(bad)
    ref_q, ref_sf = ref_quantize(bad)
    np.testing.assert_array_equal(sf, ref_sf)
    assert sf[0, 1] == sf[1, 7] == sf[2, 0] == 255
    back = np.asarray(numerics.mxfp8_dequantize(q, sf))
    poisoned = np.zeros(back.shape, bool)
    poisoned[0, 32:64] = poisoned[1, 224:256] = poisoned[2, 0:32] = True
    assert np.isnan(back[poisoned]).all()
    # everything else is exactly what the clean input gives
    mask = np.ones_like(sf, bool)
    mask[0, 1] = mask[1, 7] = mask[2, 0] = False
    np.testing.assert_array_equal(sf[mask], clean_sf[mask])
    np.testing.assert_array_equal(bits8(q)[~poisoned], bits8(clean_q)[~poisoned])


def test_quantize_under_jit_and_batched_leading_dims():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 64)).astype(BF16)
    q, sf = jax.jit(numerics.mxfp8_quantize)(jnp.asarray(x))
    ref_q, ref_sf = ref_quantize(x)
    assert q.shape == (2, 3, 64) and sf.shape == (2, 3, 2)
    np.testing.assert_array_equal(bits8(np.asarray(q)), bits8(ref_q))
    np.testing.assert_array_equal(np.asarray(sf), ref_sf)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="bfloat16"):
        numerics.mxfp8_quantize(jnp.zeros((2, 64), jnp.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        numerics.mxfp8_quantize(jnp.zeros((2, 48), jnp.bfloat16))
    with pytest.raises(ValueError, match="sf shape"):
        numerics.mxfp8_dequantize(jnp.zeros((2, 64), jnp.float8_e4m3fn), jnp.zeros((2, 3), jnp.uint8))


def ulp_distance_bf16(a, b):
    ai = np.asarray(a, BF16).view(np.int16).astype(np.int64)
    bi = np.asarray(b, BF16).view(np.int16).astype(np.int64)
    ai = np.where(ai < 0, -(ai & 0x7FFF), ai)
    bi = np.where(bi < 0, -(bi & 0x7FFF), bi)
    return np.abs(ai - bi)


@pytest.mark.parametrize("width", [3584, 7168, 512])
def test_rms_norm_within_one_ulp(width):
    rng = np.random.default_rng(width)
    x = (rng.standard_normal((32, width)) * rng.uniform(0.01, 50, (32, 1))).astype(BF16)
    w = rng.uniform(0.5, 2.0, width).astype(BF16)
    y = np.asarray(jax.jit(numerics.rms_norm)(jnp.asarray(x), jnp.asarray(w), 1e-5))
    v = x.astype(np.float64)
    rstd = 1.0 / np.sqrt((v * v).sum(-1, keepdims=True) / width + 1e-5)
    ref = (v * rstd * w.astype(np.float64)).astype(np.float32).astype(BF16)
    dist = ulp_distance_bf16(y, ref)
    assert dist.max() <= 1
    assert (dist == 0).mean() > 0.95  # 1-ulp differences are rare
