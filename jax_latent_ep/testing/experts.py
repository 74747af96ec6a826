"""Receive rows for the expert stage without a dispatch (NumPy), and the NumPy model of `experts.swiglu`."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jax_latent_ep.layout import stride
from jax_latent_ep.received import Received


def random_received(
    rng: np.random.Generator,
    *,
    ranks: int,
    rank: int,
    tokens,
    max_tokens: int,
    latent: int,
    experts: int,
    topk: int,
    pad_tokens: float = 0.0,
    pad_slots: float = 0.0,
    duplicates: float = 0.0,
    local_bias: float | None = None,
) -> Received:
    """The `Received` rank `rank` would get from `ranks` sources (as the contract lays it out), as NumPy arrays.

    Args:
      rng: the generator.
      ranks, rank: `N` and the receiving rank.
      tokens: live tokens per source rank (an int, or a list of `N` ints: a different count per rank).
      max_tokens: fixes `S = stride(max_tokens)`.
      latent, experts, topk: `L`, `E`, `K`.
      pad_tokens: fraction of live tokens whose ids are all `-1` (padded tokens: they reach no rank).
      pad_slots: fraction of the other slots set to `-1` (unused slots).
      duplicates: fraction of tokens whose slot 1 repeats slot 0's expert.
      local_bias: with a value, each id is drawn from this rank's experts with that probability (else uniform).

    Returns:
      `Received` of NumPy arrays (`x` float8_e4m3fn, `sf` uint8, `ids` int32, `weights` float32, `src` int32),
      `N * S` rows; empty rows as the contract's (`src = -1`, weights 0, ids `((rank + 1) % N) * E/N`).
    """
    from jax_latent_ep.numerics import mxfp8_quantize

    s_rows, local = stride(max_tokens), experts // ranks
    counts = [tokens] * ranks if np.isscalar(tokens) else list(tokens)
    rows = ranks * s_rows
    ids = np.full((rows, topk), ((rank + 1) % ranks) * local, np.int32)
    weights = np.zeros((rows, topk), np.float32)
    src = np.full((rows,), -1, np.int32)
    for s in range(ranks):
        for t in range(counts[s]):
            if local_bias is None:
                tid = rng.choice(experts, topk, replace=False)
            else:
                mine = rng.random(topk) < local_bias
                tid = np.where(mine, rank * local + rng.integers(0, local, topk), rng.integers(0, experts, topk))
            tid = tid.astype(np.int32)
            if rng.random() < duplicates and topk > 1:
                tid[1] = tid[0]
            if rng.random() < pad_tokens:
                tid[:] = -1
            else:
                tid[rng.random(topk) < pad_slots] = -1
            # only tokens with an expert on `rank` are received here
            if not np.any(tid // local == rank) or np.all(tid < 0):
                continue
            row = s * s_rows + t
            ids[row] = tid
            wt = rng.random(topk).astype(np.float32) + 0.05
            weights[row] = wt / wt.sum()
            src[row] = (s << 16) | t
    xb = (rng.standard_normal((rows, latent)) * np.exp(rng.standard_normal((rows, 1)))).astype(ml_dtypes.bfloat16)
    q, sf = (np.asarray(a) for a in mxfp8_quantize(xb))
    return Received(q, sf, ids, weights, src)


def random_fp8_weights(rng: np.random.Generator, *shape: int, subnormal_only: bool = False):
    """`experts.BlockScaled` NumPy weights `[J, K, N]` (K, N multiples of 128): float8_e4m3fn values of random
    signs and magnitude codes drawn uniformly over the finite range, so exact zeros and subnormals among them
    (every value zero or subnormal with `subnormal_only`), and an FP32 scale per block, not a power of two, sized so the weights are
    about `1 / sqrt(K)`."""
    from jax_latent_ep.experts import FP8_BLOCK, BlockScaled

    j, k, n = shape
    # Magnitude codes 0 .. 0x7E (0x7F is NaN): 0 is zero, 1 .. 7 subnormal (exponent field 0).
    codes = rng.integers(0, 8 if subnormal_only else 0x7F, shape, dtype=np.uint8)
    codes |= (rng.random(shape) < 0.5).astype(np.uint8) << 7
    values = codes.view(ml_dtypes.float8_e4m3fn)
    typical = float(np.sqrt(np.mean(values.astype(np.float32) ** 2))) or 1.0
    scale = (np.exp(rng.standard_normal((j, k // FP8_BLOCK, n // FP8_BLOCK)) * 0.3) / np.sqrt(k) / typical)
    return BlockScaled(values, scale.astype(np.float32))


def random_mxfp4_weights(rng: np.random.Generator, *shape: int):
    """`experts.MXFP4` NumPy weights of the `[J, K, N]` weight (K a multiple of 32): every one of the 16 e2m1 codes
    equally likely (zeros and -0 among them), and E8M0 scales around `2^-2 / sqrt(K)` (a spread of +-3 octaves)
    so the weights are about `1 / sqrt(K)`."""
    from jax_latent_ep.experts import MX_BLOCK, MXFP4

    j, k, n = shape
    values = rng.integers(0, 256, (j, n, k // 2), dtype=np.uint8)
    center = 127 - 2 - int(np.round(np.log2(np.sqrt(k))))
    scale = rng.integers(center - 3, center + 4, (j, n, k // MX_BLOCK)).astype(np.uint8)
    return MXFP4(values, scale)


def random_int8_weights(rng: np.random.Generator, *shape: int):
    """`experts.Int8PerChannel` NumPy weights `[J, K, N]`: int8 values uniform over [-127, 127] (zeros among them)
    and an FP32 scale per output channel, not a power of two, sized so the weights are about `1 / sqrt(K)`."""
    from jax_latent_ep.experts import Int8PerChannel

    j, k, n = shape
    values = rng.integers(-127, 128, shape).astype(np.int8)
    scale = np.exp(rng.standard_normal((j, n)) * 0.3) / np.sqrt(k) / 73.3  # 73.3: the RMS of uniform [-127, 127]
    return Int8PerChannel(values, scale.astype(np.float32))


def dequantized(w):
    """FP32 NumPy weights of `w`: an array as it is, `experts.BlockScaled` as `values * scale` per block,
    `experts.Int8PerChannel` as `values * scale` per output channel; `BlockScaledOutIn` as its `BlockScaled`."""
    from jax_latent_ep.experts import FP8_BLOCK, MXFP4, BlockScaled, BlockScaledOutIn, Int8PerChannel, fp8_in_out

    if isinstance(w, MXFP4):  # ml_dtypes' e2m1 decoding (independent of the library's table)
        v = np.asarray(w.values)
        codes = np.stack([v & 0xF, v >> 4], -1).reshape(v.shape[0], v.shape[1], -1)
        vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
        scale = np.ldexp(np.float32(1), np.asarray(w.scale).astype(np.int32) - 127).astype(np.float32)
        return np.swapaxes(vals * scale.repeat(32, 2), 1, 2)
    if isinstance(w, Int8PerChannel):
        return np.asarray(w.values).astype(np.float32) * np.asarray(w.scale, np.float32)[:, None, :]
    if isinstance(w, BlockScaledOutIn):
        w = fp8_in_out(w)
    if not isinstance(w, BlockScaled):
        return np.asarray(w, np.float32)
    scale = np.asarray(w.scale, np.float32).repeat(FP8_BLOCK, 1).repeat(FP8_BLOCK, 2)
    return np.asarray(w.values).astype(np.float32) * scale


def _bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def reference_swiglu(recv: Received, rank: int, w_gate, w_up, w_down, *, max_tokens=None, ranks=1):
    """NumPy model of `experts.swiglu` (FP32 GEMMs in NumPy's order, the stage's bf16 roundings): bf16 `[R, L]`.

    Per live row (`src != -1`, `t < max_tokens`), the distinct local experts (`id // J == rank`) in ascending
    order of their first slot, each with the FP32 sum (ascending `k`) of its slots' weights; `w_up=None`
    means `w_gate` is fused `[J, L, 2I]`; `experts.BlockScaled` / `experts.MXFP4` weights are dequantized to FP32
    first, and with them `h` is rounded to MXFP8 before down (`numerics.mxfp8_quantize`)."""
    from jax_latent_ep.experts import MXFP4, BlockScaled, BlockScaledOutIn
    from jax_latent_ep.numerics import mxfp8_dequantize, mxfp8_quantize

    mx_h = isinstance(w_down, (BlockScaled, BlockScaledOutIn, MXFP4))
    x = np.asarray(recv.x).astype(np.float32) * np.exp2(np.asarray(recv.sf).astype(np.float32) - 127).repeat(32, 1)
    ids, wts, src = np.asarray(recv.ids), np.asarray(recv.weights), np.asarray(recv.src)
    wg, wd = dequantized(w_gate), dequantized(w_down)
    wu = None if w_up is None else dequantized(w_up)
    j, inter = wd.shape[0], wd.shape[1]
    rows = ids.shape[0]
    s_rows = rows // ranks
    mt = s_rows if max_tokens is None else max_tokens
    out = np.zeros((rows, wd.shape[2]), np.float32)
    for r in range(rows):
        if src[r] == -1 or r % s_rows >= mt:
            continue
        seen = []
        for k in range(ids.shape[1]):
            e = int(ids[r, k])
            if e // j == rank and e not in seen:
                seen.append(e)
        acc = np.zeros(wd.shape[2], np.float32)
        for e in seen:
            c = np.float32(0)
            for k in range(ids.shape[1]):
                if ids[r, k] == e:
                    c = np.float32(c + wts[r, k])
            le = e - rank * j
            if wu is None:
                gu = x[r] @ wg[le]
                gate, up = gu[:inter], gu[inter:]
            else:
                gate, up = x[r] @ wg[le], x[r] @ wu[le]
            with np.errstate(over="ignore"):  # exp(-gate) overflows to inf for gate << 0: silu -> -0
                h = _bf16(gate / (1 + np.exp(-gate)) * up)
            if mx_h:
                h = np.asarray(mxfp8_dequantize(*mxfp8_quantize(h.astype(ml_dtypes.bfloat16))), np.float32)
            acc = np.float32(acc + c * (h @ wd[le]))
        out[r] = acc
    return out.astype(ml_dtypes.bfloat16)


def reference_swiglu_grads(pl, xb, w_gate, w_up, w_down, dout):
    """float64 NumPy model of the expert stage's gradients (no roundings): `(d_rows [R, L], d_w_gate, d_w_up,
    d_w_down)` of `sum(dout * out)`, `out[r] = sum_p weight_p * (silu(x_r W_g[e_p]) * (x_r W_u[e_p])) W_d[e_p]` over
    the plan `pl`'s used pairs `p` (its row, expert and weight), bf16 weights `[J, L, I]`, `[J, L, I]`,
    `[J, I, L]` and rows `xb` `[R, L]`."""
    count = int(pl.count)
    row, exp, c = (np.asarray(a)[:count] for a in (pl.row, pl.expert, pl.weight))
    f = lambda a: np.asarray(a, np.float32).astype(np.float64)  # noqa: E731
    x, wg, wu, wd, dout = f(xb), f(w_gate), f(w_up), f(w_down), f(dout)
    xp = x[row]
    gate, up = np.einsum("pl,pli->pi", xp, wg[exp]), np.einsum("pl,pli->pi", xp, wu[exp])
    sig = 1 / (1 + np.exp(-gate))
    h = gate * sig * up
    dy = c[:, None].astype(np.float64) * dout[row]  # [P, L]
    dh = np.einsum("pl,pil->pi", dy, wd[exp])
    dgate, dup = dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig
    dx = np.zeros_like(x)
    np.add.at(dx, row, np.einsum("pi,pli->pl", dgate, wg[exp]) + np.einsum("pi,pli->pl", dup, wu[exp]))
    grads = [np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)]
    np.add.at(grads[0], exp, np.einsum("pl,pi->pli", xp, dgate))
    np.add.at(grads[1], exp, np.einsum("pl,pi->pli", xp, dup))
    np.add.at(grads[2], exp, np.einsum("pi,pl->pil", h, dy))
    return (dx, *grads)
