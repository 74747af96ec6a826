"""Where the compiled artifacts are: the FFI library, the cubins and their manifest.

Searched in order, file by file (the first directory holding the wanted file wins):
  1. `$JAX_LATENT_EP_ARTIFACTS`, if set;
  2. `<package>/_artifacts` next to the imported `jax_latent_ep` (a wheel install, or a source tree where
     `python -m jax_latent_ep.runtime.build` wrote the cubins);
  3. the installed distribution's `jax_latent_ep/_artifacts` (found through `importlib.metadata`), for tests
     run from a source checkout whose package shadows the installed one.

A kernel (`runtime.ffi.find_kernel`) is looked up in the first manifest found this way; a variant it lacks comes
from the per-user kernel cache next (`runtime/kernel_cache.py`: `$JAX_LATENT_EP_CACHE`, else
`${XDG_CACHE_HOME:-~/.cache}/jax_latent_ep/kernels`), and is compiled into that cache on demand where
nvidia-cutlass-dsl is installed (else a LookupError names the variant and the command that installs it).

A manifest built from other kernel sources than the imported package's (its `source_sha256`, `runtime/sources.py`)
is read with a `StaleArtifactsWarning`: a checkout edited, or updated, after `pip install .` would otherwise run the
older cubins silently.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import pathlib
import warnings

#: File name of the FFI library inside an artifacts directory.
FFI_LIBRARY = "libjax_latent_ep_ffi.so"
#: File name of the kernel manifest inside an artifacts directory.
MANIFEST = "manifest.json"
#: Environment variable naming an artifacts directory searched first.
ENV_VAR = "JAX_LATENT_EP_ARTIFACTS"
DISTRIBUTION = "jax_latent_ep"


class StaleArtifactsWarning(UserWarning):
    """The cubins found were built from other kernel sources than the imported package's."""


def candidates() -> list[pathlib.Path]:
    """The artifacts directories searched, in order (existing ones only, no duplicates)."""
    found: list[pathlib.Path] = []
    env = os.environ.get(ENV_VAR)
    if env:
        found.append(pathlib.Path(env))
    found.append(pathlib.Path(__file__).resolve().parent.parent / "_artifacts")
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
        found.append(pathlib.Path(dist.locate_file("jax_latent_ep/_artifacts")).resolve())
    except importlib.metadata.PackageNotFoundError:
        pass
    result: list[pathlib.Path] = []
    for path in found:
        if path.is_dir() and path not in result:
            result.append(path)
    return result


def find(name: str) -> pathlib.Path:
    """Path of artifact `name` (e.g. `FFI_LIBRARY`, `MANIFEST`) in the first directory holding it.

    Raises:
      FileNotFoundError: naming every directory searched and how to build the artifacts.
    """
    searched = candidates()
    for directory in searched:
        path = directory / name
        if path.is_file():
            return path
    where = ", ".join(str(p) for p in searched) or "(none exists)"
    raise FileNotFoundError(
        f"jax_latent_ep artifact {name!r} not found; searched ${ENV_VAR}, the package's _artifacts and the "
        f"installed distribution's: {where}. Build them with `pip install .` (FFI library and cubins) or "
        f"`python -m jax_latent_ep.runtime.build --out jax_latent_ep/_artifacts` (cubins only)."
    )


@functools.cache
def _manifest(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    built = manifest.get("source_sha256")
    if built is not None:
        from jax_latent_ep.runtime import sources

        current = sources.source_sha256()
        if built != current:
            warnings.warn(
                f"jax_latent_ep: {path} was built from other kernel sources ({built[:12]}) than the imported "
                f"package's ({current[:12]}), so its cubins may not be this code's kernels: rebuild them (`pip "
                f"install .`, or `python -m jax_latent_ep.runtime.build --out {pathlib.Path(path).parent}`), or "
                f"point ${ENV_VAR} at a build of these sources", StaleArtifactsWarning, stacklevel=3)
    return manifest


def manifest() -> tuple[pathlib.Path, dict]:
    """(directory, parsed manifest.json) of the first artifacts directory holding a manifest."""
    path = find(MANIFEST)
    return path.parent, _manifest(str(path))
