"""The FFI runtime on CPU: artifact lookup, the lowering of both custom calls for CUDA on the traced and the record path (target names, attributes, side effect), the choice between the two paths, and the library built against the installed jaxlib."""

from __future__ import annotations

import os
import re
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_latent_ep.runtime import artifacts

REPO = pathlib.Path(__file__).resolve().parents[2]


from conftest import cuda_devices as _gpus


def _have_library() -> str | None:
    try:
        artifacts.find(artifacts.FFI_LIBRARY)
        artifacts.find(artifacts.MANIFEST)
    except FileNotFoundError as e:
        return str(e)
    return None


def test_artifacts_env_first(tmp_path, monkeypatch):
    (tmp_path / "manifest.json").write_text("{}")
    monkeypatch.setenv(artifacts.ENV_VAR, str(tmp_path))
    assert artifacts.find("manifest.json") == tmp_path / "manifest.json"
    with pytest.raises(FileNotFoundError, match="not found"):
        artifacts.find("no_such_artifact.bin")


@pytest.mark.parametrize("path", ["traced", "record", "record_no_pdl"])
def test_lowering_for_cuda(path, monkeypatch):
    """Both calls lower (on any machine) to side-effecting custom calls with the attributes the handlers bind:
    the traced targets without `uses_pdl`, the record targets with it (False under JAX_LATENT_EP_PDL=0)."""
    reason = _have_library()
    if reason:
        pytest.skip(f"no FFI library / manifest: {reason}")
    from jax_latent_ep.runtime import ffi

    ffi.register_targets()
    monkeypatch.setenv(ffi.RECORD_ENV, "0" if path == "traced" else "1")
    monkeypatch.setenv(ffi.PDL_ENV, "0" if path == "record_no_pdl" else "1")
    if path != "traced":
        monkeypatch.setattr(ffi, "_record_error", None)  # as if registered (they are only on a CUDA machine)
    assert ffi.launch_path() == ("traced" if path == "traced" else "record")
    targets = ((ffi.DISPATCH_TARGET, ffi.COMBINE_TARGET) if path == "traced"
               else (ffi.DISPATCH_RECORD_TARGET, ffi.COMBINE_RECORD_TARGET))
    n = min(2, len(jax.devices()))
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices()[:n])
    rows, t = n * 8, 5

    def f(x, ids, w, nw):
        recv = ffi.dispatch_call(x, ids, w, instance=3, rows=rows, grid=32, num_sf=112)
        return ffi.combine_call(recv[0].astype(jnp.bfloat16), ids, nw, instance=3, grid=64, eps=1e-5, apply_norm=True)

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P()), out_specs=P("ep")))
    sds = lambda s, d, sp: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, sp))  # noqa: E731
    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in targets]
    exp = jax.export.export(g, platforms=["cuda"], disabled_checks=checks)(
        sds((n * t, 3584), jnp.bfloat16, P("ep")), sds((n * t, 16), jnp.int32, P("ep")),
        sds((n * t, 16), jnp.float32, P("ep")), sds((3584,), jnp.bfloat16, P()))
    text = exp.mlir_module()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    dispatch = [c for c in calls if f"@{targets[0]}(" in c]
    combine = [c for c in calls if f"@{targets[1]}(" in c]
    assert len(dispatch) == 1 and len(combine) == 1 and len(calls) == 2, calls
    # no side effect (JAX's C++ fast path), a distinct `call` number on each (XLA never merges the two)
    assert "has_side_effect" not in dispatch[0] and "has_side_effect" not in combine[0]
    ids = [int(re.search(r"call = (\d+) : i64", c).group(1)) for c in (dispatch[0], combine[0])]
    assert ids[0] != ids[1], ids
    for attr in ("grid = 32 : i64", "instance = 3 : i64", f"tensor<{rows}x3584xf8E4M3FN>", f"tensor<{rows}xi32>"):
        assert attr in dispatch[0], attr
    for attr in ("apply_norm = 1 : i64", "grid = 64 : i64", "instance = 3 : i64", ": f32"):
        assert attr in combine[0], attr
    pdl = {"traced": None, "record": "uses_pdl = true", "record_no_pdl": "uses_pdl = false"}[path]
    for call in (dispatch[0], combine[0]):
        assert (pdl in call) if pdl else ("uses_pdl" not in call), call


def test_launch_path_choice(monkeypatch):
    """The record targets by default once registered; the traced ones under JAX_LATENT_EP_FFI_RECORD=0 or
    when registration failed. `uses_pdl` only on the record targets, False under JAX_LATENT_EP_PDL=0."""
    from jax_latent_ep.runtime import ffi

    monkeypatch.delenv(ffi.RECORD_ENV, raising=False)
    monkeypatch.delenv(ffi.PDL_ENV, raising=False)
    monkeypatch.setattr(ffi, "_record_error", None)
    assert ffi.launch_path() == "record"
    assert ffi._target("dispatch") == (ffi.DISPATCH_RECORD_TARGET, {"uses_pdl": True})
    assert ffi._target("combine") == (ffi.COMBINE_RECORD_TARGET, {"uses_pdl": True})
    monkeypatch.setenv(ffi.PDL_ENV, "0")
    assert ffi._target("combine") == (ffi.COMBINE_RECORD_TARGET, {"uses_pdl": False})
    monkeypatch.setenv(ffi.RECORD_ENV, "0")
    assert ffi.launch_path() == "traced"
    assert ffi._target("dispatch") == (ffi.DISPATCH_TARGET, {})
    assert ffi._target("combine") == (ffi.COMBINE_TARGET, {})
    monkeypatch.setenv(ffi.RECORD_ENV, "1")
    monkeypatch.setattr(ffi, "_record_error", "record stage not available: test")
    assert ffi.launch_path() == "traced" and ffi.record_error() == "record stage not available: test"
    assert ffi._target("dispatch") == (ffi.DISPATCH_TARGET, {})


def test_expert_launch_path_choice(monkeypatch):
    """The expert kernels' calls take their record targets once registered (with `uses_pdl`), the traced ones
    under JAX_LATENT_EP_FFI_RECORD=0 or when registration failed."""
    from jax_latent_ep.runtime import ffi

    monkeypatch.delenv(ffi.RECORD_ENV, raising=False)
    monkeypatch.delenv(ffi.PDL_ENV, raising=False)
    monkeypatch.setattr(ffi, "_expert_record_error", None)
    for op in ffi.EXPERT_RECORD_TARGETS:
        assert ffi._expert_target(op) == (ffi.EXPERT_RECORD_TARGETS[op], {"uses_pdl": True})
    monkeypatch.setenv(ffi.PDL_ENV, "0")
    assert ffi._expert_target("grouped_gemm") == (ffi.EXPERT_RECORD_TARGETS["grouped_gemm"], {"uses_pdl": False})
    monkeypatch.setenv(ffi.RECORD_ENV, "0")
    assert ffi._expert_target("expert_plan") == (ffi.EXPERT_PLAN_TARGET, {})
    monkeypatch.setenv(ffi.RECORD_ENV, "1")
    monkeypatch.setattr(ffi, "_expert_record_error", "record stage not available: test")
    assert ffi._expert_target("grouped_gemm") == (ffi.GROUPED_GEMM_TARGET, {})
    assert ffi.expert_record_error() == "record stage not available: test"


class FakeRecordLibrary:
    """Stands in for the FFI library's record registration: answers with the codes given, in order."""

    def __init__(self, codes):
        from jax_latent_ep.runtime import ffi

        self.codes, self.calls, self.message = list(codes), [], b""
        self.expert_ops = list(ffi.EXPERT_RECORD_TARGETS)

    def ep_register_record_targets(self, *names):
        self.calls.append(names)
        rc = self.codes.pop(0)
        self.message = {0: b"", 1: b"record stage not available: XLA refused (test)",
                        2: b"record stage not available yet: no XLA FFI API seen (test)"}[rc]
        return rc

    def ep_register_expert_record_targets(self, ops, names, count):
        assert [ops[i] for i in range(count)] == [op.encode() for op in self.expert_ops]
        return self.ep_register_record_targets(*(names[i] for i in range(count)))

    def ep_last_error(self):
        return self.message


@pytest.mark.parametrize("codes, path, calls", [
    ([0], "record", 1),              # registered: record targets, never asked again
    ([1], "traced", 1),              # refused for good (no record stage): traced targets, never asked again
    ([2, 2, 0], "record", 3),        # no CUDA backend yet: asked again by each register_targets until it works
])
def test_record_registration_fallback(codes, path, calls, monkeypatch):
    from jax_latent_ep.runtime import ffi

    fake = FakeRecordLibrary(codes)
    monkeypatch.setattr(ffi, "library", lambda: fake)
    monkeypatch.setattr(ffi, "_registered", True)  # the traced targets (jax.ffi.register_ffi_target) are not faked
    monkeypatch.setattr(ffi, "_record_error", "not registered yet")
    monkeypatch.setattr(ffi, "_record_final", False)
    monkeypatch.delenv(ffi.RECORD_ENV, raising=False)
    for _ in range(3):
        ffi.register_targets()
    assert len(fake.calls) == calls
    assert fake.calls[0] == (ffi.DISPATCH_RECORD_TARGET.encode(), ffi.COMBINE_RECORD_TARGET.encode())
    assert ffi.launch_path() == path
    if path == "traced":
        assert ffi.record_error() == "record stage not available: XLA refused (test)"
    else:
        assert ffi.record_error() is None


def test_record_registration_switched_off(monkeypatch):
    """JAX_LATENT_EP_FFI_RECORD=0 when the targets are registered: the record ones are not even registered."""
    from jax_latent_ep.runtime import ffi

    fake = FakeRecordLibrary([0])
    monkeypatch.setattr(ffi, "library", lambda: fake)
    monkeypatch.setattr(ffi, "_registered", True)
    monkeypatch.setattr(ffi, "_record_error", "not registered yet")
    monkeypatch.setattr(ffi, "_record_final", False)
    monkeypatch.setenv(ffi.RECORD_ENV, "0")
    ffi.register_targets()
    assert fake.calls == [] and ffi.launch_path() == "traced" and "JAX_LATENT_EP_FFI_RECORD=0" in ffi.record_error()
    monkeypatch.setenv(ffi.RECORD_ENV, "1")
    ffi.register_targets()
    assert len(fake.calls) == 1 and ffi.launch_path() == "record"


def test_record_registration_with_the_library():
    """The real library: without a CUDA backend no XLA FFI API has reached it, so the record targets wait
    (traced path, asked again later); with one (jaxlib >= 0.11.2) they are registered."""
    reason = _have_library()
    if reason:
        pytest.skip(f"no FFI library / manifest: {reason}")
    from jax_latent_ep.runtime import ffi

    if not hasattr(ffi.library(), "ep_register_record_targets"):
        pytest.skip(f"the FFI library {artifacts.find(artifacts.FFI_LIBRARY)} predates the record targets: rebuild it")
    ffi.register_targets()
    if os.environ.get(ffi.RECORD_ENV, "").strip() == "0":
        assert ffi.launch_path() == "traced"
    elif _gpus():
        assert ffi.record_error() is None, ffi.record_error()
        assert ffi.launch_path() == "record"
    else:
        assert "no XLA FFI API seen" in ffi.record_error(), ffi.record_error()
        assert ffi.launch_path() == "traced" and not ffi._record_final
        assert ffi.record_counts() == (0, 0)


@pytest.mark.parametrize("codes, path, calls", [([0], "record", 1), ([1], "traced", 1), ([2, 2, 0], "record", 3)])
def test_expert_record_registration_fallback(codes, path, calls, monkeypatch):
    """The expert record targets as dispatch / combine's: asked again only while no XLA FFI API was seen."""
    from jax_latent_ep.runtime import ffi

    fake = FakeRecordLibrary(codes)
    monkeypatch.setattr(ffi, "_expert_record_error", "not registered yet")
    monkeypatch.setattr(ffi, "_expert_record_final", False)
    monkeypatch.delenv(ffi.RECORD_ENV, raising=False)
    for _ in range(3):
        ffi._register_expert_record_targets(fake)
    assert len(fake.calls) == calls
    assert fake.calls[0] == tuple(name.encode() for name in ffi.EXPERT_RECORD_TARGETS.values())
    want = "traced" if path == "traced" else "record"
    got = "record" if ffi._expert_target("grouped_gemm")[0] == ffi.EXPERT_RECORD_TARGETS["grouped_gemm"] else "traced"
    assert got == want


def test_narrow_variant_names_and_refusal():
    """The FP8 / MXFP4 grouped matmul's tile sizes name their variants; any other is refused by value."""
    from jax_latent_ep.kernels import abi
    from jax_latent_ep.runtime import ffi

    assert ffi._narrow_op("grouped_matmul_fp8", abi.MATMUL_FP8_TILE_PAIRS) == "grouped_matmul_fp8"
    for p in abi.MATMUL_FP8_SMALL_TILE_PAIRS:
        op = ffi._narrow_op("grouped_matmul_mxfp4", p)
        assert op in ffi.EXPERT_TARGETS and op in ffi.EXPERT_RECORD_TARGETS and op in ffi.EXPERT_KERNELS
    with pytest.raises(ValueError, match="tile_pairs=12 must be one of"):
        ffi._narrow_op("grouped_matmul_fp8", 12)
