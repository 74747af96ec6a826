"""`MoELayer`: one MoE layer over `ExpertParallel` in a model's own token layout, routers and checkpoint weights.

    layer = MoELayer(mesh, hidden=7168, experts=384, topk=8, router=SigmoidGroupTopK(8, routed_scaling_factor=2.827),
                     ep_axis="ep", tp_axis="tp", max_tokens=128)
    y = layer(x, params)               # x [..., D] bf16: inside the model's shard_map, or outside it (global arrays)

Per call, on each rank of the expert-parallel axis (`N` ranks, `J = E / N` local experts):

1. tokens: `x` `[..., D]` flattened to `[T, D]`. Sharded over the EP axis (each rank holds its own tokens), or
   replicated over it (every rank of the axis holds the same tokens, as most JAX MoE models keep them): then each
   rank takes its own `ceil(T / N)` of them and the outputs are gathered back, so every token's expert work is done
   once. The layout is read from the arrays (`tokens="auto"`: the EP axis in `x`'s varying axes inside a
   `shard_map` with `check_vma=True`, in `token_axes` outside one) or given (`tokens="sharded" | "replicated"`).
2. padding: the rank's `t` tokens are padded to the smallest token bucket `b >= t` (`buckets`, powers of two up to
   `max_tokens` by default) with `-1` ids ("no expert"); each bucket has its own `ExpertParallel`, so the receive
   rows, the plan and the expert work follow the call's `T`, not the largest. Padded rows are dropped after.
3. routing: `(ids, weights)` given, or `router(x @ w_router, bias)` (`jax_latent_ep.routers`); the routing weights
   multiply the expert outputs (after the expert).
4. optional latent projection `bf16(x @ w_latent_down)` (`L` = `latent`; without it `L = D`), `ep.dispatch`
   (MXFP8 rows), the grouped SwiGLU of the local experts (`jax_latent_ep.experts`), `ep.combine` (FP32 sum over
   the token's ranks; RMS-normed with `norm_weight` where `norm=True`), optional `@ w_latent_up`.
5. optional shared expert(s): a dense SwiGLU of the rank's tokens (several shared experts are one with their
   intermediate sizes concatenated), added to the routed output in FP32 before the one bf16 rounding.

Tensor parallelism (`tp_axis`): each rank of that axis holds a slice of every expert's (and the shared expert's) FFN
dimension `I`; its partial outputs are summed over the axis in FP32 (`lax.psum`) before their one bf16 rounding.
Tokens are replicated over `tp_axis`. Weights: `expert_weights` turns checkpoint tensors (`[E, out, in]`: bf16, FP8
with a 128 x 128 block `weight_scale_inv`, int8 with a scale per output channel) into the stage's layout;
`param_specs` gives their shardings.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_latent_ep import experts
from jax_latent_ep.api import ExpertParallel
from jax_latent_ep.autodiff import varying_axes
from jax_latent_ep.experts import IMPLEMENTATIONS, OVERFLOW_POLICIES
from jax_latent_ep.shapes import LatentMoEShape

#: Token layouts over the expert-parallel axis.
LAYOUTS = ("auto", "sharded", "replicated")


def default_buckets(max_tokens: int) -> tuple[int, ...]:
    """Powers of two below `max_tokens`, and `max_tokens` itself."""
    out, b = [], 1
    while b < max_tokens:
        out.append(b)
        b *= 2
    return tuple(out) + (max_tokens,)


def expert_weights(w, scale=None, *, impl: str | None = None):
    """A checkpoint's expert weight `[E, out, in]` in the stage's `[E, in, out]` layout and format.

    Args:
      w: bfloat16 `[E, out, in]`; or float8_e4m3fn with `scale` float32 `[E, out / 128, in / 128]` (the
        checkpoint's `weight_scale_inv`: `w * scale` per 128 x 128 block, DeepSeek-V3 / Kimi K2); or MXFP4, uint8
        `[E, out, in / 2]` e2m1 codes (the even input in the low nibble) with `scale` uint8 `[E, out, in / 32]`
        (E8M0; Kimi K3, gpt-oss: its `blocks [E, out, in / 32, 16]` reshaped); or int8 with `scale` float32
        `[E, out]` (one scale per output channel).
      scale: as above; None for bf16.
      impl: the expert stage implementation that will multiply the weights (`MoELayer`'s `impl`), or None: FP8
        weights stay `[out, in]` (`experts.BlockScaledOutIn`, no copy) where it multiplies that layout ("gmm",
        "wgmma": the FP8 tensor cores), else are transposed to `experts.BlockScaled`.

    Returns:
      bf16 `[E, in, out]`, `experts.BlockScaled` or `BlockScaledOutIn`, `experts.MXFP4` (kept `[out, in]`) or
      `experts.Int8PerChannel`.

    Raises:
      ValueError: any other dtype or a scale of another shape, naming the format.
    """
    dtype = jnp.dtype(w.dtype)
    if w.ndim != 3:
        raise ValueError(f"expert_weights: w must be [E, out, in], got {dtype.name}{list(w.shape)}")
    e, n_out, n_in = w.shape
    if dtype == jnp.bfloat16 and scale is None:
        return jnp.swapaxes(w, 1, 2)
    if dtype == jnp.float8_e4m3fn:
        block = experts.FP8_BLOCK
        want = (e, n_out // block, n_in // block)
        if scale is None or tuple(scale.shape) != want or n_out % block or n_in % block:
            got = None if scale is None else f"{jnp.dtype(scale.dtype).name}{list(scale.shape)}"
            raise ValueError(f"expert_weights: FP8 weights [E, out, in] = {list(w.shape)} need out and in multiples "
                             f"of {block} and scale (weight_scale_inv) float32{list(want)}, got {got}")
        if impl is not None and experts.takes(impl, experts.BlockScaledOutIn):
            return experts.BlockScaledOutIn(w, scale.astype(jnp.float32))
        return experts.BlockScaled(jnp.swapaxes(w, 1, 2), jnp.swapaxes(scale, 1, 2).astype(jnp.float32))
    if dtype == jnp.uint8:
        want = (e, n_out, 2 * n_in // experts.MX_BLOCK)
        if scale is None or tuple(scale.shape) != want or scale.dtype != jnp.uint8:
            got = None if scale is None else f"{jnp.dtype(scale.dtype).name}{list(scale.shape)}"
            raise ValueError(f"expert_weights: MXFP4 weights [E, out, in / 2] = {list(w.shape)} (two e2m1 codes a "
                             f"byte) need an E8M0 scale uint8{list(want)} (one per {experts.MX_BLOCK} inputs), got "
                             f"{got}")
        return experts.MXFP4(w, scale)
    if dtype == jnp.int8:
        if scale is None or tuple(scale.shape) != (e, n_out):
            got = None if scale is None else f"{jnp.dtype(scale.dtype).name}{list(scale.shape)}"
            raise ValueError(f"expert_weights: int8 weights [E, out, in] = {list(w.shape)} need a per-output-channel "
                             f"scale float32[{e}, {n_out}], got {got}")
        return experts.Int8PerChannel(jnp.swapaxes(w, 1, 2), scale.astype(jnp.float32))
    raise ValueError(f"expert_weights: the format {dtype.name}{' with a scale' if scale is not None else ''} is not "
                     "supported: give bf16, float8_e4m3fn with a 128 x 128 block scale, uint8 MXFP4 codes with "
                     "their E8M0 scales, or int8 with a scale per output channel")


def _gather_tokens(y, axis: str):
    """`y` `[t, D]` of every rank of `axis`, concatenated in rank order, invariant over `axis` (the replicated
    layout's output)."""
    try:
        return lax.all_gather(y, axis, tiled=True, to="invarying")
    except TypeError:  # a JAX whose all_gather has no `to`: a psum of each rank's block in place (exact: x + 0)
        n, t = lax.axis_size(axis), y.shape[0]
        full = jnp.zeros((n * t,) + y.shape[1:], y.dtype)
        return lax.psum(lax.dynamic_update_slice_in_dim(full, y, lax.axis_index(axis) * t, 0), axis)


class MoELayer:
    """One MoE layer (module docstring) over the mesh axis `ep_axis`.

    Args:
      mesh: the `jax.sharding.Mesh` (it holds `ep_axis`, `tp_axis` if given, and any data axes).
      hidden: `D`, the tokens' width.
      experts: `E`, routed experts (`E % N == 0`).
      topk: `K`, experts per token.
      intermediate: `I`, each routed expert's FFN size (its whole size; each `tp_axis` rank holds `I / TP`).
      router: a router of `jax_latent_ep.routers` (`router(logits, bias) -> (ids, weights)`), or None: the
        caller gives `ids` and `weights`.
      latent: `L` of a latent MoE (K3: projections `D -> L` before dispatch, `L -> D` after), or None (`L = D`).
      shared_intermediate: the shared expert's FFN size (several: their sizes added), or 0 for none.
      norm: RMS-normalize the routed (latent) output in combine (`params["norm"]`), as Kimi K3 does.
      ep_axis, tp_axis: the expert-parallel axis; the tensor-parallel axis over the FFN dimension, or None.
      token_axes: outside a `shard_map`, the mesh axes `x`'s first dimension is sharded over (e.g. `("dp",)`, or
        `("dp", "ep")` for tokens sharded over the EP axis too); its other dimensions are not sharded.
      max_tokens: the most tokens one EP rank brings to one call (after the replicated layout's split).
      buckets: the static token counts compiled for (each at most `max_tokens`), or None: `default_buckets`.
      impl: the expert stage's implementation (`experts.IMPLEMENTATIONS`), default "ragged_dot".
      capacity_factor, overflow: the plan's capacity as a multiple of the uniform expectation of a bucket's pairs,
        or None (the worst case), and what pairs past it meet (`experts.plan`).
      backend: `ExpertParallel`'s backend ("auto", "xla", "nvlink").
      eps: the RMSNorm epsilon.
      **ep_options: passed to every `ExpertParallel` (e.g. `check_ids`, `liveness`).
    """

    def __init__(self, mesh, *, hidden: int, experts: int, topk: int, intermediate: int, router=None,
                 latent: int | None = None, shared_intermediate: int = 0, norm: bool = False, ep_axis: str = "ep",
                 tp_axis: str | None = None, token_axes=(), max_tokens: int = 128, buckets=None,
                 impl: str = "ragged_dot", backend: str = "auto", eps: float = 1e-6,
                 capacity_factor: float | None = None, overflow: str = "error", **ep_options):
        axes = dict(mesh.shape)
        for name, axis in (("ep_axis", ep_axis), ("tp_axis", tp_axis)):
            if axis is not None and axis not in axes:
                raise ValueError(f"MoELayer: {name}={axis!r} is not an axis of the mesh (axes: {list(axes)})")
        token_axes = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes)
        for axis in token_axes:
            if axis not in axes or axis == tp_axis:
                raise ValueError(f"MoELayer: token_axes holds {axis!r}, which is not a data or EP axis of the mesh "
                                 f"(axes: {list(axes)}, tp_axis={tp_axis!r})")
        self.mesh, self.ep_axis, self.tp_axis, self.token_axes = mesh, ep_axis, tp_axis, token_axes
        self.ranks, self.tp = int(axes[ep_axis]), int(axes[tp_axis]) if tp_axis else 1
        self.hidden, self.latent = int(hidden), int(latent) if latent else int(hidden)
        self.has_latent = latent is not None
        self.intermediate, self.shared_intermediate = int(intermediate), int(shared_intermediate)
        if self.intermediate % self.tp or self.shared_intermediate % self.tp:
            raise ValueError(f"MoELayer: intermediate={intermediate} and shared_intermediate={shared_intermediate} "
                             f"must divide over tp_axis={tp_axis!r} of size {self.tp}")
        self.shape = LatentMoEShape(latent=self.latent, experts=experts, topk=topk)
        self.local_experts = self.shape.num_local_experts(self.shape.check_ranks(self.ranks))
        self.router, self.norm, self.eps = router, bool(norm), float(eps)
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"MoELayer: impl={impl!r} must be one of {sorted(IMPLEMENTATIONS)}")
        self.impl = impl
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"MoELayer: overflow={overflow!r} must be one of {OVERFLOW_POLICIES}")
        self.capacity_factor, self.overflow = capacity_factor, overflow
        buckets = default_buckets(int(max_tokens)) if buckets is None else tuple(sorted({int(b) for b in buckets}))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"MoELayer: buckets={buckets} must be positive token counts")
        self.buckets, self.max_tokens = buckets, buckets[-1]
        #: One `ExpertParallel` per token bucket: its receive rows and plan follow the bucket.
        self.eps_by_bucket = {b: ExpertParallel(mesh, ep_axis, max_tokens=b, shape=self.shape, backend=backend,
                                                **ep_options) for b in buckets}
        self.backend = self.eps_by_bucket[buckets[0]].backend

    # -- parameters ----------------------------------------------------------------------------------------

    def param_specs(self, params: dict) -> dict:
        """PartitionSpecs of `params` (a dict as `__call__` takes it): expert weights over `ep_axis` (experts) and
        `tp_axis` (their `I`), the shared expert over `tp_axis`, the rest replicated."""
        ep, tp = self.ep_axis, self.tp_axis

        def expert(name, w):
            i_dim = 2 if name in ("w_gate", "w_up") else 1  # [J, L, I] / [J, I, L]
            spec = [ep, None, None]
            spec[i_dim] = tp
            if isinstance(w, experts.BlockScaled):
                return experts.BlockScaled(P(*spec), P(*spec))
            if isinstance(w, experts.Int8PerChannel):
                return experts.Int8PerChannel(P(*spec), P(ep, tp) if i_dim == 2 else P(ep, None))
            if isinstance(w, (experts.MXFP4, experts.BlockScaledOutIn)):  # kept [J, out, in]: I is dim 1 of
                out_in = P(ep, tp, None) if i_dim == 2 else P(ep, None, tp)  # gate / up, dim 2 of down
                return type(w)(out_in, out_in)
            return P(*spec)

        specs = {}
        for name, w in params.items():
            if name in ("w_gate", "w_up", "w_down"):
                specs[name] = expert(name, w)
            elif name in ("shared_gate", "shared_up"):
                specs[name] = P(None, tp)
            elif name == "shared_down":
                specs[name] = P(tp, None)
            else:
                specs[name] = jax.tree.map(lambda _: P(), w)
        return specs

    def shard_params(self, params: dict) -> dict:
        """`params` placed on the mesh with `param_specs(params)` (each rank holds its experts' slice)."""
        shardings = jax.tree.map(lambda spec: jax.sharding.NamedSharding(self.mesh, spec), self.param_specs(params))
        return jax.device_put(params, shardings)

    def _check_params(self, params: dict):
        need = {"w_gate", "w_up", "w_down"}
        if self.router is not None:
            need.add("router")
        if self.has_latent:
            need |= {"latent_down", "latent_up"}
        if self.norm:
            need.add("norm")
        if self.shared_intermediate:
            need |= {"shared_gate", "shared_up", "shared_down"}
        missing = sorted(need - set(params))
        if missing:
            raise ValueError(f"MoELayer: params lacks {missing} (has {sorted(params)})")

    # -- the call ----------------------------------------------------------------------------------------------

    def __call__(self, x, params: dict, ids=None, weights=None, *, tokens: str = "auto", with_pairs: bool = False):
        """The layer's output for `x`.

        Args:
          x: `[..., D]` tokens (any float dtype; rounded to bf16 once), in the model's layout: inside a
            `shard_map` over the mesh, this rank's block; outside, global arrays with the first dimension sharded
            over `token_axes`.
          params: the weights (`param_specs` gives their shardings): `router` `[D, E]` (any float dtype) and an
            optional `router_bias` `[E]` (selection only), `w_gate`, `w_up` `[E, L, I]` and `w_down` `[E, I, L]`
            in a format of `expert_weights` (inside a `shard_map`: this rank's `[J, L, I / TP]` ...),
            `latent_down` `[D, L]` and `latent_up` `[L, D]` (with `latent`), `norm` `[L]` (with `norm`),
            `shared_gate`, `shared_up` `[D, Is]`, `shared_down` `[Is, D]` (with `shared_intermediate`); bf16.
          ids, weights: int32 `[..., K]` and float `[..., K]` routing (`-1`: no expert), instead of the router.
          tokens: "auto", "sharded" or "replicated": `x`'s layout over `ep_axis` (module docstring).
          with_pairs: also return the (token, local expert) pairs the experts computed and those a
            `capacity_factor` dropped (`overflow="drop"`), each int32 summed over the ranks holding distinct tokens.

        Returns:
          bf16 `[..., D]`, laid out as `x`; with `with_pairs`, `(y, pairs, dropped)`.
        """
        if tokens not in LAYOUTS:
            raise ValueError(f"MoELayer: tokens={tokens!r} must be one of {LAYOUTS}")
        self._check_params(params)
        if (ids is None) != (weights is None) or (ids is None and self.router is None):
            raise ValueError("MoELayer: give both ids and weights, or neither (then the layer's router routes; it "
                             f"has router={self.router!r})")
        try:
            lax.axis_size(self.ep_axis)
            inside = True
        except NameError:
            inside = False
        if inside:
            return self._local(x, params, ids, weights, tokens, with_pairs)
        if tokens == "auto":
            tokens = "sharded" if self.ep_axis in self.token_axes else "replicated"
        rows = P(self.token_axes or None)
        routing = () if ids is None else (ids, weights)
        body = lambda x, p, *r: self._local(x, p, *(r or (None, None)), tokens, with_pairs)  # noqa: E731
        out_specs = (rows, P(), P()) if with_pairs else rows
        in_specs = (rows, self.param_specs(params)) + (rows,) * len(routing)
        args = jax.tree.map(self._place, (x, params) + routing, in_specs)
        f = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)
        return f(*args)

    def _place(self, a, spec):
        """`a` resharded to `spec` on a mesh of explicit axes (where shard_map takes only arrays of its in_specs);
        on other meshes shard_map reshards itself."""
        explicit = getattr(jax.sharding.AxisType, "Explicit", None)
        if explicit is None or explicit not in tuple(getattr(self.mesh, "axis_types", ())):
            return a
        return jax.reshard(a, jax.sharding.NamedSharding(self.mesh, spec))

    def _layout(self, x, tokens: str) -> str:
        if tokens != "auto":
            return tokens
        vma = varying_axes(x)
        if vma is None or not _check_vma():
            raise ValueError(
                f"MoELayer: cannot tell whether x is sharded or replicated over {self.ep_axis!r} here (a shard_map "
                "with check_vma=False types every value alike); pass tokens='sharded' (each EP rank holds its own "
                "tokens) or tokens='replicated' (every EP rank holds the same tokens: each then computes 1/N of them)")
        return "sharded" if self.ep_axis in vma else "replicated"

    def _local(self, x, params, ids, weights, tokens, with_pairs):
        """The layer on one rank, inside the `shard_map`."""
        layout = self._layout(x, tokens)
        if x.shape[-1] != self.hidden:
            raise ValueError(f"MoELayer: x must be [..., D={self.hidden}], got "
                             f"{jnp.dtype(x.dtype).name}{list(x.shape)}")
        lead, k, n = x.shape[:-1], self.shape.topk, self.ranks
        xt = x.reshape(-1, self.hidden).astype(jnp.bfloat16)
        total = xt.shape[0]
        if ids is not None:
            if tuple(ids.shape) != tuple(lead) + (k,) or tuple(weights.shape) != tuple(lead) + (k,):
                raise ValueError(f"MoELayer: ids and weights must be [..., K] = {list(lead) + [k]}, got ids "
                                 f"{list(ids.shape)}, weights {list(weights.shape)}")
            ids = ids.reshape(-1, k).astype(jnp.int32)
            weights = weights.reshape(-1, k).astype(jnp.float32)
        if layout == "replicated":
            per = max(1, math.ceil(total / n))
            xt, ids, weights = (None if a is None else _pad_rows(a, n * per, fill) for a, fill in
                                ((xt, 0), (ids, experts.NO_EXPERT), (weights, 0)))
            rank = lax.axis_index(self.ep_axis)
            xt, ids, weights = (None if a is None else lax.dynamic_slice_in_dim(a, rank * per, per) for a in
                                (xt, ids, weights))
            live = jnp.clip(total - rank * per, 0, per)
        else:
            live = None
        t = xt.shape[0]
        bucket = next((b for b in self.buckets if b >= t), None)
        if bucket is None:
            raise ValueError(f"MoELayer: {t} tokens on one EP rank exceed the largest bucket {self.max_tokens} "
                             f"({total} tokens, layout {layout!r}); build the layer with a larger max_tokens")
        ep = self.eps_by_bucket[bucket]
        if ids is None:
            logits = jnp.dot(xt, params["router"].astype(jnp.bfloat16), preferred_element_type=jnp.float32)
            ids, weights = self.router(logits, params.get("router_bias"))
        xt, ids, weights = _pad_rows(xt, bucket, 0), _pad_rows(ids, bucket, experts.NO_EXPERT), _pad_rows(weights,
                                                                                                       bucket, 0)
        row = jnp.arange(bucket, dtype=jnp.int32)[:, None]
        ids = jnp.where(row < (t if live is None else live), ids, experts.NO_EXPERT)
        xl = _dot(xt, params["latent_down"]).astype(jnp.bfloat16) if self.has_latent else xt
        recv, latent = ep.dispatch(xl, ids, weights, dequantize=True)
        rank = lax.axis_index(self.ep_axis).astype(jnp.int32)
        w = (params["w_gate"], params["w_up"], params["w_down"])
        cap = experts.capacity(n, bucket, k, self.local_experts, self.capacity_factor)
        expected = bucket * k if self.impl in experts.READS_RECEIVED else None  # as the `swiglu` call below
        pl = experts.plan(recv, rank, self.local_experts, max_tokens=bucket, ranks=n,
                          capacity_factor=self.capacity_factor, overflow=self.overflow,
                          impl=experts.default_plan_impl(recv, self.impl, w[2], self.capacity_factor),
                          work_pairs=experts.work_pairs(self.impl, w[2], cap, expected))
        out_dtype = jnp.float32 if self.tp_axis else jnp.bfloat16
        if self.impl in experts.READS_RECEIVED:  # the kernel reads the MXFP8 rows themselves (no VJP)
            out = experts.swiglu(recv, pl, *w, impl=self.impl, expected_pairs=expected, out_dtype=out_dtype)
        else:  # the differentiable path: the dequantized rows (the FP8 tensor cores take the MXFP8 rows themselves)
            out = experts.swiglu_rows(pl, latent.astype(jnp.bfloat16), *w, impl=self.impl, out_dtype=out_dtype,
                                      mx=(recv.x, recv.sf))
        if self.tp_axis:
            out = lax.psum(out, self.tp_axis).astype(jnp.bfloat16)  # FP32 partials over I, one rounding
        y = ep.combine(out, ids, params["norm"] if self.norm else None, self.eps)
        yf = _dot(y, params["latent_up"]) if self.has_latent else y.astype(jnp.float32)
        if self.shared_intermediate:
            yf = yf + self._shared(xt, params)
        y = yf.astype(jnp.bfloat16)[:t]
        if layout == "replicated":
            y = _gather_tokens(y, self.ep_axis)[:total]
        y = y.reshape(*lead, self.hidden)
        if not with_pairs:
            return y
        order = tuple(a for a in self.mesh.axis_names if a == self.ep_axis or a in self.token_axes)
        dropped = pl.dropped if pl.dropped is not None else jnp.zeros((), jnp.int32)
        return y, lax.psum(pl.count, order), lax.psum(dropped, order)  # over every rank of distinct tokens

    def _shared(self, xt, params):
        """FP32 `[t, D]`: the shared expert's SwiGLU on the rank's tokens (summed over `tp_axis` in FP32)."""
        gate, up = _dot(xt, params["shared_gate"]), _dot(xt, params["shared_up"])
        h = (jax.nn.silu(gate) * up).astype(jnp.bfloat16)
        y = _dot(h, params["shared_down"])
        return lax.psum(y, self.tp_axis) if self.tp_axis else y


def _check_vma() -> bool:
    """Whether the enclosing `shard_map` checks varying axes (with `check_vma=False` every value types alike)."""
    from jax._src import config  # no public accessor of the shard_map's flag

    state = getattr(config, "_check_vma", None)
    return bool(state is not None and state.value)


def _dot(a, w):
    return jnp.dot(a.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def _pad_rows(a, rows: int, fill):
    """`a` `[t, ...]` padded with `fill` to `rows` rows (or cut to them)."""
    if a.shape[0] >= rows:
        return a[:rows]
    return jnp.concatenate([a, jnp.full((rows - a.shape[0],) + a.shape[1:], fill, a.dtype)])
