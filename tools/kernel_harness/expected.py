"""What the kernels must produce, from the NumPy contract model (`jax_latent_ep.testing.model`: its MXFP8
quantizer and dequantizer are the tree's one NumPy MXFP8 model), and how a result is compared with it.

Receive rows (x, sf of valid rows; ids, weights, src of all rows) and the routed latent must be bit-exact, the
normed output within 1 BF16 ulp (NaN equals NaN)."""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from jax_latent_ep.layout import EpLayout
from jax_latent_ep.testing import model

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn


def mxfp8_bytes(x):
    """x bf16 [T, L] -> (q uint8 [T, L], sf uint8 [T, L // 32]): the bytes a dispatch writes, the contract
    model's MXFP8 with NaN elements as the canonical 0x7F that `cvt.satfinite` writes."""
    q, sf = model.mxfp8_quantize(x)
    q_bytes = q.view(np.uint8).copy()
    q_bytes[np.isnan(q.astype(np.float32))] = 0x7F
    return q_bytes, sf


def bf16_bits(values_f32):
    return values_f32.astype(np.float32).astype(BF16).view(np.uint16)


def ulp_distance_bf16(a_bits, b_bits):
    """|a - b| in BF16 ulps on the monotone integer line (NaN == NaN counts 0, NaN against a number 2^20)."""
    def key(bits):
        bits = bits.astype(np.int32)
        return np.where(bits & 0x8000, 0x8000 - (bits & 0x7FFF), 0x8000 + (bits & 0x7FFF))

    nan_a = (a_bits & 0x7FFF) > 0x7F80
    nan_b = (b_bits & 0x7FFF) > 0x7F80
    dist = np.abs(key(a_bits) - key(b_bits))
    return np.where(nan_a & nan_b, 0, np.where(nan_a | nan_b, 1 << 20, dist))


class Rows(NamedTuple):
    """Receive rows of one rank, or stacked over leading axes `...`: x uint8 [..., R, L] (MXFP8 bytes), sf uint8
    [..., R, SF], ids int32 [..., R, K], weights uint32 [..., R, K] (FP32 bits), src int32 [..., R]."""

    x: np.ndarray
    sf: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    src: np.ndarray


def expected_receive(lay: EpLayout, d, state, quant):
    """The receive rows rank `d` must hold after a layer with `state[s] = (tokens, x, ids, weights)` of every
    source rank `s` and `quant[s] = mxfp8_bytes(x)`: `(Rows, valid [R] bool)`. Empty rows hold the
    contract's constants (ids `invalid_expert(d)`, weights 0, src -1) and zero x / sf (unspecified: compare
    them only where `valid`)."""
    shape = lay.shape
    local, S = shape.num_local_experts(lay.ranks), lay.stride
    exp_ids = np.full((lay.rows, shape.topk), lay.invalid_expert(d), np.int32)
    exp_w = np.zeros((lay.rows, shape.topk), np.uint32)
    exp_src = np.full((lay.rows,), -1, np.int32)
    valid = np.zeros(lay.rows, bool)
    exp_x = np.zeros((lay.rows, shape.latent), np.uint8)
    exp_sf = np.zeros((lay.rows, shape.num_sf), np.uint8)
    for s, (tokens, x, ids, weights) in enumerate(state):
        hit = (ids // local == d).any(axis=1)
        t = np.nonzero(hit)[0]
        rows = s * S + t
        valid[rows] = True
        exp_ids[rows] = ids[t]
        exp_w[rows] = weights[t].view(np.uint32)
        exp_src[rows] = (s << 16) | t
        exp_x[rows] = quant[s][0][t]
        exp_sf[rows] = quant[s][1][t]
    return Rows(exp_x, exp_sf, exp_ids, exp_w, exp_src), valid


def _row_differs(a, b):
    """bool [..., R]: the rows of two same-shape arrays [..., R, W] that differ anywhere (8 bytes at a time)."""
    if a.shape == b.shape and a.dtype == b.dtype and (a.shape[-1] * a.itemsize) % 8 == 0:
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
        return (a.view(np.uint64) != b.view(np.uint64)).any(axis=-1)
    return (a != b).any(axis=-1)


def receive_mismatches(got: Rows, exp: Rows, valid):
    """Mismatching elements of received rows, an int array over the leading axes of `valid` [..., R]: ids,
    weights (bits) and src of every row and sf of valid rows bit-exact; x of valid rows bit-exact but for NaN
    (a NaN byte, 0x7F or 0xFF, equals any other). x / sf of empty rows are unspecified: not compared."""
    lead = valid.shape[:-1]
    bad = ((got.ids != exp.ids).sum(axis=(-2, -1)) + (got.weights != exp.weights).sum(axis=(-2, -1))
           + (got.src != exp.src).sum(axis=-1) + ((got.sf != exp.sf) & valid[..., None]).sum(axis=(-2, -1)))
    bad = np.array(bad, np.int64).reshape(-1)
    rows, width = valid.shape[-1], got.x.shape[-1]
    gx, ex = got.x.reshape(-1, rows, width), exp.x.reshape(-1, rows, width)
    which = np.nonzero(_row_differs(gx, ex) & valid.reshape(-1, rows))
    if which[0].size:
        g, e = gx[which], ex[which]
        nan_both = ((g & 0x7F) == 0x7F) & ((e & 0x7F) == 0x7F)
        np.add.at(bad, which[0], ((g != e) & ~nan_both).sum(axis=1))
    return bad.reshape(lead)


def host_expert(rows: Rows, valid, d, local, garbage):
    """The expert stage of rank `d` on the host: `out = bf16(dequant(row) * sum of the row's local weights)`
    in valid rows (`model.mxfp8_dequantize`), `garbage` (one BF16 value, or one per row) in the others; bf16
    [R, L]."""
    weights = rows.weights.view(np.float32)
    wsum = np.where(rows.ids // local == d, weights, np.float32(0)).sum(axis=1, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        out = (model.mxfp8_dequantize(rows.x.view(E4M3), rows.sf) * wsum[:, None]).astype(BF16)
    garbage = np.asarray(garbage, BF16)
    fill = np.broadcast_to(garbage.reshape(-1, 1) if garbage.ndim else garbage, out.shape)
    out[~valid] = fill[~valid]
    return out


def expected_result(outs, dests, s, stride_rows, tokens, norm, apply_norm):
    """Rank `s`'s combine output as BF16 bits (uint16 [tokens, L]) from every rank's expert output `outs[d]`
    (bf16 [R, L]) and the destination rank of each of its tokens' experts, `dests` [tokens, K]: the FP32 sum
    over the token's destination ranks in ascending order, rounded once (the routed latent), or, if
    `apply_norm`, RMSNorm of it (eps 1e-6, weight `norm`) in FP32, rounded once."""
    latent = outs[0].shape[-1]
    acc = np.zeros((tokens, latent), np.float32)
    own = slice(s * stride_rows, s * stride_rows + tokens)  # the rows of rank s's tokens
    for d in range(len(outs)):
        sel = (dests == d).any(axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            acc = np.where(sel[:, None], acc + outs[d][own].astype(np.float32), acc)
    routed = acc.astype(BF16)
    if not apply_norm:
        return routed.view(np.uint16)
    v = routed.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ss = (v.astype(np.float64) ** 2).sum(axis=1).astype(np.float32)
        rstd = (1.0 / np.sqrt(np.float64(ss / np.float32(latent) + np.float32(1e-6)))).astype(np.float32)
        y = ((v * rstd[:, None]).astype(np.float32) * norm.astype(np.float32)).astype(np.float32)
    return bf16_bits(y)


def result_mismatches(got, exp, apply_norm, rows=None):
    """`(bad, ulp1)` over the leading axes of the BF16 bits `got`, `exp` [..., T, L]: elements off by more than
    1 ulp where `apply_norm` (normed) or by any ulp where not (routed), and the normed elements at exactly 1
    ulp; NaN equals NaN. `rows` (bool [..., T]) limits the comparison to those tokens."""
    lead, (tokens, latent) = got.shape[:-2], got.shape[-2:]
    count = int(np.prod(lead, dtype=np.int64))
    g, e = got.reshape(count, tokens, latent), exp.reshape(count, tokens, latent)
    normed = np.broadcast_to(np.asarray(apply_norm) != 0, lead).reshape(count)
    differs = _row_differs(g, e)
    if rows is not None:
        differs &= np.broadcast_to(rows, (*lead, tokens)).reshape(count, tokens)
    bad, ulp1 = np.zeros(count, np.int64), np.zeros(count, np.int64)
    which = np.nonzero(differs)
    if which[0].size:
        g, e = g[which], e[which]  # [rows, L], then the differing elements only
        row, column = np.nonzero(g != e)
        dist = ulp_distance_bf16(g[row, column], e[row, column])
        owner = which[0][row]
        limit = normed[owner]
        np.add.at(bad, owner, dist > limit.astype(np.int32))
        np.add.at(ulp1, owner, (dist == 1) & limit)
    return bad.reshape(lead), ulp1.reshape(lead)
