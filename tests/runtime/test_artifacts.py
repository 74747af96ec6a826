"""The installed kernel artifacts as the runtime looks them up (no CuTe DSL needed: CI installs the cubins that
the package build compiled)."""

import pathlib

import pytest

from jax_latent_ep.runtime import artifacts, build, ffi
from jax_latent_ep.runtime.cubin import cubin_resources
from jax_latent_ep.shapes import KIMI_K3, LatentMoEShape


def test_missing_variant_lists_what_the_manifest_has_per_shape():
    """A shape without kernels names what exists compactly: each shape and arch once, with its rank counts."""
    try:
        ffi.find_kernel("dispatch", 1, KIMI_K3, "sm_90a")
    except (FileNotFoundError, LookupError) as error:
        pytest.skip(f"no installed sm_90a artifacts here: {error}")
    with pytest.raises(LookupError) as info:
        ffi.find_kernel("dispatch", 2, LatentMoEShape(latent=512, experts=64, topk=4), "sm_90a", compile=False)
    message = str(info.value)
    kimi = ",".join(str(n) for n in build.DEFAULT_RANKS["kimi_k3"])
    assert f"L=3584 E=896 K=16 sm_90a at N={kimi}" in message, message
    assert message.count("L=3584 E=896 K=16 sm_90a") == 1 and "combine" not in message.split("manifest.json has")[1].split(")")[0], message


#: The installed cubins that spill registers to local memory (bytes a thread, as ptxas built them): any other spill,
#: or a change of these, fails, so a spill never arrives unseen. Where they sit (`tools.sass_loop --spills`): the
#: FP8 GEMM's reloads once a unit, outside its MMA loop; dispatch at N = 32 one reload in a loop of about 165.
SPILLS = {"dispatch_kimi_k3_n32_sm_90a": 16, "dispatch_kimi_k3_n32_sm_100a": 16, "grouped_gemm_fp8_sm_90a": 16,
          "grouped_gemm_fp8_sm_100a": 24}


def test_installed_cubins_spill_only_where_known():
    try:
        directory, manifest = artifacts.manifest()
    except FileNotFoundError as error:
        pytest.skip(f"no installed artifacts here: {error}")
    frames = {pathlib.Path(e["file"]).stem: cubin_resources((directory / e["file"]).read_bytes())
              for e in manifest["entries"]}
    assert all(registers > 0 for registers, _ in frames.values()), frames
    spilled = {name: frame for name, (_, frame) in frames.items() if frame}
    assert spilled == {name: frame for name, frame in SPILLS.items() if name in frames}


def test_a_manifest_of_other_kernel_sources_warns_once(tmp_path, monkeypatch):
    """A manifest whose `source_sha256` is not the imported package's kernel sources' is read with one
    `StaleArtifactsWarning` naming both hashes; one of these sources, or without the field, reads silently."""
    import json
    import warnings

    from jax_latent_ep.runtime import sources

    current = sources.source_sha256()
    for name, built, stale in (("stale", "0" * 64, True), ("current", current, False), ("unnamed", None, False)):
        directory = tmp_path / name
        directory.mkdir()
        manifest = {"entries": []} | ({} if built is None else {"source_sha256": built})
        (directory / artifacts.MANIFEST).write_text(json.dumps(manifest))
        monkeypatch.setenv(artifacts.ENV_VAR, str(directory))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert artifacts.manifest() == (directory, manifest)
            artifacts.manifest()  # read once: no second warning
        stale_warnings = [w for w in caught if issubclass(w.category, artifacts.StaleArtifactsWarning)]
        assert len(stale_warnings) == int(stale), (name, [str(w.message) for w in caught])
        if stale:
            assert "0" * 12 in str(stale_warnings[0].message) and current[:12] in str(stale_warnings[0].message)


def test_installed_cubins_are_built_from_these_sources():
    """The artifacts this process would load were built from the imported package's kernel sources (else the tests
    and benchmarks run older cubins than the code they read): `pip install .` again after editing a kernel."""
    try:
        directory, _ = artifacts.manifest()
    except FileNotFoundError as error:
        pytest.skip(f"no installed artifacts here: {error}")
    problems = build.check_installed(directory, complete=False)  # stale sources, missing or altered cubins
    assert not problems, f"run `pip install .` (or ./dev setup) again: {problems[:3]}"
