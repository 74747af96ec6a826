"""Ahead-of-time build of the EP kernels: `python -m jax_latent_ep.runtime.build [--out DIR] [--arch sm_90a,sm_100a]
[--only kimi_k3/2 ...] [--jobs J] [--check-installed]`.

Compiles every default variant (`default_variants()`: both kernels, each shape and rank count, each arch) with
nvidia-cutlass-dsl into `DIR/cubins/<kernel>_<shape>_n<N>_<arch>.cubin` and writes `DIR/manifest.json`, the
record the C++ launcher reads (symbol name, parameter list, block, shared memory; see docs/kernel_abi.md).
Needs no GPU. `--check-installed` verifies an installed artifact directory (manifest complete, files present,
hashes equal) without importing cutlass, so it runs on the GPU machine too; it exits 1 if anything is off.

No JAX is imported here (the CMake build calls this module).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import pathlib
import sys
import time

from jax_latent_ep.kernels import abi
from jax_latent_ep.shapes import SHAPES

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = PACKAGE_DIR / "_artifacts"
KERNELS = ("dispatch", "combine")
ARCHS = ("sm_90a", "sm_100a")
#: Rank counts built per shape.
DEFAULT_RANKS = {"kimi_k3": (1, 2, 4, 7, 8, 14, 16, 28, 32), "deepseek_v3": (1, 2, 4, 8)}
#: Files whose content decides the cubins: their sha256 is recorded as `source_sha256`.
SOURCES = ("kernels/__init__.py", "kernels/abi.py", "kernels/common.py", "kernels/primitives.py", "kernels/dispatch.py",
           "kernels/combine.py", "layout.py", "shapes.py")
MANIFEST_VERSION = 1


def source_sha256() -> str:
    """sha256 over the kernel sources (kernels/*.py, layout.py, shapes.py: name and bytes, in order)."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0")
        digest.update((PACKAGE_DIR / name).read_bytes())
    return digest.hexdigest()


def cubin_name(kernel: str, shape: str, ranks: int, arch: str) -> str:
    return f"{kernel}_{shape}_n{ranks}_{arch}.cubin"


def default_variants(archs=ARCHS):
    """Every `(kernel, shape name, ranks, arch)` of the default build."""
    return [
        (kernel, shape, ranks, arch)
        for arch in archs
        for shape, all_ranks in DEFAULT_RANKS.items()
        for ranks in all_ranks
        for kernel in KERNELS
    ]


def _parse_only(items):
    """`["kimi_k3/2", "deepseek_v3"]` -> a predicate on (shape, ranks)."""
    if not items:
        return lambda shape, ranks: True
    wanted = []
    for item in items:
        shape, _, ranks = item.partition("/")
        if shape not in SHAPES:
            raise SystemExit(f"--only {item}: unknown shape {shape!r} (known: {', '.join(SHAPES)})")
        wanted.append((shape, int(ranks) if ranks else None))
    return lambda shape, ranks: any(s == shape and (r is None or r == ranks) for s, r in wanted)


def _compile_one(job):
    """Worker: compiles one variant, writes its cubin, returns its manifest entry."""
    kernel, shape_name, ranks, arch, out_dir = job
    started = time.perf_counter()
    from importlib import metadata

    shape = SHAPES[shape_name]
    if kernel == "dispatch":
        from jax_latent_ep.kernels import dispatch as module

        name, cubin = module.compile_dispatch(shape, ranks, arch)
    else:
        from jax_latent_ep.kernels import combine as module

        name, cubin = module.compile_combine(shape, ranks, arch)
    file = f"cubins/{cubin_name(kernel, shape_name, ranks, arch)}"
    path = pathlib.Path(out_dir) / file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(cubin)
    os.replace(tmp, path)
    return {
        "kernel": kernel,
        "name": name,
        "file": file,
        "sha256": hashlib.sha256(cubin).hexdigest(),
        "params": [list(p) for p in abi.KERNELS[kernel].signature()],
        "block": shape.latent // 16,
        "smem": module.smem_bytes(shape),
        "shape": {"name": shape_name, "latent": shape.latent, "experts": shape.experts, "topk": shape.topk},
        "ranks": ranks,
        "arch": arch,
        "source_sha256": source_sha256(),
        "cutlass_dsl_version": metadata.version("nvidia-cutlass-dsl"),
        "compile_s": round(time.perf_counter() - started, 3),
    }


def build(out_dir=DEFAULT_OUT, archs=ARCHS, only=None, jobs=None, log=print):
    """Compiles the selected variants into `out_dir` and (re)writes its manifest; returns the manifest dict.

    Entries already in an existing manifest for other variants are kept (so `--only` adds to a build)."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    keep = _parse_only(only)
    todo = [(k, s, n, a, str(out_dir)) for k, s, n, a in default_variants(archs) if keep(s, n)]
    if not todo:
        raise SystemExit("nothing to build")
    jobs = jobs or min(len(todo), os.cpu_count() or 1)
    started = time.perf_counter()
    entries = []
    if jobs == 1:
        for job in todo:
            entries.append(_compile_one(job))
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            entries = list(pool.map(_compile_one, todo))
    elapsed = time.perf_counter() - started
    manifest_path = out_dir / "manifest.json"
    old = []
    if manifest_path.exists():
        try:
            old = json.loads(manifest_path.read_text())["entries"]
        except (ValueError, KeyError):
            old = []
    built = {(e["kernel"], e["shape"]["name"], e["ranks"], e["arch"]) for e in entries}
    merged = [e for e in old if (e["kernel"], e["shape"]["name"], e["ranks"], e["arch"]) not in built] + entries
    merged.sort(key=lambda e: (e["arch"], e["shape"]["name"], e["ranks"], e["kernel"]))
    manifest = {
        "version": MANIFEST_VERSION,
        "source_sha256": source_sha256(),
        "cutlass_dsl_version": entries[0]["cutlass_dsl_version"],
        "entries": merged,
    }
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, manifest_path)
    log(f"built {len(entries)} cubins into {out_dir} in {elapsed:.1f} s with {jobs} process(es)")
    return manifest


def check_installed(out_dir=DEFAULT_OUT, archs=None, complete=True) -> list[str]:
    """Problems of an installed artifact directory (empty list: all good). Imports no cutlass.

    Checks: the manifest parses; every default variant of every arch it names (or of `archs`) is present when
    `complete`; every cubin exists and matches its sha256; every entry's source hash equals the current
    kernel sources (stale cubins otherwise)."""
    out_dir = pathlib.Path(out_dir)
    path = out_dir / "manifest.json"
    if not path.exists():
        return [f"{path} is missing (run python -m jax_latent_ep.runtime.build)"]
    try:
        manifest = json.loads(path.read_text())
        entries = manifest["entries"]
    except (ValueError, KeyError) as error:
        return [f"{path} is not a valid manifest: {error}"]
    problems = []
    current = source_sha256()
    have = {}
    for entry in entries:
        key = (entry["kernel"], entry["shape"]["name"], entry["ranks"], entry["arch"])
        have[key] = entry
        cubin = out_dir / entry["file"]
        if not cubin.exists():
            problems.append(f"{cubin} is missing")
            continue
        if hashlib.sha256(cubin.read_bytes()).hexdigest() != entry["sha256"]:
            problems.append(f"{cubin} does not match its sha256 in the manifest")
        if entry.get("source_sha256") != current:
            problems.append(f"{cubin} was built from other kernel sources (stale: rebuild)")
        for field in ("name", "params", "block", "smem"):
            if field not in entry:
                problems.append(f"{cubin}: manifest entry lacks {field!r}")
    if complete:
        for key in default_variants(archs or sorted({e["arch"] for e in entries}) or ARCHS):
            if key not in have:
                problems.append(f"variant {key} is not built")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_latent_ep.runtime.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="artifact directory (default: %(default)s)")
    parser.add_argument("--arch", default=",".join(ARCHS), help="comma-separated archs (default: %(default)s)")
    parser.add_argument("--only", nargs="+", metavar="SHAPE[/N]", help="build only these, e.g. kimi_k3/2 deepseek_v3")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU count)")
    parser.add_argument("--check-installed", action="store_true", help="verify DIR and exit (no cutlass needed)")
    args = parser.parse_args(argv)
    archs = tuple(a for a in args.arch.split(",") if a)
    for arch in archs:
        if arch not in ARCHS:
            parser.error(f"--arch {arch}: known archs are {', '.join(ARCHS)}")
    if args.check_installed:
        problems = check_installed(args.out, archs if "--arch" in (argv or sys.argv) else None)
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        if not problems:
            print(f"{args.out}: artifacts complete and intact")
        return 1 if problems else 0
    build(args.out, archs, args.only, args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
