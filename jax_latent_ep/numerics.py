"""MXFP8 quantization and RMSNorm in jnp, bit for bit as `numerics.md` defines them (and as the kernels compute).

Every step that could depend on the machine's denormal mode (XLA on CPU flushes subnormals, GPUs may not)
is done on the bits, so the results are the same on every backend:

  amax  = max_i |x_i|                                   (on the bf16 bits: exact)
  s     = ftz(rn_f32(amax * R)),  R = rn_f32(1/448) = 0x3B124925
  e     = 0 if s == 0 else min(254, biased_exponent(s) + (mantissa(s) != 0))
  inv   = 0 if e == 0 else 2^(127 - e)
  q_i   = e4m3_rne_satfinite(ftz(ftz(x_i) * inv))

Non-finite input (the project's choice, numerics.md leaves it to us): a 32-block holding any NaN or Inf gets
the scale byte 255 (E8M0's NaN) and `inv = 0`, so its elements quantize to `e4m3(x * 0)` (NaN where `x` is
not finite, a signed zero elsewhere) and the whole block dequantizes to NaN; other blocks are untouched.
The CuTe DSL dispatch kernel implements the same rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_latent_ep.kernels.abi import MX_BLOCK

#: rn_f32(1 / 448): the reciprocal of e4m3's largest finite value, as the quantizer multiplies by it.
RECIPROCAL_448_BITS = 0x3B124925
E8M0_NAN = 255
E4M3_MAX = 448.0


def _check_latent(x, name: str):
    if x.ndim < 1 or x.shape[-1] % MX_BLOCK:
        raise ValueError(f"{name} must have a last dimension that is a multiple of {MX_BLOCK}, got shape {x.shape}")


def _f32_from_bits(bits):
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def _bits_from_f32(value):
    return lax.bitcast_convert_type(value, jnp.uint32)


def _flush_f32(value):
    """Sign-preserving flush of FP32 subnormals to zero, on the bits."""
    bits = _bits_from_f32(value)
    subnormal = (bits & jnp.uint32(0x7F800000)) == 0
    return _f32_from_bits(jnp.where(subnormal, bits & jnp.uint32(0x80000000), bits))


def mxfp8_scale_exponent(amax_bits_bf16):
    """E8M0 exponent `e` (uint32) of blocks whose |max| has the bf16 bits `amax_bits_bf16` (uint16, sign clear)."""
    amax = _f32_from_bits(amax_bits_bf16.astype(jnp.uint32) << 16)
    scaled = _flush_f32(amax * _f32_from_bits(jnp.uint32(RECIPROCAL_448_BITS)))
    bits = _bits_from_f32(scaled)
    biased = (bits >> 23) & 0xFF
    rounded_up = biased + ((bits & jnp.uint32(0x7FFFFF)) != 0).astype(jnp.uint32)
    return jnp.where(biased == 0, jnp.uint32(0), jnp.minimum(rounded_up, jnp.uint32(254)))


@jax.jit
def mxfp8_quantize(x):
    """MXFP8 quantization of BF16 rows (FlashInfer's `mxfp8_quantize`, linear scale layout, flush to zero).

    Args:
      x: bfloat16 `[..., L]`, `L` a multiple of 32.

    Returns:
      `(q, sf)`: `q` float8_e4m3fn `[..., L]`, the elements; `sf` uint8 `[..., L // 32]`, the E8M0 exponent
      of each 32-element block (dequantized value `f32(q) * 2^(sf - 127)`).

    Raises:
      ValueError: if `x` is not bfloat16 or its last dimension is not a multiple of 32.
    """
    x = jnp.asarray(x)
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"mxfp8_quantize expects bfloat16, got {x.dtype}")
    _check_latent(x, "x")
    lead, width = x.shape[:-1], x.shape[-1]
    bits = lax.bitcast_convert_type(x, jnp.uint16).reshape(*lead, width // MX_BLOCK, MX_BLOCK)
    exponent_bits = bits & 0x7F80
    nonfinite = jnp.any(exponent_bits == 0x7F80, axis=-1)
    # ftz(x): bf16 subnormals (exponent 0) become signed zeros.
    bits = jnp.where(exponent_bits == 0, bits & 0x8000, bits)
    amax_bits = jnp.max(bits & 0x7FFF, axis=-1)  # non-negative floats order like their bits
    e = mxfp8_scale_exponent(amax_bits)
    e = jnp.where(nonfinite, jnp.uint32(E8M0_NAN), e)
    # inv = 2^(127 - e) from the bits; 0 for empty blocks and for non-finite ones.
    inv_bits = jnp.where((e == 0) | (e >= 254), jnp.uint32(0), (jnp.uint32(254) - e) << 23)
    inv = _f32_from_bits(inv_bits)
    values = _f32_from_bits(bits.astype(jnp.uint32) << 16)
    scaled = _flush_f32(values * inv[..., None])
    q = jnp.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(*lead, width), e.astype(jnp.uint8)


@jax.jit
def mxfp8_dequantize(q, sf):
    """Inverse of `mxfp8_quantize` up to its rounding: `f32(q) * 2^(sf - 127)` per 32-block.

    Args:
      q: float8_e4m3fn `[..., L]`.
      sf: uint8 `[..., L // 32]`.

    Returns:
      float32 `[..., L]`; NaN throughout blocks whose scale is 255 (non-finite input).
    """
    q, sf = jnp.asarray(q), jnp.asarray(sf)
    if q.dtype != jnp.float8_e4m3fn or sf.dtype != jnp.uint8:
        raise ValueError(f"mxfp8_dequantize expects (float8_e4m3fn, uint8), got ({q.dtype}, {sf.dtype})")
    _check_latent(q, "q")
    if sf.shape != q.shape[:-1] + (q.shape[-1] // MX_BLOCK,):
        raise ValueError(f"sf shape {sf.shape} does not match q shape {q.shape} (expected [..., L // 32])")
    lead, width = q.shape[:-1], q.shape[-1]
    # XLA may fold convert(convert(v, f8), f32) into v (excess precision): keep the rounding of q.
    q, sf = lax.optimization_barrier((q, sf))
    scale = _f32_from_bits(sf.astype(jnp.uint32) << 23)  # 2^(e - 127); e = 255 gives inf
    values = q.astype(jnp.float32).reshape(*lead, width // MX_BLOCK, MX_BLOCK) * scale[..., None]
    return values.reshape(*lead, width)


def rms_norm(x, weight, eps: float = 1e-5):
    """vLLM's RMSNorm with one final rounding: `bf16(f32(x) * rsqrt(mean(f32(x)^2) + eps) * f32(weight))`.

    Args:
      x: bfloat16 `[..., L]`.
      weight: bfloat16 `[L]`.
      eps: added to the mean square before the reciprocal square root.

    Returns:
      bfloat16 `[..., L]`. The sum of squares is accumulated in FP32 in XLA's order and the reciprocal square
      root is `lax.rsqrt`: against the kernel (its own summation order, `rsqrt.approx`) at most 1 BF16 ulp
      differs, on a small fraction of elements.
    """
    x, weight = jnp.asarray(x), jnp.asarray(weight)
    if x.dtype != jnp.bfloat16 or weight.dtype != jnp.bfloat16:
        raise ValueError(f"rms_norm expects bfloat16 x and weight, got {x.dtype} and {weight.dtype}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight shape {weight.shape} must be [L] = {x.shape[-1:]}")
    # XLA may fold convert(convert(v, bf16), f32) into v (excess precision): keep x's BF16 rounding.
    x = lax.optimization_barrier(x)
    values = x.astype(jnp.float32)
    total = jnp.sum(values * values, axis=-1, keepdims=True)
    rstd = lax.rsqrt(total / jnp.float32(x.shape[-1]) + jnp.float32(eps))
    return (values * rstd * weight.astype(jnp.float32)).astype(jnp.bfloat16)
