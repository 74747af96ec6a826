"""Ahead-of-time build of the EP kernels: `python -m jax_latent_ep.runtime.build [--out DIR] [--arch sm_90a,sm_100a]
[--only kimi_k3/2 ... | --shape L,E,K --ranks N[,N...]] [--kernels K,...] [--cache] [--jobs J]
[--check-installed]`.

Compiles every default variant (`default_variants()`: both kernels, each shape and rank count, each arch) with
nvidia-cutlass-dsl into `DIR/cubins/<kernel>_<shape>_n<N>_<arch>.cubin` and writes `DIR/manifest.json`, the
record the C++ launcher reads (symbol name, parameter list, block, shared memory; see docs/kernel_abi.md).
`--shape 4096,128,8 --ranks 1,8` builds that shape's variants instead (cubins named `<kernel>_L4096_E128_K8_n<N>_
<arch>.cubin`, added to the manifest); with `--cache` they go into the per-user kernel cache
(`runtime/kernel_cache.py`) that the NVLink backend also fills on demand. `--kernels` builds only those kernels'
variants (into a copy of another build: the artifacts of an A/B, the rest as they were). Needs no GPU.
`--check-installed` verifies an installed artifact directory (manifest complete, files present, hashes equal)
without importing cutlass, so it runs on the GPU machine too; it exits 1 if anything is off.

No JAX is imported here (the CMake build calls this module).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import pathlib
import shutil
import sys
import tempfile
import time

from jax_latent_ep.kernels import abi
from jax_latent_ep.runtime import kernel_cache
from jax_latent_ep.runtime.sources import PACKAGE_DIR, source_sha256
from jax_latent_ep.shapes import SHAPES, LatentMoEShape

DEFAULT_OUT = PACKAGE_DIR / "_artifacts"
KERNELS = ("dispatch", "combine")
ARCHS = ("sm_90a", "sm_100a")
#: Rank counts built per shape.
DEFAULT_RANKS = {"kimi_k3": (1, 2, 4, 7, 8, 14, 16, 28, 32), "deepseek_v3": (1, 2, 4, 8)}
#: Kernels compiled once per arch for every shape (their sizes are run-time parameters): manifest shape "any";
#: kernel -> its module in `jax_latent_ep.kernels`.
SHAPE_FREE = {"grouped_gemm": "grouped_gemm", "grouped_gemm_fp8": "grouped_gemm", "expert_stage": "grouped_gemm",
              "expert_plan": "expert_plan", "row_sum": "row_sum", "grouped_matmul": "grouped_matmul",
              "grouped_matmul_wgrad": "grouped_matmul", "grouped_matmul_fp8": "grouped_matmul_fp8",
              "grouped_matmul_mxfp4": "grouped_matmul_fp8", "swiglu_mxfp8": "swiglu_mxfp8",
              "grouped_matmul_fp8_wide": "grouped_matmul_fp8_wide",
              "grouped_matmul_fp8_wide_glu": "grouped_matmul_fp8_wide",
              **{k.op: "grouped_matmul_fp8" for k in abi.NARROW_VARIANTS}}
MANIFEST_VERSION = 1


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
    ] + [(kernel, "any", 0, arch) for arch in archs for kernel in SHAPE_FREE
         if arch in (abi.KERNELS[kernel].archs or archs)]


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
    return lambda shape, ranks: shape == "any" or any(s == shape and (r is None or r == ranks) for s, r in wanted)


def _compile_one(job):
    """Worker: compiles one default-build variant (a named shape), writes its cubin, returns its manifest entry."""
    kernel, shape_name, ranks, arch, out_dir = job
    if kernel in SHAPE_FREE:
        return compile_shape_free(kernel, arch, out_dir)
    shape = SHAPES[shape_name] if isinstance(shape_name, str) else LatentMoEShape(*shape_name)
    name = shape_label(shape)
    return compile_variant(kernel, shape, ranks, arch, out_dir, f"cubins/{cubin_name(kernel, name, ranks, arch)}", name)


def shape_label(shape: LatentMoEShape) -> str:
    """The name a shape's cubins and manifest entries carry: its `SHAPES` name, else `L<L>_E<E>_K<K>`."""
    for name, named in SHAPES.items():
        if named == shape:
            return name
    return f"L{shape.latent}_E{shape.experts}_K{shape.topk}"


def compile_variant(kernel: str, shape: LatentMoEShape, ranks: int, arch: str, out_dir, file: str,
                    shape_name: str | None = None) -> dict:
    """Compiles `kernel` ("dispatch" / "combine") of `(shape, ranks)` for `arch` into `out_dir/file` (written
    atomically) and returns its manifest entry. Imports cutlass."""
    started = time.perf_counter()
    if kernel == "dispatch":
        from jax_latent_ep.kernels import dispatch as module

        name, cubin = module.compile_dispatch(shape, ranks, arch)
    else:
        from jax_latent_ep.kernels import combine as module

        name, cubin = module.compile_combine(shape, ranks, arch)
    shape_entry = {"name": shape_name or shape_label(shape), "latent": shape.latent, "experts": shape.experts,
                   "topk": shape.topk}
    return _entry(kernel, name, cubin, out_dir, file, shape.latent // 16, module.smem_bytes(shape), shape_entry,
                  ranks, arch, started)


def _entry(kernel, name, cubin, out_dir, file, block, smem, shape_entry, ranks, arch, started) -> dict:
    """Writes `cubin` to `out_dir/file` atomically and returns its manifest entry."""
    from importlib import metadata

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
        "block": block,
        "smem": smem,
        "shape": shape_entry,
        "ranks": ranks,
        "arch": arch,
        "source_sha256": source_sha256(),
        "cutlass_dsl_version": metadata.version("nvidia-cutlass-dsl"),
        "compile_s": round(time.perf_counter() - started, 3),
    }


def compile_shape_free(kernel: str, arch: str, out_dir) -> dict:
    """Compiles a shape-free kernel (one of `SHAPE_FREE`) for `arch` into `out_dir/cubins/<kernel>_<arch>.cubin`;
    returns its manifest entry (shape "any", ranks 0). Imports cutlass."""
    import importlib

    started = time.perf_counter()
    module = importlib.import_module(f"jax_latent_ep.kernels.{SHAPE_FREE[kernel]}")
    compile_one = getattr(module, f"compile_{kernel}", None)  # else the module's `compile_variant(kernel, arch)`
    name, cubin = compile_one(arch) if compile_one else module.compile_variant(kernel, arch)
    threads, smem = module.launch_shape(kernel) if hasattr(module, "launch_shape") else (module.THREADS,
                                                                                         module.smem_bytes())
    return _entry(kernel, name, cubin, out_dir, f"cubins/{kernel}_{arch}.cubin", threads, smem, {"name": "any"}, 0,
                  arch, started)


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes (and by the kernel if the process dies)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compile_into_cache(shape, ranks: int, arch: str, root=None, log=print) -> pathlib.Path:
    """Compiles both kernels of the variant into the per-user kernel cache (`runtime/kernel_cache.py`; in this
    process: it imports cutlass), under the variant's lock; returns the directory. A variant already complete when
    the lock is taken is kept as is. What `python -m jax_latent_ep.runtime.build --cache` runs."""
    shape.check_ranks(ranks)
    installed = kernel_cache.cutlass_version()
    if installed is None:
        raise LookupError(f"nvidia-cutlass-dsl is not installed, so {kernel_cache.variant_name(shape, ranks, arch)} "
                          f"cannot be compiled: {kernel_cache.INSTALL_HINT}")
    target = kernel_cache.key_dir(shape, ranks, arch, installed, root)
    with _locked(target.parent / ".lock"):
        if kernel_cache.complete(target):
            return target
        started = time.perf_counter()
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            made = [compile_variant(kernel, shape, ranks, arch, tmp, f"{kernel}.cubin")
                    for kernel in kernel_cache.KERNELS]
            (tmp / "entries.json").write_text(json.dumps(made, indent=1) + "\n")
            if target.exists():  # incomplete (a crash, a corrupted file): replace it
                shutil.rmtree(target)
            os.rename(tmp, target)  # atomic: a reader sees the whole directory or none
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"jax_latent_ep: compiled {kernel_cache.variant_name(shape, ranks, arch)} in "
            f"{time.perf_counter() - started:.1f} s into {target}")
    return target


def build(out_dir=DEFAULT_OUT, archs=ARCHS, only=None, jobs=None, log=print, shape=None, ranks=None, kernels=None):
    """Compiles the selected variants into `out_dir` and (re)writes its manifest; returns the manifest dict.

    `shape` (a LatentMoEShape) with `ranks` (rank counts) builds those instead of the default variants; `kernels`
    (names), only those kernels' variants. Entries already in an existing manifest for other variants are kept (so
    `--only` adds to a build, and `--kernels` into a copy of another build makes an A/B's artifacts: the kept
    entries keep the source hash they were built from)."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if shape is not None:
        key = (shape.latent, shape.experts, shape.topk)
        todo = [(k, key, shape.check_ranks(n), a, str(out_dir)) for a in archs for n in ranks for k in KERNELS]
    else:
        keep = _parse_only(only)
        todo = [(k, s, n, a, str(out_dir)) for k, s, n, a in default_variants(archs) if keep(s, n)]
    if kernels:
        unknown = sorted(set(kernels) - set(KERNELS) - set(SHAPE_FREE))
        if unknown:
            raise SystemExit(f"--kernels {','.join(unknown)}: unknown (known: {', '.join((*KERNELS, *SHAPE_FREE))})")
        todo = [job for job in todo if job[0] in kernels]
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
    parser.add_argument("--kernels", metavar="K[,K...]", help="build only these kernels' variants (into a copy of "
                        "another build: an A/B's artifacts)")
    parser.add_argument("--check-installed", action="store_true", help="verify DIR and exit (no cutlass needed)")
    parser.add_argument("--shape", metavar="L,E,K", help="build this shape (with --ranks) instead of the defaults")
    parser.add_argument("--ranks", metavar="N[,N...]", help="rank counts of --shape (default: 1)")
    parser.add_argument("--cache", action="store_true",
                        help="compile --shape / --ranks into the per-user kernel cache (runtime/kernel_cache.py: "
                             "$JAX_LATENT_EP_CACHE or ~/.cache/jax_latent_ep/kernels) instead of --out")
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
    shape = ranks = None
    if args.shape or args.ranks or args.cache:
        if not args.shape:
            parser.error("--ranks and --cache need --shape L,E,K")
        if args.only:
            parser.error("--only and --shape exclude each other")
        try:
            shape = LatentMoEShape(*(int(v) for v in args.shape.split(",")))
            ranks = [shape.check_ranks(int(n)) for n in (args.ranks or "1").split(",")]
            if len(args.shape.split(",")) != 3:
                raise ValueError("give three integers")
            from jax_latent_ep.kernels import dispatch

            dispatch.check_shape(shape)
        except (TypeError, ValueError) as error:
            parser.error(f"--shape {args.shape} --ranks {args.ranks or 1}: {error}")
    if args.cache:
        for arch in archs:
            for n in ranks:
                compile_into_cache(shape, n, arch)
        return 0
    build(args.out, archs, args.only, args.jobs, shape=shape, ranks=ranks,
          kernels=[k for k in (args.kernels or "").split(",") if k] or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
