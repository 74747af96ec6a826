"""The per-user kernel cache (runtime/kernel_cache.py): a shape outside the default build compiled on demand on
the CPU by one of two processes started together, loaded by a third without compiling; the errors without the
compiler; the AOT command line's --shape / --ranks."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jax_latent_ep.runtime import build, kernel_cache
from jax_latent_ep.shapes import LatentMoEShape

REPO = pathlib.Path(__file__).resolve().parents[2]
#: Not in the default build (build.DEFAULT_RANKS): L = 1024, E = 64, K = 8 at N = 2.
SHAPE = LatentMoEShape(latent=1024, experts=64, topk=8)

ENSURE = """
import sys
from jax_latent_ep.runtime import kernel_cache
from jax_latent_ep.shapes import LatentMoEShape
d = kernel_cache.ensure(LatentMoEShape(1024, 64, 8), 2, "sm_90a")
print("DIR", d)
"""


def _env(cache, **extra):
    env = dict(os.environ, JAX_LATENT_EP_CACHE=str(cache), PYTHONPATH=str(REPO), **extra)
    return env


@pytest.mark.slow
def test_compiled_once_by_concurrent_processes_then_loaded(tmp_path):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install .[build])")
    cache = tmp_path / "cache"
    # Two processes of one "job" start at once: one compiles, the other waits on the lock and loads.
    procs = [subprocess.Popen([sys.executable, "-c", ENSURE], env=_env(cache), cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    dirs = {line.split(" ", 1)[1] for out, _ in outs for line in out.splitlines() if line.startswith("DIR ")}
    assert len(dirs) == 1, dirs
    directory = pathlib.Path(dirs.pop())
    assert directory.parent.name == "L1024_E64_K8_n2_sm_90a"
    assert directory.name.startswith(f"{kernel_cache.package_version()}-{build.source_sha256()[:16]}-cutlass")
    # Both printed the progress line (both found nothing at first); the variant was compiled into place once.
    assert all("compiling the dispatch and combine kernels for L=1024 E=64 K=8 N=2 sm_90a" in err for _, err in outs)
    assert [d.name for d in directory.parent.iterdir() if d.name != ".lock"] == [directory.name], "a stray temp dir"
    entries = json.loads((directory / "entries.json").read_text())
    assert [e["kernel"] for e in entries] == ["dispatch", "combine"]
    for e in entries:
        data = (directory / e["file"]).read_bytes()
        assert data[:4] == b"\x7fELF" and hashlib.sha256(data).hexdigest() == e["sha256"]
        assert (e["ranks"], e["arch"], e["shape"]["latent"], e["shape"]["experts"], e["shape"]["topk"]) == \
            (2, "sm_90a", 1024, 64, 8)
        assert e["source_sha256"] == build.source_sha256()
    stamp = {e["file"]: (directory / e["file"]).stat().st_mtime_ns for e in entries}

    # A third process with compiling switched off loads the same cubins through ffi.find_kernel (the manifest
    # has no such variant, the cache does) and prints no progress line.
    load = (
        "from jax_latent_ep.runtime import ffi\nfrom jax_latent_ep.shapes import LatentMoEShape\n"
        "for k in ('dispatch', 'combine'):\n"
        "    img = ffi.find_kernel(k, 2, LatentMoEShape(1024, 64, 8), 'sm_90a')\n"
        "    print(k, img.path, img.name, img.block, img.smem, len(img.cubin))\n"
    )
    done = subprocess.run([sys.executable, "-c", load], env=_env(cache, JAX_LATENT_EP_COMPILE="0"), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "compiling" not in done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for e in entries:
        path, name, block, smem, size = lines[e["kernel"]].split()
        assert pathlib.Path(path) == directory / e["file"] and name == e["name"]
        assert (int(block), int(smem), int(size)) == (1024 // 16, e["smem"], (directory / e["file"]).stat().st_size)
    assert stamp == {e["file"]: (directory / e["file"]).stat().st_mtime_ns for e in entries}, "recompiled"


def test_missing_variant_without_compiler_names_it_and_the_install_command(tmp_path, monkeypatch):
    from jax_latent_ep.runtime import ffi

    monkeypatch.setenv(kernel_cache.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(kernel_cache, "cutlass_version", lambda: None)
    with pytest.raises(LookupError) as info:
        ffi.find_kernel("dispatch", 4, LatentMoEShape(4096, 128, 8), "sm_90a")
    message = str(info.value)
    assert "L=4096 E=128 K=8 N=4 sm_90a" in message and "nvidia-cutlass-dsl is not installed" in message, message
    assert "pip install 'nvidia-cutlass-dsl==4.8.1'" in message and str(tmp_path) in message, message
    assert "--cache --shape 4096,128,8 --ranks 4 --arch sm_90a" in message, message


def test_compile_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.ENV_VAR, str(tmp_path))
    monkeypatch.setenv(kernel_cache.COMPILE_ENV, "0")
    with pytest.raises(LookupError, match="compiling on demand is off"):
        kernel_cache.ensure(LatentMoEShape(4096, 128, 8), 1, "sm_90a")
    assert not any(tmp_path.iterdir()), "nothing is written when nothing compiles"


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv(kernel_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_cache.cache_dir() == tmp_path / "jax_latent_ep" / "kernels"
    monkeypatch.setenv(kernel_cache.ENV_VAR, str(tmp_path / "mine"))
    assert kernel_cache.cache_dir() == tmp_path / "mine"


def test_without_cutlass_any_cutlass_version_of_these_sources_is_accepted(tmp_path, monkeypatch):
    """A cache filled on another machine (other cutlass-dsl, same package and sources) serves a GPU machine
    without the compiler; a directory of other kernel sources does not."""
    monkeypatch.setenv(kernel_cache.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(kernel_cache, "cutlass_version", lambda: None)
    good = kernel_cache.key_dir(SHAPE, 1, "sm_90a", "9.9.9")
    stale = good.parent / "0.1.0-0000000000000000-cutlass9.9.9"
    for d in (good, stale):
        d.mkdir(parents=True)
        made = []
        for kernel in kernel_cache.KERNELS:
            (d / f"{kernel}.cubin").write_bytes(kernel.encode())
            made.append({"kernel": kernel, "file": f"{kernel}.cubin", "sha256": hashlib.sha256(kernel.encode()).hexdigest()})
        (d / "entries.json").write_text(json.dumps(made))
    assert kernel_cache.lookup(SHAPE, 1, "sm_90a") == good
    (good / "combine.cubin").write_bytes(b"corrupt")  # a hash mismatch: not complete
    assert kernel_cache.lookup(SHAPE, 1, "sm_90a") is None


def test_build_command_line_rejects_bad_shapes():
    for args, text in ((["--shape", "1056,64,8"], "multiple of 512"), (["--shape", "1024,64,8", "--ranks", "3"],
                       "must divide experts=64"), (["--ranks", "2"], "need --shape")):
        done = subprocess.run([sys.executable, "-m", "jax_latent_ep.runtime.build", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and text in done.stderr, (args, done.stderr)
