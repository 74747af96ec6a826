"""The differentiation rules of dispatch and combine (custom VJPs applied around either backend), and MXFP8's
straight-through round trip.

The forward passes are the backends' own calls, unchanged; only the backward is defined here, from XLA
collectives (one `lax.all_to_all` per call, inside the same `jax.shard_map`), so both backends share one rule:

dispatch: `(recv, latent) = dispatch(x, ids, weights)`. `latent` f32 `[N*S, L]` is the dequantized MXFP8 rows
  (0 in empty rows): the differentiable path of `x` (`recv.x` is float8, whose cotangent would already be
  rounded to float8; a non-zero cotangent reaching it is refused with a ValueError). Backward (a combine):
  each token's gradient is the FP32 sum, over the ranks `d` in `D(t)` in ascending order from 0, of the
  gradients of the rows it reached; the MXFP8 round trip differentiates as the identity (straight-through),
  so `dx[t] = bf16(sum_d dlatent[row of t on d])`; `dweights[t] = sum_d drecv.weights[row of t on d]` (FP32).
  Empty rows contribute nothing. `ids` and the received `ids`, `sf`, `src` are integers: no gradient.
  Traffic: one all_to_all of `N * S * (L + K) * 4` bytes per rank (FP32: the cotangents are summed exactly as
  sent; about 4x the forward's MXFP8 rows).
combine: `y = combine(out, ids, norm_weight, eps)`. Backward (a dispatch): the RMSNorm's backward (JAX's
  autodiff of `numerics.rms_norm`, FP32 inside) gives the routed latent's gradient, rounded once to BF16, and
  `norm_weight`'s; the routed latent's BF16 rounding differentiates as the identity; every rank that sent a
  partial of token `t` receives `bf16(drouted[t])` in that row (other rows get 0). Sent in BF16: `out` is BF16,
  so its cotangent is rounded to BF16 anyway and nothing is summed after the transfer (FP32 would move twice
  the bytes for the same result). Traffic: one all_to_all of `N * S * L * 2` bytes per rank.

Under differentiation the forward of a combine with `norm_weight` runs the backend's combine without the norm
and applies `numerics.rms_norm` in XLA (the backward needs the routed latent): bit-identical to the XLA
backend; against the nvlink kernel's fused RMSNorm a small fraction of elements may differ by 1 BF16 ulp
(`docs/numerics.md`). Forward-mode differentiation (`jax.jvp`) is not defined (JAX raises for a custom VJP).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jax_latent_ep.backends.xla import destination_mask
from jax_latent_ep.numerics import mxfp8_dequantize, mxfp8_quantize, rms_norm
from jax_latent_ep.received import Received


def _zero(ct) -> bool:
    return ct is None or isinstance(ct, SymbolicZero)


def varying_axes(a):
    """The mesh axes `a` varies over inside a `shard_map` (its type's `mat.varying`, JAX >= 0.12, or `vma`), or
    None where its type says nothing of them."""
    aval = jax.typeof(a)
    mat = getattr(aval, "mat", None)
    return mat.varying if mat is not None and hasattr(mat, "varying") else getattr(aval, "vma", None)


def _varying(a, axis_name: str):
    """`a` marked as varying over `axis_name` (so a replicated input's gradient is summed over the ranks by
    the transpose of this cast, a psum); a no-op where it already varies or outside a checked shard_map."""
    vma = varying_axes(a)
    if vma is None or axis_name in vma:
        return a
    try:
        return lax.pcast(a, axis_name, to="varying")
    except ValueError:  # pragma: no cover - check_vma=False
        return a


@jax.custom_vjp
def mxfp8_round_trip(x):
    """`mxfp8_dequantize(mxfp8_quantize(x))` with the straight-through gradient (the round trip's derivative
    is taken as the identity), the rule dispatch's latent follows.

    Args:
      x: bfloat16 `[..., L]`, `L` a multiple of 32.

    Returns:
      float32 `[..., L]`, bit-identical to the dequantized MXFP8 rows dispatch delivers; its gradient with
      respect to `x` is the incoming gradient rounded to BF16.
    """
    # The barrier keeps the FP8 rounding (XLA may drop an f32 -> float8 -> f32 convert pair on GPUs).
    return mxfp8_dequantize(*lax.optimization_barrier(mxfp8_quantize(x)))


def _axes(*arrays):
    """The mesh axes any of `arrays` varies over (`varying_axes`)."""
    return set().union(*(varying_axes(a) or () for a in arrays))


def _vary(a, axes):
    """`a` marked as varying over each of `axes` (`_varying`): a custom call's result given its operands' type."""
    for ax in sorted(axes):
        a = _varying(a, ax)
    return a


def _round_trip_fwd(x):
    return mxfp8_round_trip(x), None


def _round_trip_bwd(_, ct):
    return (ct.astype(jnp.bfloat16),)


mxfp8_round_trip.defvjp(_round_trip_fwd, _round_trip_bwd)


@jax.custom_jvp
def positive_zero(acc):
    """`acc` with -0 turned into +0 (as an IEEE sum from +0 rounds), differentiated as the identity (a plain
    `jnp.where(acc == 0, 0, acc)` would give exact zeros a zero gradient).

    Args:
      acc: a float array. Returns: the same values, +0 where `acc == 0`.
    """
    return jnp.where(acc == 0, jnp.zeros((), acc.dtype), acc)


@positive_zero.defjvp
def _positive_zero_jvp(primals, tangents):
    return positive_zero(primals[0]), tangents[0]


def received_latent(recv: Received):
    """float32 `[N*S, L]`: the dequantized MXFP8 rows of `recv`, 0 in empty rows (`src == -1`)."""
    return jnp.where(recv.src[:, None] == -1, 0.0, mxfp8_dequantize(recv.x, recv.sf))


def _gather_back(blocks, axis_name: str, ranks: int):
    """`[N, S, C]` blocks (block `s`: the rows this rank holds for source `s`) -> `[N, S, C]` (block `d`: the
    rows rank `d` holds for this rank's tokens)."""
    return lax.all_to_all(blocks, axis_name, 0, 0, tiled=True) if ranks > 1 else blocks


def dispatch(impl, axis_name: str, x, ids, weights):
    """`(recv, latent)`: `impl.dispatch(x, ids, weights)` and its dequantized rows, differentiable in `x`
    (straight-through) and `weights` (see the module docstring). Per rank, inside `jax.shard_map`.

    Args:
      impl: the backend (`xla.XlaBackend` or `nvlink.NvlinkBackend`).
      axis_name: its mesh axis.
      x: bfloat16 `[T, L]`; ids: int32 `[T, K]`; weights: float32 `[T, K]` (as `ExpertParallel.dispatch`).

    Returns:
      `(Received, latent)`: the backend's `Received` and float32 `[N*S, L]` (`received_latent`).
    """
    shape, ranks = impl.shape, impl.ranks
    s_rows = impl.stride
    t_count = x.shape[0]

    @jax.custom_vjp
    def run(x, ids, weights):
        recv = impl.dispatch(x, ids, weights)
        return recv, received_latent(recv)

    def fwd(x, ids, weights):
        out = run(x.value, ids.value, weights.value)
        return out, (ids.value, x.perturbed)

    def bwd(res, cts):
        ids, x_perturbed = res
        ct_recv, ct_latent = cts
        if x_perturbed and not _zero(ct_recv.x):  # (unperturbed x: the float8 rows' gradient is not asked for)
            raise ValueError(
                "ExpertParallel.dispatch: a gradient reached Received.x (float8_e4m3fn), where it would already "
                "be rounded to float8; differentiate through the dequantized latent instead: "
                "`recv, latent = ep.dispatch(x, ids, weights, dequantize=True)` and feed `latent` to the experts"
            )
        parts = []  # the FP32 cotangents this rank holds for every source's rows, [N*S, C] each
        if not _zero(ct_latent):
            parts.append(ct_latent.astype(jnp.float32))
        if not _zero(ct_recv.weights):
            parts.append(ct_recv.weights.astype(jnp.float32))
        if not parts:
            return None, None, None
        lat = shape.latent
        blocks = jnp.concatenate(parts, axis=1).reshape(ranks, s_rows, -1)
        back = _gather_back(blocks, axis_name, ranks)  # block d: rank d's rows of this rank's tokens
        member = destination_mask(ids, shape.experts, ranks)  # [T, N]; rows of non-members are empty rows
        acc = jnp.zeros((t_count, back.shape[-1]), jnp.float32)
        for d in range(ranks):  # ascending d, FP32 from 0, like combine
            acc = jnp.where(member[:, d, None], acc + back[d, :t_count], acc)
        o = 0
        ct_x = ct_w = None
        if not _zero(ct_latent):
            ct_x, o = acc[:, :lat].astype(jnp.bfloat16), lat
        if not _zero(ct_recv.weights):
            ct_w = acc[:, o:]
        return ct_x, None, ct_w

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    x, weights = _varying(x, axis_name), _varying(weights, axis_name)
    # JAX differentiates this only inside jax.jit (an eager shard_map raises NotImplementedError for a
    # custom VJP with symbolic zeros): a refusal, never a wrong gradient.
    return run(x, ids, weights)


def combine(impl, axis_name: str, out, ids, norm_weight, eps: float):
    """`impl.combine(out, ids, norm_weight, eps)`, differentiable in `out` and `norm_weight` (see the module
    docstring). Per rank, inside `jax.shard_map`.

    Args:
      impl: the backend; axis_name: its mesh axis.
      out: bfloat16 `[N*S, L]`; ids: int32 `[T, K]`; norm_weight: bfloat16 `[L]` or None; eps: float
        (as `ExpertParallel.combine`).

    Returns:
      bfloat16 `[T, L]`.
    """
    shape, ranks = impl.shape, impl.ranks
    s_rows = impl.stride
    t_count = ids.shape[0]

    def normed(routed, w):
        # As the XLA backend: the barrier keeps the routed latent's BF16 rounding.
        return rms_norm(lax.optimization_barrier(routed), w, eps)

    def send_back(ct_routed, ids):
        """bf16 [N*S, L]: row `s*S + t` gets source `s`'s `ct_routed[t]` where this rank holds a partial of it."""
        member = destination_mask(ids, shape.experts, ranks)  # [T, N]
        blocks = jnp.where(member.T[:, :, None], ct_routed.astype(jnp.bfloat16)[None], jnp.bfloat16(0))
        blocks = jnp.pad(blocks, ((0, 0), (0, s_rows - t_count), (0, 0)))  # [N(d), S, L]
        return _gather_back(blocks, axis_name, ranks).reshape(ranks * s_rows, shape.latent)

    if norm_weight is None:

        @jax.custom_vjp
        def run(out, ids):
            return impl.combine(out, ids, None, eps)

        def fwd(out, ids):
            return run(out, ids), ids

        def bwd(ids, ct):
            return send_back(ct, ids), None

        run.defvjp(fwd, bwd)
        return run(_varying(out, axis_name), ids)

    @jax.custom_vjp
    def run_normed(out, ids, w):
        return impl.combine(out, ids, w, eps)

    def fwd_normed(out, ids, w):
        routed = impl.combine(out, ids, None, eps)
        return normed(routed, w), (ids, routed, w)

    def bwd_normed(res, ct):
        ids, routed, w = res
        _, vjp = jax.vjp(normed, routed, w)
        ct_routed, ct_w = vjp(ct)
        return send_back(ct_routed, ids), None, ct_w

    run_normed.defvjp(fwd_normed, bwd_normed)
    return run_normed(_varying(out, axis_name), ids, _varying(norm_weight, axis_name))
