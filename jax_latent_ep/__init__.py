"""jax_latent_ep: expert-parallel MoE dispatch and combine for JAX (NVLink kernels and an XLA backend)."""

from jax_latent_ep.api import ExpertParallel
from jax_latent_ep.config import DEEPSEEK_V3, KIMI_K3, LatentMoEShape
from jax_latent_ep.layout import EpLayout, stride
from jax_latent_ep.numerics import mxfp8_dequantize, mxfp8_quantize, rms_norm
from jax_latent_ep.types import Received

__all__ = [
    "DEEPSEEK_V3",
    "KIMI_K3",
    "EpLayout",
    "ExpertParallel",
    "LatentMoEShape",
    "Received",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "rms_norm",
    "stride",
]
__version__ = "0.1.0"
