"""A pure-NumPy model of the dispatch / combine contract (`specs/contract.md`), for all ranks at once.

It shares no code with the backends (its MXFP8 quantizer is its own NumPy implementation of `numerics.md`),
so tests compare every backend against it. Inputs are stacked over ranks: rank `r`'s tokens are `x[r]`.

  dispatch(x [N, T, L] bf16, ids [N, T, K] int32, weights [N, T, K] f32) -> ModelReceived, arrays [N, N*S, ...]
  combine(out [N, N*S, L] bf16, ids [N, T, K], norm_weight [L] bf16 or None, eps) -> routed or normed [N, T, L]

Rows that no token reached hold the contract's "empty" values (ids `((d + 1) % N) * local`, weights 0,
src -1) and zero `x` / `sf` (the contract leaves those unspecified: compare them only where `src != -1`).
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from jax_latent_ep.shapes import LatentMoEShape, check_max_tokens
from jax_latent_ep.layout import stride

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
_R = np.array([0x3B124925], np.uint32).view(np.float32)[0]  # rn_f32(1 / 448)
_TINY = np.float32(2.0**-126)


class ModelReceived(NamedTuple):
    """Every rank's receive rows (`jax_latent_ep.received.Received` stacked over the receiving rank `d`)."""

    x: np.ndarray  # float8_e4m3fn [N, N*S, L]
    sf: np.ndarray  # uint8 [N, N*S, L // 32]
    ids: np.ndarray  # int32 [N, N*S, K]
    weights: np.ndarray  # float32 [N, N*S, K]
    src: np.ndarray  # int32 [N, N*S]


def _ftz(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, np.float32)
    return np.where(np.abs(v) < _TINY, np.copysign(np.float32(0), v), v).astype(np.float32)


def mxfp8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NumPy MXFP8 quantization of bf16 `[..., L]` -> (float8_e4m3fn `[..., L]`, uint8 `[..., L // 32]`).

    `numerics.md` step by step; a block with a non-finite value gets scale 255 and elements `e4m3(x * 0)`.
    """
    x = np.asarray(x)
    assert x.dtype == BF16, x.dtype
    lead, width = x.shape[:-1], x.shape[-1]
    v = _ftz(x.astype(np.float32)).reshape(*lead, width // 32, 32)
    with np.errstate(invalid="ignore", over="ignore"):
        nonfinite = ~np.all(np.isfinite(v), axis=-1)
        amax = np.max(np.abs(np.where(np.isfinite(v), v, 0)), axis=-1).astype(np.float32)
        s = _ftz(amax * _R)
        bits = s.view(np.uint32)
        biased = ((bits >> 23) & 0xFF).astype(np.int64)
        e = np.minimum(254, biased + ((bits & 0x7FFFFF) != 0))
        e = np.where(s == 0, 0, e)
        e = np.where(nonfinite, 255, e)
        inv = np.where((e == 0) | (e >= 254), np.float32(0), np.ldexp(np.float32(1), (127 - e).astype(np.int32)))
        inv = inv.astype(np.float32)
        scaled = _ftz(v * inv[..., None])
        q = np.clip(scaled, -448.0, 448.0).astype(np.float32).astype(E4M3)
    return q.reshape(*lead, width), e.astype(np.uint8)


def mxfp8_dequantize(q: np.ndarray, sf: np.ndarray) -> np.ndarray:
    """NumPy MXFP8 dequantization: float8_e4m3fn `[..., L]`, uint8 `[..., L // 32]` -> float32 `[..., L]`,
    `f32(q) * 2^(sf - 127)` per 32-block."""
    lead, width = q.shape[:-1], q.shape[-1]
    scale = (sf.astype(np.uint32) << 23).view(np.float32)
    return (q.astype(np.float32).reshape(*lead, width // 32, 32) * scale[..., None]).reshape(*lead, width)


def rms_norm(v: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """vLLM RMSNorm of bf16 `v [..., L]` with bf16 weight `w [L]` -> bf16 `[..., L]`: FP32 inside, one rounding,
    exact `1 / sqrt` (may differ from the device by 1 bf16 ulp)."""
    f = v.astype(np.float32)
    ss = np.sum(f * f, axis=-1, dtype=np.float32, keepdims=True)
    rstd = (np.float32(1) / np.sqrt(ss / np.float32(v.shape[-1]) + np.float32(eps))).astype(np.float32)
    return (f * rstd * w.astype(np.float32)).astype(np.float32).astype(BF16)


def destinations(ids: np.ndarray, shape: LatentMoEShape, ranks: int) -> np.ndarray:
    """bool `[..., N]`: `member[..., d]` iff some id of the token lives on rank `d` (ids outside [0, E) ignored)."""
    local = shape.num_local_experts(ranks)
    ids = np.asarray(ids)
    valid = (ids >= 0) & (ids < shape.experts)
    dest = np.where(valid, ids // local, -1)
    return np.stack([np.any(dest == d, axis=-1) for d in range(ranks)], axis=-1)


def dispatch(x, ids, weights, *, shape: LatentMoEShape, max_tokens: int) -> ModelReceived:
    """The contract's dispatch on every rank at once.

    Args:
      x: bf16 `[N, T, L]`, every rank's tokens (`N` ranks, `T` tokens each, `1 <= T <= max_tokens`).
      ids: int32 `[N, T, K]`, global expert ids (ids outside `[0, E)` select no rank).
      weights: float32 `[N, T, K]`, routing weights.
      shape: the layer's `LatentMoEShape` (L, E, K).
      max_tokens: fixes `S = stride(max_tokens)`.

    Returns:
      `ModelReceived`, arrays `[N, N*S, ...]`: rank `d`'s rows source-major (row `s * S + t` is token `t` of rank
      `s`); rows no token reached hold the contract's empty values and zero `x` / `sf`.
    """
    x, ids, weights = np.asarray(x), np.asarray(ids, np.int32), np.asarray(weights, np.float32)
    n, t_count, width = x.shape
    assert width == shape.latent and ids.shape == (n, t_count, shape.topk) == weights.shape
    assert 1 <= t_count <= check_max_tokens(max_tokens)
    local = shape.num_local_experts(n)
    s_rows = stride(max_tokens)
    rows = n * s_rows
    q, sf = mxfp8_quantize(x)
    member = destinations(ids, shape, n)  # [N(src), T, N(dst)]
    rx = np.zeros((n, rows, width), E4M3)
    rsf = np.zeros((n, rows, shape.num_sf), np.uint8)
    rids = np.empty((n, rows, shape.topk), np.int32)
    rw = np.zeros((n, rows, shape.topk), np.float32)
    rsrc = np.full((n, rows), -1, np.int32)
    for d in range(n):
        rids[d] = ((d + 1) % n) * local
    for r in range(n):
        for t in range(t_count):
            for d in range(n):
                if member[r, t, d]:
                    row = r * s_rows + t
                    rx[d, row], rsf[d, row] = q[r, t], sf[r, t]
                    rids[d, row], rw[d, row] = ids[r, t], weights[r, t]
                    rsrc[d, row] = (r << 16) | t
    return ModelReceived(rx, rsf, rids, rw, rsrc)


def combine(out, ids, norm_weight=None, eps: float = 1e-5, *, shape: LatentMoEShape, max_tokens: int):
    """The contract's combine on every rank at once: routed (or RMS-normed) latent bf16 `[N, T, L]` of every
    rank's own tokens.

    Args:
      out: bf16 `[N, N*S, L]`, each rank's expert output for its receive rows (rows with nothing are ignored).
      ids: int32 `[N, T, K]`, the ids of the layer's dispatch.
      norm_weight: bf16 `[L]`, or None for the routed latent without RMSNorm.
      eps: the RMSNorm epsilon.
      shape, max_tokens: as for `dispatch`.
    """
    out, ids = np.asarray(out), np.asarray(ids, np.int32)
    n, t_count, _ = ids.shape
    s_rows = stride(max_tokens)
    assert out.shape == (n, n * s_rows, shape.latent), out.shape
    member = destinations(ids, shape, n)
    routed = np.empty((n, t_count, shape.latent), BF16)
    for r in range(n):
        for t in range(t_count):
            acc = np.zeros(shape.latent, np.float32)
            for d in range(n):  # ascending d, FP32, from 0
                if member[r, t, d]:
                    acc = (acc + out[d, r * s_rows + t].astype(np.float32)).astype(np.float32)
            routed[r, t] = acc.astype(BF16)
    if norm_weight is None:
        return routed
    return rms_norm(routed, np.asarray(norm_weight), eps)


def toy_expert(rx, rsf, rids, rweights, rank: int, *, shape: LatentMoEShape, ranks: int) -> np.ndarray:
    """A simple expert stage of one rank, bit-reproducible in jnp (`jax_latent_ep.testing.toy_expert`):
    `out[row] = bf16(dequant(x[row]) * c[row])`, `c[row] = sum over local k (k ascending, FP32, from 0) of
    weights[row, k] * (1 + (ids[row, k] % 7) / 8)`."""
    local = shape.num_local_experts(ranks)
    xf = mxfp8_dequantize(rx, rsf)
    c = np.zeros(rids.shape[0], np.float32)
    for k in range(rids.shape[1]):
        is_local = (rids[:, k] // local) == rank
        term = (rweights[:, k] * (np.float32(1) + (rids[:, k] % 7).astype(np.float32) / np.float32(8))).astype(np.float32)
        c = np.where(is_local, (c + term).astype(np.float32), c)
    with np.errstate(invalid="ignore"):
        return (xf * c[:, None]).astype(np.float32).astype(BF16)


def bf16_ulp_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in units of bf16 ulps, by ordering the bit patterns (inputs finite)."""
    def ordered(v):
        bits = np.asarray(v).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
    return np.abs(ordered(a) - ordered(b))
