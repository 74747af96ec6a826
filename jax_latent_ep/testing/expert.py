"""The jnp twin of `model.toy_expert`: a simple expert stage whose output the NumPy model reproduces bit for bit."""

from __future__ import annotations

import jax.numpy as jnp

from jax_latent_ep.numerics import mxfp8_dequantize
from jax_latent_ep.received import Received


def toy_expert(recv: Received, rank, local: int):
    """`out[row] = bf16(dequant(x[row]) * c[row])`, `c[row]` the FP32 sum (k ascending, from 0) over the row's
    local ids of `weights[row, k] * (1 + (ids[row, k] % 7) / 8)`. bf16 `[N*S, L]`."""
    xf = mxfp8_dequantize(recv.x, recv.sf)
    c = jnp.zeros(recv.ids.shape[0], jnp.float32)
    for k in range(recv.ids.shape[1]):
        ids = recv.ids[:, k]
        term = recv.weights[:, k] * (1 + (ids % 7).astype(jnp.float32) / 8)
        c = jnp.where(ids // local == rank, c + term, c)
    return (xf * c[:, None]).astype(jnp.bfloat16)
