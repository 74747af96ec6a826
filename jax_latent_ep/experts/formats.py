"""The expert weights' formats: bf16 arrays, `BlockScaled` FP8, `MXFP4`, `Int8PerChannel`; how XLA multiplies them;
checks."""

from __future__ import annotations

import functools

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_latent_ep.experts.planning import Plan
from jax_latent_ep.kernels import abi

#: Rows and columns of one FP8 weight block (one FP32 scale each).
FP8_BLOCK = abi.GEMM_FP8_SCALE_BLOCK
#: The largest float8_e4m3fn value (what `quantize_fp8` scales each block's largest magnitude to).
FP8_MAX = 448.0


class BlockScaled(NamedTuple):
    """FP8 expert weights with an FP32 scale per `FP8_BLOCK x FP8_BLOCK` block: the weight is
    `values[j, k, n] * scale[j, k // 128, n // 128]`. A checkpoint's `[out, in]` weight with its `weight_scale_inv`
    `[out / 128, in / 128]` is this transposed (`values = w.transpose(0, 2, 1)`, `scale = s.transpose(0, 2, 1)`).

    Attributes:
      values: float8_e4m3fn `[J, K, N]` (finite: NaN is not a weight).
      scale: float32 `[J, K / 128, N / 128]`.
    """

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)


def quantize_fp8(w) -> BlockScaled:
    """`w` `[J, K, N]` (K, N multiples of 128) as `BlockScaled`: each block's scale is its largest magnitude / 448
    (1 where the block is zero), its values `w / scale` rounded to float8_e4m3fn (nearest even)."""
    j, k, n = w.shape
    if k % FP8_BLOCK or n % FP8_BLOCK:
        raise ValueError(f"quantize_fp8: K={k} and N={n} must be multiples of {FP8_BLOCK}")
    blocks = w.astype(jnp.float32).reshape(j, k // FP8_BLOCK, FP8_BLOCK, n // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=(2, 4))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    values = (blocks / scale[:, :, None, :, None]).astype(jnp.float8_e4m3fn).reshape(j, k, n)
    return BlockScaled(values, scale)


def dequantize_fp8(w: BlockScaled):
    """FP32 `[J, K, N]`: `values * scale` of each block (one FP32 rounding a weight)."""
    j, k, n = w.values.shape
    blocks = w.values.astype(jnp.float32).reshape(j, k // FP8_BLOCK, FP8_BLOCK, n // FP8_BLOCK, FP8_BLOCK)
    return (blocks * w.scale[:, :, None, :, None]).reshape(j, k, n)


class BlockScaledOutIn(NamedTuple):
    """`BlockScaled` FP8 weights as checkpoints store them, `[out, in]` (K-major: what the FP8 tensor cores'
    `wgmma` takes): the weight `[j, k, n]` (the stage's `[J, in, out]`) is `values[j, n, k] * scale[j, n // 128,
    k // 128]`. `fp8_out_in` / `fp8_in_out` convert from / to `BlockScaled` (a transpose, no rounding).

    Attributes:
      values: float8_e4m3fn `[J, N, K]` (finite).
      scale: float32 `[J, N / 128, K / 128]`.
    """

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's `[J, K, N]`."""
        j, n, k = self.values.shape
        return (j, k, n)


def fp8_out_in(w: BlockScaled) -> BlockScaledOutIn:
    """`w` in the `[out, in]` layout (`BlockScaledOutIn`): the same weights."""
    return BlockScaledOutIn(jnp.swapaxes(w.values, 1, 2), jnp.swapaxes(w.scale, 1, 2))


def fp8_in_out(w: BlockScaledOutIn) -> BlockScaled:
    """`w` in the `[in, out]` layout (`BlockScaled`): the same weights."""
    return BlockScaled(jnp.swapaxes(w.values, 1, 2), jnp.swapaxes(w.scale, 1, 2))


#: Inputs of one MXFP4 scale (OCP MX block).
MX_BLOCK = 32
#: The e2m1 value of each of the 16 codes (bit 3 the sign; no NaN, no infinity).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class MXFP4(NamedTuple):
    """MXFP4 expert weights (OCP MX) as checkpoints store them, `[out, in]`: e2m1 codes two a byte and an E8M0 scale
    per `MX_BLOCK` inputs. The weight `[j, k, n]` (the stage's `[J, in, out]`) is
    `E2M1_VALUES[code(j, n, k)] * 2^(scale[j, n, k // 32] - 127)`, where `code(j, n, k)` is the low nibble of
    `values[j, n, k // 2]` for even `k` and the high one for odd `k`. Every such weight is exact in bf16 for scale
    codes up to 252 (253-254 overflow the largest values to infinity, 255 is NaN: never silently wrong).

    Attributes:
      values: uint8 `[J, N, K / 2]` (K a multiple of 32).
      scale: uint8 `[J, N, K / 32]`, E8M0 exponents (127 is 1).
    """

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's `[J, K, N]`."""
        j, n, half = self.values.shape
        return (j, 2 * half, n)


def _e8m0(code):
    """FP32 `2^(code - 127)` of uint8 E8M0 codes, built from its bits (exact; code 0 is the subnormal 2^-127)."""
    bits = jnp.where(code > 0, code.astype(jnp.uint32) << 23, jnp.uint32(1 << 22))
    return lax.bitcast_convert_type(bits, jnp.float32)


def quantize_mxfp4(w) -> MXFP4:
    """`w` `[J, K, N]` (K a multiple of 32) as `MXFP4`: each block of 32 inputs of one output takes the scale
    `2^(floor(log2(max |w|)) - 2)` (OCP MX: the largest e2m1 exponent is 2; 2^-127 for a zero block), its codes
    `w / scale` rounded to e2m1 (nearest even, saturating at 6)."""
    j, k, n = w.shape
    if k % MX_BLOCK:
        raise ValueError(f"quantize_mxfp4: K={k} must be a multiple of {MX_BLOCK}")
    blocks = jnp.swapaxes(w.astype(jnp.float32), 1, 2).reshape(j, n, k // MX_BLOCK, MX_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    e = jnp.where(amax > 0, jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - 2, -127.0)
    e = jnp.clip(e, -127, 127)
    # A zero block divides by 1: its subnormal scale may be flushed to 0 (0 / 0 would be NaN, code -0).
    divisor = jnp.where(amax > 0, _e8m0((e + 127).astype(jnp.uint8)), 1.0)
    scaled = jnp.clip(blocks / divisor[..., None], -6.0, 6.0)
    codes = lax.bitcast_convert_type(scaled.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8).reshape(j, n, k)
    return MXFP4(codes[..., 0::2] | (codes[..., 1::2] << 4), (e + 127).astype(jnp.uint8))


def dequantize_mxfp4(w: MXFP4, dtype=jnp.bfloat16):
    """`dtype` `[J, K, N]` (bf16: exact, `MXFP4`'s range): each code's e2m1 value times its block's scale."""
    j, k, n = w.shape
    codes = jnp.stack([w.values & 0xF, w.values >> 4], axis=-1).reshape(j, n, k)
    vals = jnp.asarray(E2M1_VALUES, jnp.float32)[codes.astype(jnp.int32)]
    scale = _e8m0(w.scale)
    vals = vals.reshape(j, n, k // MX_BLOCK, MX_BLOCK) * scale[..., None]
    return jnp.swapaxes(vals.reshape(j, n, k), 1, 2).astype(dtype)


class Int8PerChannel(NamedTuple):
    """int8 expert weights with an FP32 scale per output channel: the weight is `values[j, k, n] * scale[j, n]`.
    The products `a * values` are exact in FP32 (bf16 x 8-bit integers), summed in FP32, and each output column is
    multiplied by its scale once, after the sum. A checkpoint's `[out, in]` int8 weight with its `[out]` scale is
    this transposed (`values = w.transpose(0, 2, 1)`).

    Attributes:
      values: int8 `[J, K, N]`.
      scale: float32 `[J, N]`.
    """

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)


def _xla_operands(a, w):
    """`(a, w)` as an XLA dot takes them: bf16 as they are, FP8 weights dequantized to FP32 (and `a` widened), MXFP4
    dequantized to bf16 (exact), int8 values as bf16 (exact: |v| <= 128) with their scale left to `_column_scale`."""
    if isinstance(w, BlockScaled):
        return a.astype(jnp.float32), dequantize_fp8(w)
    if isinstance(w, MXFP4):
        return a, dequantize_mxfp4(w)
    if isinstance(w, Int8PerChannel):
        return a, w.values.astype(jnp.bfloat16)
    return a, w


def _column_scale(y, w, expert):
    """FP32 `y` `[..., N]` (a product with `w`'s values) times `w`'s per-output-channel scale of expert `expert`
    (an int array, `w.scale[expert]` `[..., N]` broadcasting against `y`), where `w` is `Int8PerChannel`; else `y`."""
    if isinstance(w, Int8PerChannel):
        return y * w.scale[expert]
    return y


class _Format(NamedTuple):
    """A weight format as `_check_weights` checks it."""

    cls: type | None  # the weights' class; None: a plain array
    label: str  # the format in the messages
    dtype: Any  # the dtype of its values
    values: Callable  # weight -> its values `[J, K, N]`
    check: Callable  # (name, weight, values' shape, J) -> None: the format's own checks (ValueError)


def _check_block_scales(name, a, shape, j, out_in=False):
    """The checks of `BlockScaled` weight `a` beyond its values (`shape`, the weight's `[J, K, N]`): `L` and `I`
    multiples of `FP8_BLOCK`, and a float32 scale per block, `[J, K / 128, N / 128]` (`out_in`: `[J, N / 128, K /
    128]`, `BlockScaledOutIn`'s)."""
    if shape[1] % FP8_BLOCK or shape[2] % FP8_BLOCK:
        raise ValueError(f"experts.swiglu: FP8 weights need L and I multiples of {FP8_BLOCK} (the block), "
                         f"got {name} {list(shape)}")
    blocks = (shape[1] // FP8_BLOCK, shape[2] // FP8_BLOCK)
    want = (j, *(blocks[::-1] if out_in else blocks))
    if tuple(a.scale.shape) != want or a.scale.dtype != jnp.float32:
        raise ValueError(f"experts.swiglu: {name} scale must be float32{list(want)} (one per {FP8_BLOCK} x "
                         f"{FP8_BLOCK} block{', [out, in]' if out_in else ''}), got "
                         f"{jnp.dtype(a.scale.dtype).name}{list(a.scale.shape)}")


def _check_mx_scales(name, a, shape, j):
    """The checks of `MXFP4` weight `a`: K a multiple of `MX_BLOCK`, uint8 codes `[J, N, K / 2]` (checked as the
    weight's `[J, K, N]` before this) and a uint8 scale `[J, N, K / 32]`."""
    want = (j, shape[2], shape[1] // MX_BLOCK)
    if shape[1] % MX_BLOCK or tuple(a.scale.shape) != want or a.scale.dtype != jnp.uint8:
        raise ValueError(f"experts.swiglu: {name} MXFP4 needs K={shape[1]} a multiple of {MX_BLOCK} and scale "
                         f"uint8{list(want)} (one E8M0 exponent per {MX_BLOCK} inputs of an output), got "
                         f"{jnp.dtype(a.scale.dtype).name}{list(a.scale.shape)}")


def _check_channel_scales(name, a, shape, j):
    """The checks of `Int8PerChannel` weight `a` beyond its values (`shape`): a float32 scale per output channel."""
    want = (j, shape[2])
    if tuple(a.scale.shape) != want or a.scale.dtype != jnp.float32:
        raise ValueError(f"experts.swiglu: {name} scale must be float32{list(want)} (one per output channel), got "
                         f"{jnp.dtype(a.scale.dtype).name}{list(a.scale.shape)}")


_BF16 = _Format(None, "bf16", jnp.bfloat16, lambda w: w, lambda name, a, shape, j: None)
_FP8 = _Format(BlockScaled, "BlockScaled FP8", jnp.float8_e4m3fn, lambda w: w.values, _check_block_scales)
_INT8 = _Format(Int8PerChannel, "Int8PerChannel", jnp.int8, lambda w: w.values, _check_channel_scales)
# MXFP4's codes are checked as the `[J, K, N]` weight they pack (`MXFP4.shape`).
_MXFP4 = _Format(MXFP4, "MXFP4", jnp.uint8, lambda w: jax.ShapeDtypeStruct(w.shape, w.values.dtype), _check_mx_scales)
# `[out, in]` FP8 is checked as the `[J, K, N]` weight it holds (`BlockScaledOutIn.shape`).
_FP8_OUT_IN = _Format(BlockScaledOutIn, "BlockScaledOutIn FP8", jnp.float8_e4m3fn,
                      lambda w: jax.ShapeDtypeStruct(w.shape, w.values.dtype),
                      functools.partial(_check_block_scales, out_in=True))
#: The weight formats, a plain bf16 array first (a weight of no other format's class); a call's weights share one.
_FORMATS = (_BF16, _FP8, _MXFP4, _INT8, _FP8_OUT_IN)
#: The formats XLA's implementations multiply (`[out, in]` FP8: the `gmm` and `wgmma` implementations).
XLA_FORMATS = (_BF16, _FP8, _MXFP4, _INT8)
#: The formats the "kernel" implementation multiplies (the others: XLA implementations only).
KERNEL_FORMATS = (_BF16, _FP8)


def _format(w) -> _Format:
    """The format of weight `w`: the one of `_FORMATS` whose class it is, else a plain bf16 array."""
    return next((f for f in _FORMATS[1:] if isinstance(w, f.cls)), _BF16)


def _check_weights(xb, w_gate, w_up, w_down, pl: Plan):
    """Raises ValueError unless the weights share one format (`_format`) and have its dtype and the shapes of `J`
    local experts over the activations' `L`, and pass that format's own checks."""
    j, lat = pl.num_local_experts, xb.shape[1]
    given = [("w_gate", w_gate), ("w_down", w_down)] + ([("w_up", w_up)] if w_up is not None else [])
    for name, w in given:
        if _format(w) is _BF16 and not (hasattr(w, "dtype") and hasattr(w, "shape")):
            raise ValueError(f"experts.swiglu: {name} is a {type(w).__name__}, which is no weight format: give "
                             f"{', '.join(f.label for f in _FORMATS)} weights (layer.expert_weights converts a "
                             "checkpoint's)")
    formats = {name: _format(w) for name, w in given}
    fmt = next((f for f in formats.values() if f is not _BF16), _BF16)
    if any(f is not fmt for f in formats.values()):
        names = [name for name, f in formats.items() if f is fmt]
        raise ValueError(f"experts.swiglu: {', '.join(names)} are {fmt.cls.__name__} and the others not: give every "
                         f"weight in one format ({', or '.join(f.label for f in _FORMATS)})")
    dtype = fmt.dtype
    inter = w_down.shape[1] if len(w_down.shape) == 3 else None
    want_gate = (j, lat, inter if w_up is not None else 2 * (inter or 0))
    checks = [("w_down", w_down, (j, inter, lat)), ("w_gate", w_gate, want_gate)]
    if w_up is not None:
        checks.append(("w_up", w_up, (j, lat, inter)))
    for name, a, shape in checks:
        values = fmt.values(a)
        if values.ndim != 3 or tuple(values.shape) != shape or values.dtype != dtype:
            what = f"{fmt.cls.__name__} values " if fmt.cls is not None else ""
            raise ValueError(
                f"experts.swiglu: {name} {what}must be {jnp.dtype(dtype).name}{list(shape)} (J={j} local experts, "
                f"L={lat}), got {jnp.dtype(values.dtype).name}{list(values.shape)}"
            )
        fmt.check(name, a, shape, j)
