"""The shape of a latent MoE layer's routed traffic: `LatentMoEShape`, the named shapes and `check_max_tokens`."""

from __future__ import annotations

import dataclasses
import numbers
import operator

from jax_latent_ep.kernels.abi import MX_BLOCK, NUM_MAX_RANKS, NUM_MAX_TOKENS_EXCLUSIVE, NUM_MAX_TOPK


def as_int(value, name: str) -> int:
    """`value` as a Python int if it is an integer number: a Python or NumPy integer, or a concrete 0-d integer
    array (NumPy or JAX); raises ValueError naming `name` otherwise (bools and floats included)."""
    if isinstance(value, bool) or (isinstance(value, numbers.Number) and not isinstance(value, numbers.Integral)):
        raise ValueError(f"{name}={value!r} must be an int")
    dtype = getattr(value, "dtype", None)
    if dtype is not None and (getattr(value, "shape", ()) != () or dtype.kind not in "iu"):
        raise ValueError(f"{name}={value!r} must be an int (a 0-d integer array at most)")
    try:
        return operator.index(value)
    except Exception:  # a tracer (not concrete) or another type
        raise ValueError(f"{name}={value!r} must be an int") from None


@dataclasses.dataclass(frozen=True)
class LatentMoEShape:
    """Shape of one latent MoE layer's routed traffic.

    Attributes:
      latent: width `L` of a routed token (BF16 elements); a positive multiple of 32 (one MXFP8 block).
      experts: number of routed experts `E`, split evenly over the ranks.
      topk: experts per token `K`, `1 <= K <= 32`, `K <= experts`.

    Raises:
      ValueError: naming the value and the rule it breaks.
    """

    latent: int = 3584
    experts: int = 896
    topk: int = 16

    def __post_init__(self):
        for name in ("latent", "experts", "topk"):
            object.__setattr__(self, name, as_int(getattr(self, name), name))  # NumPy / JAX ints become ints
        if self.latent <= 0 or self.latent % MX_BLOCK:
            raise ValueError(f"latent={self.latent} must be a positive multiple of {MX_BLOCK}")
        if self.experts <= 0:
            raise ValueError(f"experts={self.experts} must be positive")
        if not 1 <= self.topk <= NUM_MAX_TOPK:
            raise ValueError(f"topk={self.topk} must satisfy 1 <= topk <= {NUM_MAX_TOPK}")
        if self.topk > self.experts:
            raise ValueError(f"topk={self.topk} must not exceed experts={self.experts}")

    @property
    def num_sf(self) -> int:
        """E8M0 scale bytes per row, `latent // 32`."""
        return self.latent // MX_BLOCK

    def check_ranks(self, ranks: int) -> int:
        """Returns `ranks` if `1 <= ranks <= 32` and `experts % ranks == 0`, else raises ValueError."""
        ranks = as_int(ranks, "ranks")
        if not 1 <= ranks <= NUM_MAX_RANKS:
            raise ValueError(f"ranks={ranks} must satisfy 1 <= ranks <= {NUM_MAX_RANKS}")
        if self.experts % ranks:
            raise ValueError(f"ranks={ranks} must divide experts={self.experts} (experts % ranks == 0)")
        return ranks

    def num_local_experts(self, ranks: int) -> int:
        """Experts per rank, `experts // ranks`; expert `e` lives on rank `e // num_local_experts`."""
        return self.experts // self.check_ranks(ranks)


def check_max_tokens(max_tokens: int) -> int:
    """Returns `max_tokens` (as a Python int; NumPy / JAX integers accepted) if `1 <= max_tokens < 2**16`,
    else raises ValueError."""
    max_tokens = as_int(max_tokens, "max_tokens")
    if not 1 <= max_tokens < NUM_MAX_TOKENS_EXCLUSIVE:
        raise ValueError(f"max_tokens={max_tokens} must satisfy 1 <= max_tokens < {NUM_MAX_TOKENS_EXCLUSIVE}")
    return max_tokens


#: Kimi K3's latent MoE: 3584-wide latent, 896 routed experts, top-16.
KIMI_K3 = LatentMoEShape(latent=3584, experts=896, topk=16)
#: DeepSeek-V3's MoE: 7168-wide hidden state, 256 routed experts, top-8.
DEEPSEEK_V3 = LatentMoEShape(latent=7168, experts=256, topk=8)
#: The named shapes (the AOT build's default variants, the demo's and the tools' `--shape`).
SHAPES = {"kimi_k3": KIMI_K3, "deepseek_v3": DEEPSEEK_V3}
