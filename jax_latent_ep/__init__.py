"""jax_latent_ep: expert-parallel MoE dispatch and combine for JAX (NVLink kernels and an XLA backend).

The shape and layout definitions import without JAX (the kernel build uses them); everything else is loaded
on first use.
"""

from jax_latent_ep.shapes import DEEPSEEK_V3, KIMI_K3, LatentMoEShape
from jax_latent_ep.layout import EpLayout, stride

_LAZY = {
    "ExpertParallel": "jax_latent_ep.api",
    "Received": "jax_latent_ep.received",
    "mxfp8_quantize": "jax_latent_ep.numerics",
    "mxfp8_dequantize": "jax_latent_ep.numerics",
    "rms_norm": "jax_latent_ep.numerics",
}

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


#: Submodules kept at the package's top level for users (`from jax_latent_ep import moe`).
_MODULES = {"moe": "jax_latent_ep.example.moe", "dense": "jax_latent_ep.dense"}


def __getattr__(name):
    if name in _LAZY or name in _MODULES:
        import importlib

        if name in _MODULES:
            value = importlib.import_module(_MODULES[name])
        else:
            value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jax_latent_ep' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_MODULES))
