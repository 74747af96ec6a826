"""The per-user kernel cache: cubins of shapes / rank counts the package was not built with, compiled on demand.

    <cache>/L<L>_E<E>_K<K>_n<N>_<arch>/<package version>-<source sha256[:16]>-cutlass<version>/
        dispatch.cubin, combine.cubin, entries.json (the two manifest entries, as `runtime/build.py` writes them)

`<cache>` is `$JAX_LATENT_EP_CACHE`, else `${XDG_CACHE_HOME:-~/.cache}/jax_latent_ep/kernels`. A variant's
directory name holds everything that changes its cubins: the shape, N and arch (the variant), and the package
version, the kernel sources' hash (`sources.source_sha256()`) and the nvidia-cutlass-dsl version (the key). Where
cutlass-dsl is not installed (a GPU machine given a cache filled elsewhere) any cutlass version of the current
package and sources is accepted: nothing here could compile another.

`ensure(shape, ranks, arch)` returns the variant's directory, compiling both kernels first if it is missing and
cutlass-dsl is importable: in a subprocess (`python -m jax_latent_ep.runtime.build --cache ...`, so that the
DSL's MLIR never loads into a JAX process), whose `build.compile_into_cache` holds an exclusive `fcntl.flock` on the
variant's lock file while it compiles into a temporary directory and renames it into place. Processes of one job that
start together therefore compile once: the others wait on the lock, then find the directory and load it.

No JAX is imported here.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

from jax_latent_ep.runtime import sources

#: Environment variable naming the cache directory.
ENV_VAR = "JAX_LATENT_EP_CACHE"
#: "0": never compile on demand (a missing variant is a LookupError at once).
COMPILE_ENV = "JAX_LATENT_EP_COMPILE"
KERNELS = ("dispatch", "combine")
#: The command that installs the compiler (named in the errors).
INSTALL_HINT = "pip install 'nvidia-cutlass-dsl==4.8.1' (the package's `build` extra: pip install 'jax_latent_ep[build]')"


def cache_dir() -> pathlib.Path:
    """The cache's root: `$JAX_LATENT_EP_CACHE`, else `${XDG_CACHE_HOME:-~/.cache}/jax_latent_ep/kernels`."""
    env = os.environ.get(ENV_VAR)
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(xdg) / "jax_latent_ep" / "kernels"


def package_version() -> str:
    try:
        return importlib.metadata.version("jax_latent_ep")
    except importlib.metadata.PackageNotFoundError:
        import jax_latent_ep

        return getattr(jax_latent_ep, "__version__", "0")


def cutlass_version() -> str | None:
    """The installed nvidia-cutlass-dsl version, None where it is not installed (nothing can compile)."""
    if importlib.util.find_spec("cutlass") is None:
        return None
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


def variant_name(shape, ranks: int, arch: str) -> str:
    """`L<L>_E<E>_K<K>_n<N>_<arch>`: a variant's directory name (and the shape part of its cubins' names)."""
    return f"L{shape.latent}_E{shape.experts}_K{shape.topk}_n{ranks}_{arch}"


def _key_prefix() -> str:
    return f"{package_version()}-{sources.source_sha256()[:16]}-cutlass"


def key_dir(shape, ranks: int, arch: str, cutlass: str | None = None, root=None) -> pathlib.Path:
    """The directory the variant compiled with cutlass-dsl `cutlass` (default: the installed one) lives in."""
    cutlass = cutlass or cutlass_version() or "none"
    return pathlib.Path(root or cache_dir()) / variant_name(shape, ranks, arch) / f"{_key_prefix()}{cutlass}"


def complete(directory: pathlib.Path) -> bool:
    """True if `directory` holds entries.json and both cubins with the sha256 it records."""
    try:
        entries = json.loads((directory / "entries.json").read_text())
        files = {e["kernel"]: e for e in entries}
        for kernel in KERNELS:
            data = (directory / files[kernel]["file"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != files[kernel]["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def lookup(shape, ranks: int, arch: str, root=None) -> pathlib.Path | None:
    """The cached variant's directory, or None: the installed cutlass-dsl's key where it is installed, else the
    newest complete directory of any cutlass version for this package version and these kernel sources."""
    variant = pathlib.Path(root or cache_dir()) / variant_name(shape, ranks, arch)
    installed = cutlass_version()
    if installed is not None:
        exact = key_dir(shape, ranks, arch, installed, root)
        return exact if complete(exact) else None
    if not variant.is_dir():
        return None
    prefix = _key_prefix()
    found = [d for d in variant.iterdir() if d.name.startswith(prefix) and complete(d)]
    return max(found, key=lambda d: d.stat().st_mtime) if found else None


def entries(directory: pathlib.Path) -> dict[str, dict]:
    """kernel -> manifest entry of a cached variant directory."""
    return {e["kernel"]: e for e in json.loads((pathlib.Path(directory) / "entries.json").read_text())}


def missing_message(shape, ranks: int, arch: str, why: str) -> str:
    name = variant_name(shape, ranks, arch)
    return (f"no compiled kernels for L={shape.latent} E={shape.experts} K={shape.topk} N={ranks} {arch} ({name}) "
            f"in the package or the cache {cache_dir()}; {why}. Install the compiler: {INSTALL_HINT} (the kernels "
            f"then compile on first use), or compile elsewhere with `python -m jax_latent_ep.runtime.build --cache "
            f"--shape {shape.latent},{shape.experts},{shape.topk} --ranks {ranks} --arch {arch}` and point "
            f"${ENV_VAR} at a copy of that cache")


def ensure(shape, ranks: int, arch: str, log=None) -> pathlib.Path:
    """The cached variant's directory, compiled first (in a subprocess, with a progress line on stderr) if it is
    missing and cutlass-dsl is installed.

    Raises:
      LookupError: missing and cannot be compiled here (the message names the variant and the command that
        installs the compiler), or the compile failed (its output attached).
    """
    found = lookup(shape, ranks, arch)
    if found is not None:
        return found
    if os.environ.get(COMPILE_ENV, "1").strip() == "0":
        raise LookupError(missing_message(shape, ranks, arch, f"compiling on demand is off ({COMPILE_ENV}=0)"))
    if cutlass_version() is None:
        raise LookupError(missing_message(shape, ranks, arch, "nvidia-cutlass-dsl is not installed"))
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    log(f"jax_latent_ep: compiling the dispatch and combine kernels for L={shape.latent} E={shape.experts} "
        f"K={shape.topk} N={ranks} {arch} (not in the package; once per user, into {cache_dir()}) ...")
    # The same package as this process's (a source tree shadowing the installed one stays first).
    package_parent = str(pathlib.Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p))
    env[ENV_VAR] = str(cache_dir())
    command = [sys.executable, "-m", "jax_latent_ep.runtime.build", "--cache", "--arch", arch,
               "--shape", f"{shape.latent},{shape.experts},{shape.topk}", "--ranks", str(ranks)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    found = lookup(shape, ranks, arch)
    if done.returncode != 0 or found is None:
        raise LookupError(f"compiling {variant_name(shape, ranks, arch)} failed (exit {done.returncode}): "
                          f"{' '.join(command)}\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return found
