"""A two-layer dispatch / expert / combine case, run on a backend and checked against the NumPy model.

Used by the single-process tests (N virtual CPU devices) and by every rank of the multi-process tests.

Layer 1: `recv1 = dispatch(x, ids, w)`, `out1 = toy_expert(recv1)` with junk in the empty rows,
`routed = combine(out1, ids)`. Layer 2 chains: `recv2 = dispatch(routed, ids, w)`, `out2` likewise,
`normed = combine(out2, ids, norm_weight, eps)`. Every received row and `routed` must equal the model bit for
bit; `normed` may differ by 1 bf16 ulp on at most 1% of its elements (exact `1/sqrt` and NumPy summation order
in the model).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jax_latent_ep.shapes import LatentMoEShape
from jax_latent_ep.layout import stride
from jax_latent_ep.testing import model, routing
from jax_latent_ep.testing.expert import toy_expert

BF16 = ml_dtypes.bfloat16
EPS = 1e-5


def random_latent(rng: np.random.Generator, lead: tuple[int, ...], latent: int, special: bool = True) -> np.ndarray:
    """bf16 `[..., L]` of normal values with per-block scales over 2^-20..2^20; with `special`, the first
    token's first blocks hold an all-(+/-)zero block, a tiny block with bf16 subnormals (the ftz case) and
    a block of large values (2^60)."""
    lead = tuple(lead)
    blocks = latent // 32
    scale = np.exp2(rng.integers(-20, 21, size=(*lead, blocks, 1))).astype(np.float32)
    v = (rng.standard_normal((*lead, blocks, 32)).astype(np.float32) * scale).reshape(*lead, latent)
    if special and blocks >= 4:
        first = v.reshape(-1, latent)[0]
        first[0:32] = np.where(rng.random(32) < 0.5, np.float32(-0.0), np.float32(0.0))
        tiny = rng.standard_normal(32).astype(np.float32) * np.float32(2.0**-121)
        tiny[::3] = rng.standard_normal(len(tiny[::3])).astype(np.float32) * np.float32(2.0**-130)  # bf16 subnormals
        first[32:64] = tiny
        first[64:96] = rng.standard_normal(32).astype(np.float32) * np.float32(2.0**60)
    return v.astype(BF16)


@dataclasses.dataclass
class Case:
    """The inputs of one `two_layers` case, stacked over ranks (rank `r`'s arrays are `x[r]`, `ids[r]`, ...).

    Attributes:
      shape: the layer's `LatentMoEShape` (L, E, K).
      ranks: `N`, ranks of the expert-parallel axis.
      tokens: `T`, tokens per rank in both layers.
      max_tokens: the backend's `max_tokens` (`T <= max_tokens`); `S = stride(max_tokens)`.
      x: bf16 `[N, T, L]`, layer 1's tokens (`random_latent`, with its special blocks).
      ids: int32 `[N, T, K]`, global expert ids, the same in both layers.
      weights: f32 `[N, T, K]`, routing weights, the same in both layers.
      junk: bf16 `[2, N, N*S, L]`, what each layer's expert stage leaves in the empty rows (combine ignores it).
      norm_weight: bf16 `[L]`, layer 2's RMSNorm weight.
    """

    shape: LatentMoEShape
    ranks: int
    tokens: int
    max_tokens: int
    x: np.ndarray  # bf16 [N, T, L]
    ids: np.ndarray  # int32 [N, T, K]
    weights: np.ndarray  # f32 [N, T, K]
    junk: np.ndarray  # bf16 [2, N, N*S, L]: what the expert stage leaves in empty rows
    norm_weight: np.ndarray  # bf16 [L]

    @property
    def rows(self) -> int:
        return self.ranks * stride(self.max_tokens)


def make_case(seed: int, shape: LatentMoEShape, ranks: int, tokens: int, max_tokens: int,
              routing_name: str = "random_topk") -> Case:
    """A fresh random `Case`, reproducible from `seed`: tokens from `random_latent`, ids / weights from the
    routing generator `routing_name` (`routing.GENERATORS`), junk ~ N(0, 1e3), norm_weight ~ 1 + N(0, 0.25)."""
    rng = np.random.default_rng(seed)
    x = random_latent(rng, (ranks, tokens), shape.latent)
    ids, weights = routing.generate(routing_name, rng, (ranks, tokens), shape, ranks)
    rows = ranks * stride(max_tokens)
    junk = (rng.standard_normal((2, ranks, rows, shape.latent)) * 1e3).astype(BF16)
    norm_weight = (1 + 0.25 * rng.standard_normal(shape.latent)).astype(BF16)
    return Case(shape, ranks, tokens, max_tokens, x, ids.astype(np.int32), weights.astype(np.float32), junk, norm_weight)


def two_layers(ep):
    """The per-rank function (to run inside `jax.shard_map` over `ep.axis_name`)."""
    local = ep.shape.num_local_experts(ep.ranks)

    def f(x, ids, weights, junk, norm_weight):
        rank = lax.axis_index(ep.axis_name)
        recv1 = ep.dispatch(x, ids, weights)
        out1 = jnp.where(recv1.src[:, None] == -1, junk[0], toy_expert(recv1, rank, local))
        routed = ep.combine(out1, ids)
        recv2 = ep.dispatch(routed, ids, weights)
        out2 = jnp.where(recv2.src[:, None] == -1, junk[1], toy_expert(recv2, rank, local))
        normed = ep.combine(out2, ids, norm_weight, EPS)
        return tuple(recv1), routed, tuple(recv2), normed

    return f


def chained_layers(ep, mesh, layers: int, scan: bool):
    """A jitted program over `mesh`'s `ep.axis_name` axis: `layers` chained layers (dispatch, toy expert, combine
    without norm; unrolled, or in one `lax.scan` with `scan`), then one normed layer.

    Takes `(x, ids, weights, norm_weight)` as `sharded_inputs` places them (x bf16 [N*T, L], ids int32 [N*T, K],
    weights f32 [N*T, K] sharded over ranks; norm_weight bf16 [L] replicated) and returns `(routed, normed)`, bf16
    [N*T, L] each: the last unnormed layer's output and the normed layer's."""
    local = ep.shape.num_local_experts(ep.ranks)
    axis = ep.axis_name

    def layer(x, ids, weights, *norm):
        return ep.combine(toy_expert(ep.dispatch(x, ids, weights), lax.axis_index(axis), local), ids, *norm)

    def f(x, ids, weights, norm_weight):
        if scan:
            x, _ = lax.scan(lambda c, _: (layer(c, ids, weights), None), x, None, length=layers)
        else:
            for _ in range(layers):
                x = layer(x, ids, weights)
        return x, layer(x, ids, weights, norm_weight, EPS)

    spec = jax.sharding.PartitionSpec(axis)
    replicated = jax.sharding.PartitionSpec()
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec, spec, replicated), out_specs=spec))


def sharded_inputs(case: Case, mesh, axis: str):
    """New device buffers holding `case`'s inputs as `chained_layers` takes them: `[x, ids, weights, norm_weight]`
    (the per-rank arrays flattened over ranks and sharded over `axis`; norm_weight replicated)."""
    P = jax.sharding.PartitionSpec

    def put(a, spec):
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))

    flat = [a.reshape(case.ranks * a.shape[1], *a.shape[2:]) for a in (case.x, case.ids, case.weights)]
    return [put(a, P(axis)) for a in flat] + [put(case.norm_weight, P())]


def model_two_layers(case: Case):
    """The model's results of `two_layers`: (recv1, routed, recv2, normed), arrays stacked over ranks."""
    kw = dict(shape=case.shape, max_tokens=case.max_tokens)
    n = case.ranks

    def experts(recv, junk):
        outs = []
        for d in range(n):
            o = model.toy_expert(recv.x[d], recv.sf[d], recv.ids[d], recv.weights[d], d, shape=case.shape, ranks=n)
            outs.append(np.where(recv.src[d][:, None] == -1, junk[d], o))
        return np.stack(outs)

    recv1 = model.dispatch(case.x, case.ids, case.weights, **kw)
    routed = model.combine(experts(recv1, case.junk[0]), case.ids, None, **kw)
    recv2 = model.dispatch(routed, case.ids, case.weights, **kw)
    normed = model.combine(experts(recv2, case.junk[1]), case.ids, case.norm_weight, EPS, **kw)
    return recv1, routed, recv2, normed


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def compare_received(got, want, rank: int, label: str):
    """Asserts that one rank's received rows equal the model's: ids / weights / src everywhere, x / sf bits
    where `src != -1`."""
    gx, gsf, gids, gw, gsrc = (np.asarray(a) for a in got)
    wx, wsf, wids, ww, wsrc = (a[rank] for a in want)
    where = f"{label}, rank {rank}"
    np.testing.assert_array_equal(gsrc, wsrc, err_msg=f"{where}: src")
    np.testing.assert_array_equal(gids, wids, err_msg=f"{where}: ids")
    np.testing.assert_array_equal(_bits(gw), _bits(ww), err_msg=f"{where}: weights (bits)")
    valid = wsrc != -1
    # NaN elements (blocks of non-finite input) are compared by NaN-ness: the NaN's sign bit is the platform's.
    gnan, wnan = np.isnan(gx.astype(np.float32)), np.isnan(wx.astype(np.float32))
    np.testing.assert_array_equal(gnan[valid], wnan[valid], err_msg=f"{where}: x NaN positions (valid rows)")
    keep = valid[:, None] & ~wnan
    np.testing.assert_array_equal(_bits(gx)[keep], _bits(wx)[keep], err_msg=f"{where}: x (MXFP8 bits, valid rows)")
    np.testing.assert_array_equal(gsf[valid], wsf[valid], err_msg=f"{where}: sf (valid rows)")
    return int(valid.sum())


def compare_rank(got, want, rank: int) -> dict:
    """Compares one rank's results of `two_layers` (`got` = numpy arrays of that rank) with the model's
    (`model_two_layers`): received rows and routed latent bit for bit, normed within 1 bf16 ulp on at most 1%
    of its elements. Returns statistics: valid rows seen, normed elements that differ by 1 ulp, normed elements."""
    g_recv1, g_routed, g_recv2, g_normed = got
    w_recv1, w_routed, w_recv2, w_normed = want
    rows = compare_received(g_recv1, w_recv1, rank, "layer 1 dispatch")
    np.testing.assert_array_equal(_bits(g_routed), _bits(w_routed[rank]), err_msg=f"rank {rank}: routed latent (bits)")
    rows += compare_received(g_recv2, w_recv2, rank, "layer 2 dispatch")
    ulps = model.bf16_ulp_diff(np.asarray(g_normed), w_normed[rank])
    assert ulps.max() <= 1, f"rank {rank}: normed differs by up to {ulps.max()} bf16 ulp (allowed 1)"
    one_ulp = int((ulps == 1).sum())
    # The contract: 1 ulp on a small fraction only. Observed <= 0.05% per rank (XLA, CPU tests) and ~5e-6 overall
    # (kernels, the kernel harness); 1% (at least 1 element, for tiny outputs) leaves a wide margin.
    allowed = max(1, ulps.size // 100)
    assert one_ulp <= allowed, (
        f"rank {rank}: {one_ulp} of {ulps.size} normed elements differ by 1 bf16 ulp (allowed {allowed})")
    return {"valid_rows": rows, "normed_1ulp": one_ulp, "normed_elems": int(ulps.size)}


def run_case(ep, case: Case):
    """Runs `two_layers` under `jax.jit(jax.shard_map(...))` on `ep.mesh` (all devices addressable) and
    returns per-rank numpy results: a list over ranks of (recv1, routed, recv2, normed)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh, axis = ep.mesh, ep.axis_name
    n, t, rows = case.ranks, case.tokens, case.rows
    spec = P(axis)
    flat = lambda a: a.reshape(n * a.shape[1], *a.shape[2:])  # noqa: E731
    args = [flat(case.x), flat(case.ids), flat(case.weights)]
    junk = np.moveaxis(case.junk, 0, 1).reshape(n * 2, rows, -1)  # [N*2, rows, L]: rank-major
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    inputs = [put(a, spec) for a in args] + [put(junk, spec), put(case.norm_weight, P())]
    fn = jax.jit(jax.shard_map(two_layers(ep), mesh=mesh, in_specs=(spec, spec, spec, spec, P()), out_specs=spec))
    res = jax.tree.map(np.asarray, fn(*inputs))
    recv1, routed, recv2, normed = res
    per = []
    for r in range(n):
        rs = lambda a, m: a[r * m:(r + 1) * m]  # noqa: E731
        per.append((
            tuple(rs(a, rows) for a in recv1), rs(routed, t), tuple(rs(a, rows) for a in recv2), rs(normed, t)))
    return per
