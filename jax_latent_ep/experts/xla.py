"""The XLA implementations of the grouped SwiGLU ("ragged_dot", "scan", "gather", "dense"), activations, row sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_latent_ep.experts.formats import (MXFP4, BlockScaled, Int8PerChannel, _column_scale, _xla_operands,
                                          dequantize_fp8, dequantize_mxfp4)
from jax_latent_ep.experts.planning import Plan, work_items
from jax_latent_ep.numerics import mxfp8_dequantize, mxfp8_quantize
from jax_latent_ep.received import Received


def activations(recv: Received):
    """bf16 `[N*S, L]`: the dequantized MXFP8 rows (exact in bf16; unspecified in empty rows)."""
    return mxfp8_dequantize(recv.x, recv.sf).astype(jnp.bfloat16)


def _glu(gu, up, inter):
    """bf16 `h = silu(gate) * up` from FP32 `gate`, `up` (or the fused `[.., 2I]` `gu` with `up=None`)."""
    if up is None:
        gu, up = gu[..., :inter], gu[..., inter:]
    return (jax.nn.silu(gu) * up).astype(jnp.bfloat16)


def _down_input(h, w_down):
    """What down multiplies: bf16 `h`, or with FP8 / MXFP4 weights `h` rounded to MXFP8 (its values, exact in bf16:
    what the FP8 tensor cores multiply)."""
    if isinstance(w_down, (BlockScaled, MXFP4)):
        return mxfp8_dequantize(*mxfp8_quantize(h)).astype(jnp.bfloat16)
    return h


def _ragged_dot(pl: Plan, xb, w_gate, w_up, w_down, expected_pairs=None, mx=None):
    """`lax.ragged_dot` over the pairs sorted by expert (unused pairs past `sum(group_sizes)` give 0)."""
    xp = xb[pl.row]  # [C, L] bf16
    gs = pl.group_sizes
    e = jnp.minimum(pl.expert, pl.num_local_experts - 1)
    def rd(a, w):
        # FP8 weights are FP32 operands here: HIGHEST keeps XLA on GPUs from rounding them to TF32.
        hi = lax.Precision.HIGHEST if isinstance(w, BlockScaled) else None
        y = lax.ragged_dot(*_xla_operands(a, w), gs, preferred_element_type=jnp.float32, precision=hi)
        return _column_scale(y, w, e)

    gate = rd(xp, w_gate)
    up = rd(xp, w_up) if w_up is not None else None
    h = _down_input(_glu(gate, up, w_down.shape[1]), w_down)
    return rd(h, w_down)


#: Pairs of one step of the "scan" implementation (one expert's weights, up to this many of its pairs).
SCAN_BLOCK = 128


def _expert(w, e):
    """Expert `e`'s weight `[K, N]` (a traced index) and its per-output-channel scale or None: FP32 values of an FP8
    weight (its blocks' scales applied), the bf16 values of an int8 one, a bf16 weight as it is."""
    take = lambda a: jnp.asarray(a)[e]  # noqa: E731  (NumPy weights too: `e` is traced)
    if isinstance(w, BlockScaled):
        return dequantize_fp8(BlockScaled(take(w.values)[None], take(w.scale)[None]))[0], None
    if isinstance(w, MXFP4):
        return dequantize_mxfp4(MXFP4(take(w.values)[None], take(w.scale)[None]))[0], None
    if isinstance(w, Int8PerChannel):
        return take(w.values).astype(jnp.bfloat16), take(w.scale)
    return take(w), None


def _scan(pl: Plan, xb, w_gate, w_up, w_down, expected_pairs=None, mx=None):
    """A scan over the work list (`work_items`: up to `SCAN_BLOCK` pairs of one expert a step), each step reading
    one expert's weights: temporaries and the gradient's residuals follow the pairs, `[C, L]` and `[C, I]`, never
    `[C, L, I]` (training-sized layers on CPUs)."""
    items = work_items(pl, SCAN_BLOCK)
    cap, inter = pl.capacity, w_down.shape[1]
    lanes = jnp.arange(SCAN_BLOCK, dtype=jnp.int32)

    def mm(a, w, e):
        wv, scale = _expert(w, e)
        hi = lax.Precision.HIGHEST if isinstance(w, BlockScaled) else None  # FP32 operands: no TF32 on GPUs
        y = jnp.dot(a.astype(wv.dtype), wv, preferred_element_type=jnp.float32, precision=hi)
        return y if scale is None else y * scale

    def step(_, item):
        e, first, count = item[0], item[1], item[2]
        pair = first + lanes
        live = lanes < count
        a = xb[pl.row[jnp.minimum(pair, cap - 1)]]  # [B, L] bf16
        gate = mm(a, w_gate, e)
        up = mm(a, w_up, e) if w_up is not None else None
        h = _down_input(_glu(gate, up, inter), w_down)
        return None, (jnp.where(live, pair, cap), mm(h, w_down, e))

    # Rematerialized: a step's residuals would hold its expert's weights, `W` copies of `[L, I]` in the gradient.
    _, (pairs, ys) = lax.scan(jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable), None, items)
    y = jnp.zeros((cap, ys.shape[-1]), jnp.float32)  # lanes past their item's pairs write index `cap`: dropped
    return y.at[pairs.reshape(-1)].set(ys.reshape(-1, ys.shape[-1]), mode="drop")


def _gather(pl: Plan, xb, w_gate, w_up, w_down, expected_pairs=None, mx=None):
    """Each pair gathers its expert's weights (`[C, L, I]` temporaries: decode-sized `C` only)."""
    e = jnp.minimum(pl.expert, pl.num_local_experts - 1)
    xp = xb[pl.row]
    def mv(a, w):
        av, wv = _xla_operands(a, w)
        y = jnp.einsum("cl,cli->ci", av, wv[e], preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
        return _column_scale(y, w, e)

    gate = mv(xp, w_gate)
    up = mv(xp, w_up) if w_up is not None else None
    return mv(_down_input(_glu(gate, up, w_down.shape[1]), w_down), w_down)


def _dense(pl: Plan, xb, w_gate, w_up, w_down, expected_pairs=None, mx=None):
    """Every local expert on every row (`[R, J, L]` FP32), then each pair's (row, expert) picked.

    In FP32 operands (exact bf16 values: the same products), as XLA's CPU dot does not take bf16 x bf16 -> f32
    in a batched dot; it is the checker, not a fast path."""
    def f32(a):
        if isinstance(a, BlockScaled):
            return dequantize_fp8(a)
        if isinstance(a, MXFP4):
            return dequantize_mxfp4(a, jnp.float32)
        return (a.values if isinstance(a, Int8PerChannel) else a).astype(jnp.float32)

    hi = lax.Precision.HIGHEST  # no TF32 on GPUs
    j = jnp.arange(pl.num_local_experts)
    mm = lambda a, w: _column_scale(jnp.einsum("rl,jli->rji", f32(a), f32(w), precision=hi), w, j)  # noqa: E731
    gate = mm(xb, w_gate)
    up = mm(xb, w_up) if w_up is not None else None
    h = _down_input(_glu(gate, up, w_down.shape[1]), w_down)
    y = _column_scale(jnp.einsum("rji,jil->rjl", f32(h), f32(w_down), precision=hi), w_down, j)
    return y[pl.row, jnp.minimum(pl.expert, pl.num_local_experts - 1)]


def _row_sums(pl: Plan, y, out_dtype=jnp.bfloat16):
    """`[R, L]` in `out_dtype` (one rounding of the FP32 sum): each row's weighted sum of its pairs' outputs `y`
    `[C, L]` (FP32, or bf16 widened; unused pairs: garbage)."""
    return _pair_row_sums(y, pl.weight, pl.row_pairs, pl.count, out_dtype)


def _pair_row_sums(y, weight, row_pairs, count, out_dtype):
    """`_row_sums` on the plan's arrays: `[R, L]`, each row's FP32 sum of `weight[p] * y[p]` (`weight` None: 1) over
    the pairs `row_pairs` names below `count`, in slot order, rounded once to `out_dtype`."""
    # One fused gather-sum: only the pairs a row names are read (never an unused pair's row).
    valid = row_pairs < count  # [R, M]; C (no pair) and unused pairs fail
    safe = jnp.minimum(row_pairs, y.shape[0] - 1)
    coef = weight[safe] if weight is not None else jnp.ones(safe.shape, jnp.float32)
    acc = jnp.zeros((row_pairs.shape[0], y.shape[1]), jnp.float32)
    for m in range(row_pairs.shape[1]):  # ascending first slot: a fixed order
        acc = acc + jnp.where(valid[:, m : m + 1], y[safe[:, m]].astype(jnp.float32) * coef[:, m : m + 1], 0.0)
    return acc.astype(out_dtype)
