"""AOT build of the EP kernels (CPU only, no GPU): compiles a few variants into a temporary directory and
checks the manifest and the cubins (ELF, the kernel symbol, its parameter list as the C++ launcher reads it)."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys

import pytest

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install .[build])")

from jax_latent_ep.runtime import build, cubin  # noqa: E402
from jax_latent_ep.shapes import DEEPSEEK_V3, KIMI_K3  # noqa: E402
from jax_latent_ep.kernels import abi, combine, dispatch  # noqa: E402

#: cubin parameter layout: i64 8 bytes, i32 / f32 4 bytes, each naturally aligned.
SIZES = {"i64": 8, "i32": 4, "f32": 4}


def _kernel_params(elf: bytes, symbol: str) -> list[tuple[int, int, int]]:
    """(ordinal, offset, size) of every kernel parameter, from the EIATTR_KPARAM_INFO records of
    `.nv.info.<symbol>` (the table the driver uses to place cuLaunchKernel's arguments)."""
    params = []
    for attr, payload in cubin.nv_info_records(cubin.elf_sections(elf)[f".nv.info.{symbol}"]):
        if attr == 0x17:  # EIATTR_KPARAM_INFO
            _, ordinal, offset, word = struct.unpack_from("<IHHI", payload)
            params.append((ordinal, offset, (word >> 18) & 0x3FFF))
    return sorted(params)


def _expected_params(params):
    out, offset = [], 0
    for ordinal, (_, kind) in enumerate(params):
        size = SIZES[kind]
        offset = (offset + size - 1) // size * size
        out.append((ordinal, offset, size))
        offset += size
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts")
    manifest = build.build(out, archs=("sm_90a",), only=["kimi_k3/2", "deepseek_v3/8"], jobs=1, log=lambda *_: None)
    return out, manifest


def test_manifest_fields(built):
    out, manifest = built
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    assert manifest["source_sha256"] == build.source_sha256()
    keys = {(e["kernel"], e["shape"]["name"], e["ranks"], e["arch"]) for e in manifest["entries"]}
    assert keys == {(k, s, n, "sm_90a") for k in ("dispatch", "combine") for s, n in (("kimi_k3", 2), ("deepseek_v3", 8))} | {
        (k, "any", 0, "sm_90a") for k in build.SHAPE_FREE}
    for e in manifest["entries"]:
        if e["kernel"] in build.SHAPE_FREE:  # one cubin for every shape
            import importlib

            module = importlib.import_module(f"jax_latent_ep.kernels.{build.SHAPE_FREE[e['kernel']]}")
            assert e["name"] == f"ep_{e['kernel']}_0" and e["file"] == f"cubins/{e['kernel']}_sm_90a.cubin"
            assert [tuple(p) for p in e["params"]] == list(abi.KERNELS[e["kernel"]].signature())
            launch = module.launch_shape(e["kernel"]) if hasattr(module, "launch_shape") else (module.THREADS,
                                                                                                 module.smem_bytes())
            assert (e["block"], e["smem"]) == launch
            assert hashlib.sha256((out / e["file"]).read_bytes()).hexdigest() == e["sha256"]
            continue
        module = dispatch if e["kernel"] == "dispatch" else combine
        assert e["name"] == f"ep_{e['kernel']}_0"
        assert e["file"] == f"cubins/{e['kernel']}_{e['shape']['name']}_n{e['ranks']}_sm_90a.cubin"
        assert [tuple(p) for p in e["params"]] == list(abi.KERNELS[e["kernel"]].signature())
        assert e["block"] == e["shape"]["latent"] // 16
        shape = KIMI_K3 if e["shape"]["name"] == "kimi_k3" else DEEPSEEK_V3
        assert e["smem"] == module.smem_bytes(shape)
        assert e["cutlass_dsl_version"] == manifest["cutlass_dsl_version"]
        elf = (out / e["file"]).read_bytes()
        assert hashlib.sha256(elf).hexdigest() == e["sha256"]


def test_cubin_symbol_and_params(built):
    out, manifest = built
    for e in manifest["entries"]:
        elf = (out / e["file"]).read_bytes()
        sections = cubin.elf_sections(elf)
        assert f".text.{e['name']}" in sections, sorted(sections)
        assert _kernel_params(elf, e["name"]) == _expected_params(e["params"])


def test_kernels_rebuilds_those_into_a_copy_and_keeps_the_rest(built, tmp_path):
    """`kernels=` (`--kernels`) compiles only the named kernels' variants into an existing build and keeps every other
    entry as it was (an A/B's artifacts from a copy of another build); an unknown name is refused, naming it."""
    out, manifest = built
    copy = tmp_path / "ab"
    shutil.copytree(out, copy)
    key = ("row_sum", "any", 0, "sm_90a")
    before = {(e["kernel"], e["shape"]["name"], e["ranks"], e["arch"]): e for e in manifest["entries"]}
    (copy / before[key]["file"]).write_bytes(b"\x7fELF stale")  # what the rebuild must replace
    rebuilt = build.build(copy, archs=("sm_90a",), kernels=["row_sum"], jobs=1, log=lambda *_: None)
    after = {(e["kernel"], e["shape"]["name"], e["ranks"], e["arch"]): e for e in rebuilt["entries"]}
    assert after.keys() == before.keys()
    assert all(after[k] == before[k] for k in after if k != key)
    assert hashlib.sha256((copy / after[key]["file"]).read_bytes()).hexdigest() == after[key]["sha256"] \
        == before[key]["sha256"]  # compiled again, the same bits
    with pytest.raises(SystemExit, match="no_such_kernel"):
        build.build(copy, archs=("sm_90a",), kernels=["no_such_kernel"], jobs=1, log=lambda *_: None)


def test_check_installed(built, tmp_path):
    out, manifest = built
    assert build.check_installed(out, complete=False) == []
    problems = build.check_installed(out, archs=("sm_90a",))
    assert any("kimi_k3', 32" in p for p in problems)  # not built here: reported as incomplete
    # A corrupted cubin is caught.
    entry = manifest["entries"][0]
    (out / entry["file"]).write_bytes(b"\x7fELF broken")
    assert any("sha256" in p for p in build.check_installed(out, complete=False))


def test_check_installed_cli_imports_no_cutlass(tmp_path):
    code = (
        "import sys; from jax_latent_ep.runtime import build; rc = build.main(['--out', sys.argv[1], '--check-installed']);"
        "assert 'cutlass' not in sys.modules, 'cutlass imported'; sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert "manifest.json is missing" in result.stderr
    assert "cutlass imported" not in result.stderr


def test_kernels_of_one_arch_are_built_for_it_only():
    """A kernel whose ABI names its archs (`abi.Kernel.archs`: the wgmma grouped matmuls, sm_90a) is in the default
    build for those archs only; the others for every arch."""
    variants = build.default_variants(("sm_90a", "sm_100a"))
    for kernel in build.SHAPE_FREE:
        archs = {a for k, _, _, a in variants if k == kernel}
        assert archs == set(abi.KERNELS[kernel].archs or ("sm_90a", "sm_100a")), kernel
    assert {a for k, _, _, a in variants if k == "grouped_matmul"} == {"sm_90a"}
