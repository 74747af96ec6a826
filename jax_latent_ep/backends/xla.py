"""The XLA backend: dispatch / combine from XLA collectives only, exactly the contract's results on any device.

Called inside `jax.shard_map` over one mesh axis of size `N`. Per call and rank:

dispatch: quantize `x` to MXFP8 (`numerics.mxfp8_quantize`), pack each token's row (x, sf, ids, weights,
  src as bytes), build one `[N, S, B]` send buffer (block `d`, row `t`: the token's row if `d` is in
  `D(t)`, else the empty row of destination `d`), and exchange it with one `lax.all_to_all`: block `s` of
  what rank `d` receives is source `s`'s block for `d`, so the result is already source-major
  (row `s * S + t`), the contract's static layout. Each rank sends `N * S` rows of `B` bytes (the same rows
  the NVLink kernels own in the symmetric buffer); nothing is gathered to every rank.
combine: `out` `[N*S, L]` goes back with one `lax.all_to_all` of `[N, S, L]` bf16 (block `s` to source `s`),
  so source `r` holds `P[t, d]` for every destination `d`; `routed[t]` is the FP32 sum over `d in D(t)` in
  ascending `d` starting from 0, rounded once to bf16; then optionally `numerics.rms_norm`.

Exactness on GPUs: XLA's default `xla_allow_excess_precision` lets the GPU compiler drop an f32 -> bf16 -> f32
(or f32 -> float8 -> f32) convert pair, i.e. skip a rounding. Dispatch moves the MXFP8 rows as bytes (bitcasts
keep the rounding) and combine puts an `optimization_barrier` between the BF16 rounding of the routed latent
and the RMSNorm, so the results stay the contract's (checked on 2 x H200, jax 0.11.2, N = 1, 2).

Ids outside `[0, E)` (without the API's `check_ids`): they select no destination, in dispatch and combine
alike, and travel unchanged in the received `ids` (where no rank sees them as local). A token with no valid
id reaches no rank and its routed latent is 0.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_latent_ep.shapes import LatentMoEShape, check_max_tokens
from jax_latent_ep.layout import stride
from jax_latent_ep.numerics import mxfp8_quantize, rms_norm
from jax_latent_ep.received import Received


def _to_bytes(a):
    """`[R, C]` array of a 1-, 2- or 4-byte dtype -> uint8 `[R, C * itemsize]`."""
    size = jnp.dtype(a.dtype).itemsize
    if size == 1:
        return lax.bitcast_convert_type(a, jnp.uint8)
    return lax.bitcast_convert_type(a, jnp.uint8).reshape(*a.shape[:-1], a.shape[-1] * size)


def _from_bytes(b, dtype):
    size = jnp.dtype(dtype).itemsize
    if size == 1:
        return lax.bitcast_convert_type(b, dtype)
    return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], b.shape[-1] // size, size), dtype)


def destination_mask(ids, experts: int, ranks: int):
    """bool `[T, N]`: whether token `t` has an expert on rank `d` (ids outside `[0, experts)` select none)."""
    local = experts // ranks
    valid = (ids >= 0) & (ids < experts)
    dest = jnp.where(valid, ids // local, -1)  # [T, K]
    return jnp.any(dest[:, :, None] == jnp.arange(ranks, dtype=ids.dtype)[None, None, :], axis=1)


class XlaBackend:
    """Dispatch / combine of one mesh axis through `lax.all_to_all` (see the module docstring).

    Args:
      mesh: the `jax.sharding.Mesh`.
      axis_name: the expert-parallel axis of `mesh`; its size `N` must be allowed by `shape`.
      max_tokens: the largest `T` of a call; fixes `S = stride(max_tokens)`.
      shape: the layer's `LatentMoEShape`.
    """

    name = "xla"

    def __init__(self, mesh, axis_name: str, max_tokens: int, shape: LatentMoEShape):
        self.mesh, self.axis_name, self.shape = mesh, axis_name, shape
        self.max_tokens = check_max_tokens(max_tokens)
        self.ranks = shape.check_ranks(int(dict(mesh.shape)[axis_name]))
        self.local = shape.num_local_experts(self.ranks)
        self.stride = stride(max_tokens)

    def dispatch(self, x, ids, weights) -> Received:
        """Per rank, inside `jax.shard_map` over `axis_name`: the contract's dispatch.

        Args:
          x: bfloat16 `[T, L]`, `1 <= T <= max_tokens`.
          ids: int32 `[T, K]` global expert ids (ids outside `[0, E)` select no rank; see the module docstring).
          weights: float32 `[T, K]` routing weights.

        Returns:
          `Received(x, sf, ids, weights, src)` with `N * S` rows (see `jax_latent_ep.received.Received`).

        `jax_latent_ep.ExpertParallel.dispatch` is the checked public entry; this method checks no argument.
        """
        n, s_rows, shp = self.ranks, self.stride, self.shape
        lat, nsf, k = shp.latent, shp.num_sf, shp.topk
        t_count = x.shape[0]
        rank = lax.axis_index(self.axis_name).astype(jnp.int32)
        q, sf = mxfp8_quantize(x)
        src = (rank << 16) | jnp.arange(t_count, dtype=jnp.int32)
        row = jnp.concatenate(
            [_to_bytes(q), sf, _to_bytes(ids), _to_bytes(weights), _to_bytes(src[:, None])], axis=1
        )  # [T, B]
        pad = s_rows - t_count
        row = jnp.pad(row, ((0, pad), (0, 0)))
        member = jnp.pad(destination_mask(ids, shp.experts, n), ((0, pad), (0, 0)))  # [S, N]
        # The empty row of each destination d: x, sf zero; ids ((d + 1) % N) * local; weights 0; src -1.
        dests = jnp.arange(n, dtype=jnp.int32)
        empty_ids = jnp.broadcast_to((((dests + 1) % n) * self.local)[:, None], (n, k))
        empty = jnp.concatenate(
            [
                jnp.zeros((n, lat + nsf), jnp.uint8),
                _to_bytes(empty_ids),
                jnp.zeros((n, 4 * k), jnp.uint8),
                jnp.full((n, 4), 0xFF, jnp.uint8),
            ],
            axis=1,
        )  # [N, B]
        send = jnp.where(member.T[:, :, None], row[None, :, :], empty[:, None, :])  # [N(dst), S, B]
        recv = lax.all_to_all(send, self.axis_name, 0, 0, tiled=True) if n > 1 else send
        recv = recv.reshape(n * s_rows, -1)  # [N(src) * S, B]
        o = 0
        rx = _from_bytes(recv[:, o : o + lat], jnp.float8_e4m3fn); o += lat
        rsf = recv[:, o : o + nsf]; o += nsf
        rids = _from_bytes(recv[:, o : o + 4 * k], jnp.int32); o += 4 * k
        rw = _from_bytes(recv[:, o : o + 4 * k], jnp.float32); o += 4 * k
        rsrc = _from_bytes(recv[:, o : o + 4], jnp.int32)[:, 0]
        return Received(rx, rsf, rids, rw, rsrc)

    def combine(self, out, ids, norm_weight=None, eps: float = 1e-5):
        """Per rank, inside `jax.shard_map` over `axis_name`: the contract's combine.

        Args:
          out: bfloat16 `[N*S, L]`, the expert output of every receive row (rows with `src == -1` are ignored).
          ids: int32 `[T, K]`, the same ids as this layer's dispatch.
          norm_weight: bfloat16 `[L]`, or None for the routed latent without RMSNorm.
          eps: RMSNorm epsilon (used only with `norm_weight`).

        Returns:
          bfloat16 `[T, L]`: each own token's routed latent (FP32 sum over its ranks, one bf16 rounding),
          RMS-normed with `norm_weight` unless that is None.

        `jax_latent_ep.ExpertParallel.combine` is the checked public entry; this method checks no argument.
        """
        n, s_rows = self.ranks, self.stride
        t_count = ids.shape[0]
        parts = out.reshape(n, s_rows, self.shape.latent)  # block s: rows of source s
        if n > 1:
            parts = lax.all_to_all(parts, self.axis_name, 0, 0, tiled=True)  # block d: P[., d]
        member = destination_mask(ids, self.shape.experts, n)  # [T, N]

        acc = jnp.zeros((t_count, self.shape.latent), jnp.float32)
        for d in range(n):  # ascending d, FP32 from 0, one rounding at the end
            acc = jnp.where(member[:, d, None], acc + parts[d, :t_count].astype(jnp.float32), acc)
        # XLA simplifies `0 + p` to `p`, which keeps a -0 that the IEEE sum from +0 turns into +0 (a sum
        # from +0 is never -0): restore that.
        acc = jnp.where(acc == 0, jnp.float32(0), acc)
        routed = acc.astype(jnp.bfloat16)
        if norm_weight is None:
            return routed
        # The barrier keeps the BF16 rounding: with XLA's default `xla_allow_excess_precision` the GPU
        # compiler otherwise removes the f32 -> bf16 -> f32 convert pair and normalizes the unrounded sum.
        return rms_norm(lax.optimization_barrier(routed), norm_weight, eps)

    def close(self):
        pass
