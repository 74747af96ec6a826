"""The backends of `ExpertParallel` and how one is chosen: each backend says why it cannot serve a mesh.

    xla     XLA collectives (`lax.all_to_all`), any device: the reference the kernels are tested against.
    nvlink  the CuTe DSL kernels over NVLink symmetric memory, CUDA GPUs of compute capability 9.0 / 10.0.

`unavailable(name, mesh)` is None when backend `name` can serve `mesh`, else the reason; `load(name)` imports
its class (the nvlink backend's module needs the GPU stack, so it is imported only when chosen).
"""

from __future__ import annotations

import importlib

import numpy as np

#: Backend names, with "auto" (nvlink where it can serve the mesh and N > 1, else xla).
NAMES = ("auto", "xla", "nvlink")
#: name -> (module, class) of each concrete backend.
_CLASSES = {"xla": ("jax_latent_ep.backends.xla", "XlaBackend"),
            "nvlink": ("jax_latent_ep.backends.nvlink", "NvlinkBackend")}
#: Compute capabilities the sm_90a / sm_100a cubins load on (an "a" cubin loads on exactly one).
NVLINK_CAPABILITIES = {"9.0": "sm_90a", "10.0": "sm_100a"}


def _devices(mesh) -> list:
    return list(np.asarray(mesh.devices).flat)


def _all_cuda(mesh) -> bool:
    devices = _devices(mesh)
    for d in devices:
        if d.platform != "gpu":
            return False
        version = str(getattr(d.client, "platform_version", "")).lower()
        if "rocm" in version or "hip" in version:
            return False
    return bool(devices)


def _artifacts_missing() -> str | None:
    """None if the FFI library and the kernel manifest are found, else why not."""
    try:
        from jax_latent_ep.runtime import artifacts

        artifacts.find(artifacts.MANIFEST)
        artifacts.find(artifacts.FFI_LIBRARY)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _nvlink_unavailable(mesh) -> str | None:
    if not _all_cuda(mesh):
        kinds = sorted({d.platform for d in _devices(mesh)})
        return f"not every mesh device is a CUDA GPU (platforms: {kinds})"
    ccs = sorted({str(getattr(d, "compute_capability", "")) for d in _devices(mesh)})
    if any(cc not in NVLINK_CAPABILITIES for cc in ccs):
        return f"the kernels are built for sm_90a and sm_100a only (compute capabilities: {ccs})"
    missing = _artifacts_missing()
    if missing is not None:
        return f"the kernel artifacts are missing ({missing})"
    try:
        load("nvlink")
    except Exception as e:  # pragma: no cover - depends on the GPU stack
        return f"jax_latent_ep.backends.nvlink does not import: {type(e).__name__}: {e}"
    return None


_UNAVAILABLE = {"xla": lambda mesh: None, "nvlink": _nvlink_unavailable}


def unavailable(name: str, mesh) -> str | None:
    """None if backend `name` ("xla" or "nvlink") can serve `mesh`, else why not (one line)."""
    return _UNAVAILABLE[name](mesh)


def load(name: str):
    """The class of backend `name` ("xla" or "nvlink")."""
    module, cls = _CLASSES[name]
    return getattr(importlib.import_module(module), cls)
