"""Random layer inputs of the harness: BF16 tokens over a wide range of scales (with subnormal, zero and
non-finite blocks on demand) and top-k routings."""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def make_tokens(rng, tokens, shape, special):
    """Random BF16 tokens with per-token scales over a wide range; `special` adds a tiny block with FP32
    subnormals and, if 'nonfinite', a NaN and an Inf block."""
    latent = shape.latent
    scale = np.exp2(rng.integers(-20, 21, size=(tokens, 1))).astype(np.float32)
    x = (rng.standard_normal((tokens, latent), dtype=np.float32) * scale)
    blocks = x.reshape(tokens, latent // 32, 32)
    blocks *= np.exp2(rng.integers(-6, 7, size=(tokens, latent // 32, 1))).astype(np.float32)
    x = x.astype(BF16)
    if special:
        t = rng.integers(tokens)
        b = rng.integers(latent // 32)
        tiny = (rng.standard_normal(32).astype(np.float32) * np.float32(2.0**-128)).astype(BF16)
        tiny[0] = BF16(2.0**-116)  # e = 3: the FP32-subnormal elements must flush to 0 (ftz)
        x[t, 32 * b : 32 * b + 32] = tiny
        x[(t + 1) % tokens, 0:32] = BF16(0.0)  # an all-zero block
        if special == "nonfinite":
            x[t, (32 * b + 64) % latent] = BF16(np.nan)
            x[(t + 1) % tokens, 40] = BF16(np.inf)
    return x


def make_routing(rng, tokens, shape):
    """K distinct uniform experts per token (argpartition of random keys) and uniform [0, 1) weights, not
    normalized (the kernels carry any FP32 weight)."""
    keys = rng.random((tokens, shape.experts))
    ids = np.argpartition(keys, shape.topk, axis=1)[:, : shape.topk].astype(np.int32)
    weights = rng.random((tokens, shape.topk), dtype=np.float32)
    return ids, weights
