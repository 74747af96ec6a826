"""The routers of real MoE models (softmax top-k, sigmoid group-limited top-k): `[T, E]` logits to `(ids, weights)`."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from jax_latent_ep.shapes import as_int


def _positive_int(value, name: str) -> int:
    value = as_int(value, name)
    if value <= 0:
        raise ValueError(f"{name}={value} must be a positive int")
    return value


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a bool")
    return value


def _check_inputs(logits, bias, topk: int):
    """`(logits f32 [T, E], bias f32 [E] or None, E)` after the checks shared by both routers."""
    shape = jnp.shape(logits)
    dtype = jnp.result_type(logits)
    if len(shape) != 2:
        raise ValueError(f"logits must be [T, E], got shape {shape}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"logits dtype {dtype} must be a float dtype")
    experts = shape[1]
    if topk > experts:
        raise ValueError(f"topk={topk} must not exceed the number of experts E={experts}")
    if bias is not None:
        if jnp.shape(bias) != (experts,):
            raise ValueError(f"bias shape {jnp.shape(bias)} must be [E] = ({experts},)")
        if not jnp.issubdtype(jnp.result_type(bias), jnp.floating):
            raise ValueError(f"bias dtype {jnp.result_type(bias)} must be a float dtype")
        bias = jnp.asarray(bias).astype(jnp.float32)
    return jnp.asarray(logits).astype(jnp.float32), bias, experts


def _gather(values, ids):
    return jnp.take_along_axis(values, ids, axis=-1)


@functools.partial(jax.jit, static_argnames=("topk", "renormalize"))
def _softmax_topk(logits, bias, *, topk: int, renormalize: bool):
    probs = jax.nn.softmax(logits, axis=-1)
    choice = probs if bias is None else probs + bias
    _, ids = lax.top_k(choice, topk)
    weights = _gather(probs, ids)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


@functools.partial(jax.jit, static_argnames=("topk", "n_group", "topk_group", "routed_scaling_factor", "normalize"))
def _sigmoid_group_topk(logits, bias, *, topk, n_group, topk_group, routed_scaling_factor, normalize):
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias
    if topk_group < n_group:
        tokens, experts = choice.shape
        grouped = choice.reshape(tokens, n_group, experts // n_group)
        group_scores = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        _, kept = lax.top_k(group_scores, topk_group)
        keep = jnp.any(kept[:, :, None] == jnp.arange(n_group)[None, None, :], axis=1)  # [T, G]
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(tokens, experts)
    _, ids = lax.top_k(choice, topk)
    weights = _gather(scores, ids)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)  # DeepSeek's guard against 0 / 0
    return ids.astype(jnp.int32), weights * jnp.float32(routed_scaling_factor)


@dataclasses.dataclass(frozen=True)
class SoftmaxTopK:
    """Softmax top-k routing (Qwen3-MoE, Mixtral): `router(logits, bias=None) -> (ids, weights)`.

    `probs = softmax(logits)` over all `E` experts in FP32; the `K` experts of largest `probs + bias` are
    chosen (`bias` selects only; without it, the largest `probs`), ordered by that score descending, ties by
    the lower expert index (`lax.top_k` is stable); `weights = probs[ids]`, divided by their FP32 sum if
    `renormalize` (Qwen3's `norm_topk_prob`; Mixtral's softmax over its top-2 logits is the same).

    Attributes:
      topk: `K`, experts per token, a positive int.
      renormalize: bool; True makes each token's `K` weights sum to 1.

    Raises:
      ValueError: at construction, naming a bad `topk` or `renormalize`.
    """

    topk: int
    renormalize: bool = True

    def __post_init__(self):
        object.__setattr__(self, "topk", _positive_int(self.topk, "topk"))
        _flag(self.renormalize, "renormalize")

    def __call__(self, logits, bias=None):
        """Routes `T` tokens over `E` experts; works under `jax.jit`, `jax.vmap` and on a `jax.shard_map` token shard.

        Args:
          logits: `[T, E]`, any float dtype (bf16, f16, f32, f64): upcast to FP32 (f64 rounded to it), all
            arithmetic in FP32.
          bias: optional `[E]` float, added to `probs` for the selection only (DeepSeek's gate does the same
            with a softmax score); None adds nothing.

        Returns:
          `(ids, weights)`: ids int32 `[T, K]`, the chosen experts; weights f32 `[T, K]`, their unbiased
          (renormalized) probabilities.

        Raises:
          ValueError: logits not 2-d or not float, `topk > E`, or `bias` not a float `[E]`; naming the values.
        """
        logits, bias, _ = _check_inputs(logits, bias, self.topk)
        return _softmax_topk(logits, bias, topk=self.topk, renormalize=self.renormalize)


@dataclasses.dataclass(frozen=True)
class SigmoidGroupTopK:
    """Sigmoid group-limited top-k routing (DeepSeek-V3, Kimi K2): `router(logits, bias=None) -> (ids, weights)`.

    `scores = sigmoid(logits)` in FP32; `choice = scores + bias` (`e_score_correction_bias`, for the selection
    only). The `E` experts form `n_group` contiguous groups of `E / n_group`; a group's score is the FP32 sum
    of its two largest `choice`; the `topk_group` best groups are kept (ties: the lower group index), the
    other groups' experts masked to -inf, and the `K` experts of largest masked `choice` chosen, ordered by it
    descending (ties: the lower expert index; `lax.top_k` is stable). `weights = scores[ids]` (unbiased),
    divided by `sum + 1e-20` if `normalize`, then multiplied by `routed_scaling_factor` (rounded to FP32).
    With `topk_group == n_group` nothing is masked. DeepSeek-V3: `SigmoidGroupTopK(8, 8, 4, 2.5)` over 256
    experts; Kimi K2: `SigmoidGroupTopK(8, 1, 1, 2.827)` over 384.

    Attributes:
      topk: `K`, experts per token, a positive int.
      n_group: number of expert groups, a positive int dividing `E`.
      topk_group: groups kept per token, `1 <= topk_group <= n_group`.
      routed_scaling_factor: finite positive float multiplying the weights.
      normalize: bool; True divides the `K` weights by their sum (plus 1e-20) before scaling.

    Raises:
      ValueError: at construction, naming the bad value.
    """

    topk: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    normalize: bool = True

    def __post_init__(self):
        for name in ("topk", "n_group", "topk_group"):
            object.__setattr__(self, name, _positive_int(getattr(self, name), name))
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must not exceed n_group={self.n_group}")
        scale = self.routed_scaling_factor
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"routed_scaling_factor={scale!r} must be a finite positive number")
        object.__setattr__(self, "routed_scaling_factor", float(scale))
        _flag(self.normalize, "normalize")

    def __call__(self, logits, bias=None):
        """Routes `T` tokens over `E` experts; works under `jax.jit`, `jax.vmap` and on a `jax.shard_map` token shard.

        Args:
          logits: `[T, E]`, any float dtype (bf16, f16, f32, f64): upcast to FP32 (f64 rounded to it), all
            arithmetic in FP32.
          bias: optional `[E]` float, the `e_score_correction_bias` (rounded to FP32), used for the selection
            only; None means zeros.

        Returns:
          `(ids, weights)`: ids int32 `[T, K]`, the chosen experts; weights f32 `[T, K]`, their unbiased
          sigmoid scores, normalized if `normalize`, times `routed_scaling_factor`.

        Raises:
          ValueError: logits not 2-d or not float, `E % n_group != 0`, a group of fewer than 2 experts
            (`n_group > 1`), `topk > E`, `topk > topk_group * E / n_group` (too few experts in the kept
            groups), or `bias` not a float `[E]`; naming the values.
        """
        logits, bias, experts = _check_inputs(logits, bias, self.topk)
        if experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide the number of experts E={experts}")
        size = experts // self.n_group
        if self.n_group > 1 and size < 2:
            raise ValueError(
                f"E / n_group = {experts} / {self.n_group} = {size}: a group needs at least 2 experts (its score"
                " is the sum of its top 2)"
            )
        if self.topk > self.topk_group * size:
            raise ValueError(
                f"topk={self.topk} exceeds the {self.topk_group * size} experts of the kept groups"
                f" (topk_group * E / n_group = {self.topk_group} * {experts} / {self.n_group})"
            )
        return _sigmoid_group_topk(
            logits,
            bias,
            topk=self.topk,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            normalize=self.normalize,
        )
