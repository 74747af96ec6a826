"""The float64 NumPy model of `layer.MoELayer`, token by token, with the layer's bf16 and MXFP8 roundings."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jax_latent_ep.testing import model

BF16 = ml_dtypes.bfloat16


def bf16(a) -> np.ndarray:
    """float64 values of `a` rounded to bf16 (nearest even)."""
    return np.asarray(a, np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def mxfp8(a) -> np.ndarray:
    """float64 values of bf16 `a` `[..., L]` after the MXFP8 round trip (exact in bf16)."""
    q, sf = model.mxfp8_quantize(np.asarray(a, np.float64).astype(np.float32).astype(BF16))
    return model.mxfp8_dequantize(q, sf).astype(np.float64)


def weights64(w) -> np.ndarray:
    """float64 `[E, in, out]` of an expert weight in the stage's layout: bf16, `BlockScaled` (or `BlockScaledOutIn`),
    `MXFP4`, `Int8PerChannel`."""
    from jax_latent_ep import experts
    from jax_latent_ep.testing.experts import dequantized

    if isinstance(w, experts.BlockScaledOutIn):
        w = experts.fp8_in_out(w)
    if isinstance(w, experts.MXFP4):
        return dequantized(w).astype(np.float64)  # exact: e2m1 times a power of two
    if isinstance(w, experts.BlockScaled):
        b = experts.FP8_BLOCK
        scale = np.asarray(w.scale, np.float64).repeat(b, 1).repeat(b, 2)
        return np.asarray(w.values).astype(np.float64) * scale
    if isinstance(w, experts.Int8PerChannel):
        return np.asarray(w.values).astype(np.float64) * np.asarray(w.scale, np.float64)[:, None, :]
    return np.asarray(w).astype(np.float64)


class _PerExpert:
    """An expert weight `[E, in, out]` read one expert at a time in float64 (cached): a model-sized checkpoint in
    float64 would not fit."""

    def __init__(self, w):
        self.w, self.shape, self._cache = w, tuple(w.shape), {}

    def __getitem__(self, e: int) -> np.ndarray:
        if e not in self._cache:
            w = self.w
            one = type(w)(*(a[e : e + 1] for a in w)) if isinstance(w, tuple) else w[e : e + 1]
            self._cache[e] = weights64(one)[0]
        return self._cache[e]


def layer(x, params: dict, ids, weights, *, ranks: int, norm: bool = False, eps: float = 1e-6,
          latent: bool = False, shared: bool = False, mx: bool = True) -> np.ndarray:
    """bf16 (as float64) `[T, D]`: the layer on tokens `x` `[T, D]` with routing `ids`, `weights` `[T, K]`.

    Per token: `a = mxfp8(bf16(x @ latent_down))` (or of `bf16(x)`); each distinct expert `e` of its ids (weight: the
    sum of its slots') gives `y_e = bf16(silu(a @ g_e) * (a @ u_e)) @ d_e` (with FP8 or MXFP4 weights `h` rounded to
    MXFP8 first); rank `d`'s partial is `bf16(sum of its experts' w_e * y_e)` in ascending first slot; the routed
    value is `bf16(sum_d partial_d)` in ascending `d`, RMS-normed with `norm` (bf16); then `@ latent_up` and the shared
    expert's `bf16(silu(x g) * (x u)) @ d` are added, rounded once. Sums in float64. `mx=False`: the dispatched
    rows stay bf16 (a bf16 layer without MXFP8, the yardstick of `docs/porting.md`'s error figure)."""
    from jax_latent_ep import experts

    xb = bf16(x)
    wg, wu, wd = (_PerExpert(params[k]) for k in ("w_gate", "w_up", "w_down"))
    fp8_down = isinstance(params["w_down"], (experts.BlockScaled, experts.BlockScaledOutIn, experts.MXFP4))
    n_exp = wd.shape[0]
    local = n_exp // ranks
    a = bf16(xb @ np.asarray(params["latent_down"], np.float64)) if latent else xb
    a = mxfp8(a) if mx else a
    out = np.zeros((xb.shape[0], wd.shape[2]), np.float64)
    for t in range(xb.shape[0]):
        first: dict[int, float] = {}
        for k, e in enumerate(ids[t]):
            e = int(e)
            if 0 <= e < n_exp:
                first[e] = first.get(e, 0.0) + float(weights[t, k])
        partial = np.zeros((ranks, wd.shape[2]))
        for e, c in first.items():
            with np.errstate(over="ignore"):
                g, u = a[t] @ wg[e], a[t] @ wu[e]
                h = bf16(g / (1 + np.exp(-g)) * u)
            if fp8_down:
                h = mxfp8(h)
            partial[e // local] += c * (h @ wd[e])
        out[t] = bf16(np.sum(bf16(partial), axis=0))
    if norm:
        w = np.asarray(params["norm"], np.float64)
        out = bf16(out / np.sqrt(np.mean(out * out, axis=-1, keepdims=True) + eps) * w)
    y = out @ np.asarray(params["latent_up"], np.float64) if latent else out
    if shared:
        g = xb @ np.asarray(params["shared_gate"], np.float64)
        u = xb @ np.asarray(params["shared_up"], np.float64)
        with np.errstate(over="ignore"):
            h = bf16(g / (1 + np.exp(-g)) * u)
        y = y + h @ np.asarray(params["shared_down"], np.float64)
    return bf16(y)


def random_params(rng: np.random.Generator, *, hidden: int, experts: int, intermediate: int, fmt: str = "bf16",
                  latent: int | None = None, shared_intermediate: int = 0, bias: bool = False) -> dict:
    """Random weights of a `MoELayer` (normal, scaled by 1 / sqrt(fan-in)): expert weights drawn as a checkpoint
    stores them (`[E, out, in]`) in `fmt` ("bf16", "fp8": 128 x 128 blocks, "fp8-out-in": the same kept `[out, in]`
    for "gmm" / "wgmma", "mxfp4": e2m1 codes and an E8M0 scale per 32 inputs, "int8": a scale per output channel)
    and turned into the layer's layout by `layer.expert_weights`; the rest bf16 (`router_bias` float32)."""
    import jax.numpy as jnp

    from jax_latent_ep.experts import quantize_fp8, quantize_mxfp4
    from jax_latent_ep.layer import expert_weights

    d, e, i = hidden, experts, intermediate
    lw = latent or d

    def normal(*shape):
        return rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(shape[-1 if len(shape) == 3 else 0]))

    def ckpt(out_dim, in_dim):
        w = normal(e, out_dim, in_dim)
        if fmt == "bf16":
            return expert_weights(jnp.asarray(w, jnp.bfloat16))
        if fmt in ("fp8", "fp8-out-in"):
            q = quantize_fp8(jnp.asarray(np.swapaxes(w, 1, 2), jnp.float32))  # [E, in, out]
            return expert_weights(jnp.swapaxes(q.values, 1, 2), jnp.swapaxes(q.scale, 1, 2),
                                  impl="gmm" if fmt == "fp8-out-in" else None)
        if fmt == "mxfp4":
            q = quantize_mxfp4(jnp.asarray(np.swapaxes(w, 1, 2), jnp.float32))  # codes [E, out, in / 2]
            return expert_weights(q.values, q.scale)
        if fmt == "int8":
            s = np.abs(w).max(axis=2) / 127.0
            return expert_weights(jnp.asarray(np.round(w / s[:, :, None]), jnp.int8), jnp.asarray(s, jnp.float32))
        raise ValueError(f"random_params: fmt={fmt!r} must be bf16, fp8, fp8-out-in, mxfp4 or int8")

    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    p = {"router": bf(normal(d, e)), "w_gate": ckpt(i, lw), "w_up": ckpt(i, lw), "w_down": ckpt(lw, i)}
    if bias:
        p["router_bias"] = jnp.asarray(rng.standard_normal(e) * 0.1, jnp.float32)
    if latent:
        p["latent_down"], p["latent_up"] = bf(normal(d, lw)), bf(normal(lw, d))
        p["norm"] = bf(1 + 0.1 * rng.standard_normal(lw))
    if shared_intermediate:
        s = shared_intermediate
        p["shared_gate"], p["shared_up"], p["shared_down"] = bf(normal(d, s)), bf(normal(d, s)), bf(normal(s, d))
    return p


def route(router, x, params: dict):
    """`router` on float64 logits of the same bf16 values the layer multiplies: (ids int [T, K], float64 weights)."""
    import jax.numpy as jnp

    logits = bf16(x) @ np.asarray(params["router"], np.float64)
    ids, w = router(jnp.asarray(logits, jnp.float32), params.get("router_bias"))
    return np.asarray(ids), np.asarray(w, np.float64)


def assert_close(got, want):
    """The layer's tolerance against this model: relative L2 below 1e-2 and no element off by more than 5 % of the
    output's RMS. The model sums in float64 where the layer sums in FP32, so an intermediate bf16 rounding (`h`, a
    rank's partial, the routed value) may land one ulp (2^-8) apart on a few elements; a wrong expert, token, weight
    or scale is off by O(1)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    rms = np.sqrt(np.mean(want**2))
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    worst = np.max(np.abs(got - want)) / rms
    assert rel < 1e-2 and worst < 0.05, f"relative L2 {rel:.3g}, worst element {worst:.3g} of the RMS"
