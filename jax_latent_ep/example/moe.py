"""An example latent MoE decode layer on `ExpertParallel`, and the same model on one device for checking.

One layer, per rank (inside `jax.shard_map` over the expert-parallel axis, `T` tokens per rank):

    ids, weights = top-k of softmax-free router logits, weights = softmax over the k chosen (normalized)
    x      = bf16(h @ down)                       hidden H -> latent L
    recv   = ep.dispatch(x, ids, weights)         MXFP8 rows of every token that has an expert here
    out    = experts.expert_stage(recv, ...)    the routed experts' SwiGLU, weighted per row, bf16 [N*S, L]
    y      = ep.combine(out, ids, norm, eps)      routed latent, RMS-normed
    h      = h + bf16(y @ up)                     latent L -> hidden H, residual

The expert stage is `jax_latent_ep.experts` (plan the (row, local expert) pairs, a grouped SwiGLU
`down(bf16(silu(x @ gate) * (x @ up)))` with FP32 accumulation, `impl` "ragged_dot" by default) with a small
intermediate size (default 32). Expert weights `w_gate`, `w_up` `[E, L, I]`, `w_down [E, I, L]` are sharded
over the axis (rank `d` holds experts `d * E/N ...`); everything else is replicated. `reference_forward`
computes the same layers on one device with no collectives: each rank's receive rows built as dispatch lays
them out, the same expert stage on them, the per-rank partials summed over the token's ranks in ascending
order in FP32 like combine.

Padding: `forward(params, h, live)` takes the live token count of every rank (int32 `[N]`); a rank's tokens
`t >= live[r]` are padding: their ids are all `-1` (the "no expert" id), so they are sent nowhere, their
routed latent is exactly 0 and the layer passes them through unchanged (`h + bf16(0 @ up) = h`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_latent_ep import experts
from jax_latent_ep.experts.stage import swiglu_rows
from jax_latent_ep.shapes import LatentMoEShape
from jax_latent_ep.received import Received
from jax_latent_ep.layout import stride
from jax_latent_ep.autodiff import mxfp8_round_trip, positive_zero
from jax_latent_ep.numerics import rms_norm

#: A small latent MoE for CPU tests and the demo.
SMALL = LatentMoEShape(latent=512, experts=64, topk=4)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sizes of the example model: `shape` (L, E, K), hidden size, expert intermediate size, layer count."""

    shape: LatentMoEShape = SMALL
    hidden: int = 256
    intermediate: int = 32
    layers: int = 2
    eps: float = 1e-5


def init_params(key, cfg: MoEConfig) -> dict:
    """Random parameters, stacked over layers: router [Ly,H,E], down [Ly,H,L], w_gate and w_up [Ly,E,L,I],
    w_down [Ly,E,I,L], up [Ly,L,H], norm [Ly,L]; all bf16."""
    s, h, i, ly = cfg.shape, cfg.hidden, cfg.intermediate, cfg.layers
    k = jax.random.split(key, 7)

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(fan_in)).astype(jnp.bfloat16)

    return {
        "router": normal(k[0], (ly, h, s.experts), h),
        "down": normal(k[1], (ly, h, s.latent), h),
        "w_gate": normal(k[2], (ly, s.experts, s.latent, i), s.latent),
        "w_up": normal(k[6], (ly, s.experts, s.latent, i), s.latent),
        "w_down": normal(k[3], (ly, s.experts, i, s.latent), i),
        "up": normal(k[4], (ly, s.latent, h), s.latent),
        "norm": (1 + 0.1 * jax.random.normal(k[5], (ly, s.latent))).astype(jnp.bfloat16),
    }


def param_specs(axis_name: str) -> dict:
    """PartitionSpecs: expert weights sharded over `axis_name` (their expert dimension), the rest replicated."""
    return {
        "router": P(),
        "down": P(),
        "w_gate": P(None, axis_name),
        "w_up": P(None, axis_name),
        "w_down": P(None, axis_name),
        "up": P(),
        "norm": P(),
    }


def route(h, router, topk: int):
    """The router: top-k experts of each token and their normalized weights.

    Args:
      h: bf16 `[T, H]`, the tokens' hidden states.
      router: bf16 `[H, E]`, the router projection.
      topk: `K`, experts per token.

    Returns:
      `(ids, weights)`: ids int32 `[T, K]`, the global expert ids of the `K` largest FP32 logits `h @ router`
      (largest first); weights f32 `[T, K]`, the softmax over those `K` logits (each row sums to 1).
    """
    return top_k_softmax(jnp.dot(h, router, preferred_element_type=jnp.float32), topk)


#: Tokens up to which `top_k_softmax(method="auto")` ranks without a sort: K3's layer on an H100, T = 1: 9 us less
#: than `lax.top_k`; T = 8 even; T = 32 / 128: 31 / 120 us more (docs/performance.md).
RANK_MAX_TOKENS = 8


def top_k_softmax(logits, topk: int, method: str = "top_k"):
    """`route`'s `(ids, weights)` from FP32 logits `[T, E]` of one's own (`dense.matmul(..., out_dtype=f32)`).

    `method` "top_k" is `lax.top_k`; "rank" the same ids without a sort: each logit's rank is the number of logits
    that beat it (larger, or equal at a lower index, `lax.top_k`'s order), and slot `r` takes the one of rank `r`
    (two fused comparisons over `[T, E, E]` and `[T, K, E]`, for a decode step's few tokens; no NaN logits);
    "auto" ranks up to `RANK_MAX_TOKENS` tokens, else `lax.top_k`."""
    if method == "auto":
        method = "rank" if logits.shape[0] <= RANK_MAX_TOKENS else "top_k"
    if method == "top_k":
        top, ids = lax.top_k(logits, topk)
    elif method == "rank":
        e = logits.shape[-1]
        idx = jnp.arange(e, dtype=jnp.int32)
        mine, other = logits[:, :, None], logits[:, None, :]
        beats = (other > mine) | ((other == mine) & (idx[None, None, :] < idx[None, :, None]))
        rank = jnp.sum(beats, axis=-1, dtype=jnp.int32)  # [T, E]
        slot = rank[:, None, :] == jnp.arange(topk, dtype=jnp.int32)[None, :, None]  # [T, K, E]
        # one variadic reduce: ids and values in one kernel (two sums made two; the softmax stays apart)
        ids, top = lax.reduce((jnp.where(slot, idx, 0), jnp.where(slot, logits[:, None, :], 0.0)),
                              (jnp.int32(0), jnp.float32(0.0)), lambda a, b: (a[0] + b[0], a[1] + b[1]), (2,))
    else:
        raise ValueError(f"top_k_softmax: method must be 'top_k', 'rank' or 'auto', got {method!r}")
    return ids.astype(jnp.int32), jax.nn.softmax(top, axis=-1).astype(jnp.float32)


def local_coefficients(ids, weights, first_expert, local: int):
    """f32 [R, local]: the summed routing weight of each of the experts `first_expert + j` in each row."""
    experts = first_expert + jnp.arange(local, dtype=jnp.int32)
    hit = ids[:, :, None] == experts[None, None, :]  # [R, K, local]
    return jnp.sum(jnp.where(hit, weights[:, :, None], 0.0), axis=1)


def experts_mlp(xf, w1, w2, coef):
    """The former dense expert stage (every local expert on every row, FP32), kept for comparison (the
    benchmark's "dense-f32" path); the model uses `jax_latent_ep.experts`.

    Args:
      xf: f32 `[R, L]`, the rows' latents (dequantized MXFP8; zero rows where nothing was received).
      w1: bf16 `[J, L, I]`, the first projection of each of the rank's `J` local experts.
      w2: bf16 `[J, I, L]`, their second projection.
      coef: f32 `[R, J]`, the routing weight of local expert `j` in row `r` (0 where the row does not use it;
        see `local_coefficients`).

    Returns:
      bf16 `[R, L]`: `sum_j coef[:, j] * (silu(xf @ w1[j]) @ w2[j])`, computed in FP32 and rounded once.
    """
    hid = jax.nn.silu(jnp.einsum("rl,jli->rji", xf, w1.astype(jnp.float32)))
    y = jnp.einsum("rji,jil->rjl", hid, w2.astype(jnp.float32))
    return jnp.einsum("rj,rjl->rl", coef, y).astype(jnp.bfloat16)


def pad_ids(ids, live):
    """`ids` with every slot of the padded tokens (`t >= live`, `live` an int32 scalar or None) set to -1."""
    if live is None:
        return ids
    t = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(t < live, ids, experts.NO_EXPERT)


def layer(ep, p: dict, h, eps: float, live=None):
    """One layer on one rank, inside `jax.shard_map` over `ep.axis_name` (see the module docstring).

    Args:
      ep: the `ExpertParallel` of the axis (`N = ep.ranks` ranks, `ep.shape` = (L, E, K)).
      p: this layer's parameters as this rank sees them (one layer of `init_params`, sharded by
        `param_specs`): router bf16 `[H, E]`, down bf16 `[H, L]`, w_gate and w_up bf16 `[E/N, L, I]`, w_down
        bf16 `[E/N, I, L]` (this rank's experts only), up bf16 `[L, H]`, norm bf16 `[L]`.
      h: bf16 `[T, H]`, this rank's tokens.
      eps: the RMSNorm epsilon of combine.
      live: None, or an int32 scalar: this rank's live tokens (the rest are padding, routed to no expert).

    Returns:
      bf16 `[T, H]`: `h` plus the up-projection of the tokens' RMS-normed routed latent (`h` itself for a
      padded token).
    """
    return _layer(ep, p, h, eps, live)[0]


def _layer(ep, p: dict, h, eps: float, live=None, impl: str = "ragged_dot"):
    """`layer`, and this rank's routing ids int32 `[T, K]` of the layer."""
    local = ep.shape.num_local_experts(ep.ranks)
    rank = lax.axis_index(ep.axis_name).astype(jnp.int32)
    ids, weights = route(h, p["router"], ep.shape.topk)
    ids = pad_ids(ids, live)
    x = jnp.dot(h, p["down"], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    recv, xf = ep.dispatch(x, ids, weights, dequantize=True)  # xf: the dequantized rows, the path of x's gradient
    pl = experts.plan(recv, rank, local, max_tokens=ep.max_tokens, ranks=ep.ranks)
    out = swiglu_rows(pl, xf.astype(jnp.bfloat16), p["w_gate"], p["w_up"], p["w_down"], impl=impl)
    y = ep.combine(out, ids, p["norm"], eps)
    return h + jnp.dot(y, p["up"], preferred_element_type=jnp.float32).astype(jnp.bfloat16), ids


def make_forward(ep, cfg: MoEConfig, scan: bool = True, per_layer: bool = False, impl: str = "ragged_dot",
                 remat: bool = False):
    """`forward(params, h, live=None)`: all `cfg.layers` layers in one `jax.jit(jax.shard_map(...))` over
    `ep.mesh`, as a `lax.scan` over the stacked layer parameters (one layer compiled) or unrolled (`scan=False`);
    with `remat`, each layer is a `jax.checkpoint` (its activations are recomputed in the backward pass).
    Differentiable (`jax.grad`; `jax_latent_ep.autodiff` has the rules of dispatch and combine).

    `h` is bf16 [N*T, H] sharded over the axis (rank `r` owns rows `r*T ... r*T + T - 1`); params as
    `param_specs` shards them (see `shard_params`); `live`, int32 [N] or None, the live token count of each
    rank (its other tokens are padding). Returns bf16 [N*T, H]; with `per_layer` (for tests), `(hs, ids)`
    instead: every layer's output bf16 [Ly, N*T, H] and routing ids int32 [Ly, N*T, K]. `impl`: the expert
    stage's implementation (`experts.IMPLEMENTATIONS`)."""
    axis = ep.axis_name
    run_layer = _layer
    if remat:  # ep, eps and impl are static; the layer's collectives are recomputed with it
        run_layer = jax.checkpoint(_layer, static_argnums=(0, 3, 5))

    def body(params, h, live):
        lv = None if live is None else live[0]
        one = lambda h, p: run_layer(ep, p, h, cfg.eps, lv, impl)  # noqa: E731

        def step(h, p):  # per_layer: the carry, and the layer's (output, ids)
            out, ids = one(h, p)
            return out, (out, ids)

        if per_layer:
            if scan:
                return lax.scan(step, h, params)[1]
            outs = []
            for i in range(cfg.layers):
                h, out = step(h, jax.tree.map(lambda a: a[i], params))
                outs.append(out)
            return jax.tree.map(lambda *a: jnp.stack(a), *outs)
        if not scan:
            for i in range(cfg.layers):
                h = one(h, jax.tree.map(lambda a: a[i], params))[0]
            return h
        return lax.scan(lambda h, p: (one(h, p)[0], None), h, params)[0]

    out_specs = (P(None, axis), P(None, axis)) if per_layer else P(axis)
    specs = param_specs(axis)

    def forward(params, h, live=None):
        if live is None:
            sm = jax.shard_map(lambda p, h: body(p, h, None), mesh=ep.mesh, in_specs=(specs, P(axis)), out_specs=out_specs)
            return sm(params, h)
        sm = jax.shard_map(body, mesh=ep.mesh, in_specs=(specs, P(axis), P(axis)), out_specs=out_specs)
        return sm(params, h, live)

    return jax.jit(forward)


def shard_params(params: dict, mesh, axis_name: str) -> dict:
    """Places `params` on `mesh` as `param_specs` says."""
    specs = param_specs(axis_name)
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}


def reference_layer(p: dict, h, shape: LatentMoEShape, ranks: int, eps: float, live=None):
    """One layer for all `N*T` tokens on one device, no collectives: what `layer` computes on `N` ranks.

    It lays the computation out as the ranks do, with array shapes equal to theirs (so XLA picks the same
    kernels and the result is normally bit-identical): every rank's tokens are routed and projected on their
    own (`lax.map` over ranks), rank `d`'s expert input is the `[N*S, L]` block of rows its dispatch would
    receive (zero rows and non-local ids elsewhere), and each token's routed latent sums its ranks' partials
    in ascending order in FP32, rounded once, like combine.

    Args:
      p: this layer's full parameters (one layer of `init_params`, all experts): router bf16 `[H, E]`, down
        bf16 `[H, L]`, w_gate and w_up bf16 `[E, L, I]`, w_down bf16 `[E, I, L]`, up bf16 `[L, H]`, norm
        bf16 `[L]`.
      h: bf16 `[N*T, H]`, every rank's tokens, rank-major (rows `r*T ... r*T + T - 1` are rank `r`'s).
      shape: the layer's `LatentMoEShape` (L, E, K).
      ranks: `N`, the number of ranks to model (`shape.check_ranks(N)`); `S = stride(T)`.
      eps: the RMSNorm epsilon.
      live: None, or int32 `[N]`: each rank's live token count (its later tokens are padding).

    Returns:
      bf16 `[N*T, H]`, the layer's output for every token, laid out like `h`.
    """
    return _reference_layer(p, h, shape, ranks, eps, live)[0]


def _reference_layer(p: dict, h, shape: LatentMoEShape, ranks: int, eps: float, live=None, impl="ragged_dot"):
    """`reference_layer`, and the routing ids int32 `[N*T, K]` of the layer."""
    local = shape.num_local_experts(ranks)
    t = h.shape[0] // ranks
    s_rows = stride(t)
    hs = h.reshape(ranks, t, h.shape[1])
    rank_ids = jnp.arange(ranks, dtype=jnp.int32)

    lives = jnp.full((ranks,), t, jnp.int32) if live is None else jnp.asarray(live, jnp.int32)

    def project(args):
        hr, lv = args
        ids, w = route(hr, p["router"], shape.topk)
        ids = pad_ids(ids, lv)
        x = jnp.dot(hr, p["down"], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        member = jnp.any(ids[:, :, None] // local == rank_ids[None, None, :], axis=1)  # [T, N]
        # Dispatch's rows, with dispatch's straight-through gradient (the round trip keeps the FP8 rounding).
        return ids, w, mxfp8_round_trip(x), member

    ids, w, xf, member = lax.map(project, (hs, lives))  # [N, T, ...]
    src = (rank_ids[:, None] << 16) | jnp.arange(t, dtype=jnp.int32)[None, :]  # [N, T]
    pad = ((0, 0), (0, s_rows - t), (0, 0))

    def expert_rank(args):  # the rows rank d receives, and its experts' output for them
        d, wg, wu, wd = args
        m = member[:, :, d][..., None]  # [N, T, 1]
        empty = ((d + 1) % ranks) * local
        rows_x = jnp.pad(jnp.where(m, xf, 0.0), pad).reshape(ranks * s_rows, -1)
        rows_ids = jnp.pad(jnp.where(m, ids, empty), pad, constant_values=0).reshape(ranks * s_rows, -1)
        rows_ids = jnp.where(jnp.pad(jnp.broadcast_to(m, ids.shape), pad).reshape(rows_ids.shape), rows_ids, empty)
        rows_w = jnp.pad(jnp.where(m, w, 0.0), pad).reshape(ranks * s_rows, -1)
        rows_src = jnp.pad(jnp.where(m[..., 0], src, -1), pad[:2], constant_values=-1).reshape(-1)
        rows = Received(None, None, rows_ids, rows_w, rows_src)  # the plan reads ids, weights, src only
        pl = experts.plan(rows, d, local, max_tokens=t, ranks=ranks)
        return swiglu_rows(pl, rows_x.astype(jnp.bfloat16), wg, wu, wd, impl=impl)

    split = lambda a: a.reshape(ranks, local, *a.shape[1:])  # noqa: E731
    outs = lax.map(expert_rank, (rank_ids, split(p["w_gate"]), split(p["w_up"]), split(p["w_down"])))

    def combine_rank(args):
        r, hr, mr = args
        parts = lax.dynamic_slice_in_dim(outs, r * s_rows, t, axis=1)  # [N(d), T, L]
        acc = jnp.zeros((t, shape.latent), jnp.float32)
        for d in range(ranks):
            acc = jnp.where(mr[:, d, None], acc + parts[d].astype(jnp.float32), acc)
        acc = positive_zero(acc)  # combine's sum from +0 (and its identity gradient)
        y = rms_norm(lax.optimization_barrier(acc.astype(jnp.bfloat16)), p["norm"], eps)  # as combine does
        return hr + jnp.dot(y, p["up"], preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    return lax.map(combine_rank, (rank_ids, hs, member)).reshape(h.shape), ids.reshape(-1, shape.topk)


def make_reference_forward(cfg: MoEConfig, ranks: int, per_layer: bool = False, impl: str = "ragged_dot"):
    """`forward(params, h_all, live=None)`: the whole model for all `N*T` tokens on one device (put the inputs
    on one device; `live` as `make_forward` takes it). One jitted layer, applied `cfg.layers` times (one
    compilation). Returns bf16 [N*T, H]; with `per_layer`, `(hs, ids)` as `make_forward(..., per_layer=True)`
    returns them."""
    one = jax.jit(lambda p, h, live: _reference_layer(p, h, cfg.shape, ranks, cfg.eps, live, impl))

    def forward(params, h, live=None):
        outs = []
        for i in range(cfg.layers):
            h, ids = one(jax.tree.map(lambda a: a[i], params), h, live)
            outs.append((h, ids))
        return jax.tree.map(lambda *a: jnp.stack(a), *outs) if per_layer else h

    return forward
