"""jax_latent_ep: expert-parallel MoE dispatch and combine for JAX (NVLink kernels and an XLA backend)."""

from jax_latent_ep.config import DEEPSEEK_V3, KIMI_K3, LatentMoEShape
from jax_latent_ep.layout import EpLayout, stride

__all__ = ["DEEPSEEK_V3", "KIMI_K3", "EpLayout", "LatentMoEShape", "stride"]
__version__ = "0.1.0"
