"""The NVLink backend (FFI handlers + symmetric memory + CuTe DSL kernels).

CPU parts (always run): the rank record exchanged between processes and its config-mismatch error, the
error record ("tombstone") of a process whose setup failed and its publication, grid rules, artifact lookup,
the lowering of both custom calls for CUDA on the traced and the record path (target names, attributes, side
effect), the choice between the two paths (environment switches, registration failures and retries), and,
on stand-ins for the GPU state: `status()` keyed by (group, rank), `check()`'s message for every error code,
`close()` (unregister before free, later calls refused) and the release of a dropped backend.
GPU parts (`@pytest.mark.gpu`, skipped with the reason where there is no NVIDIA GPU): every result of a
two-layer dispatch / expert / combine case against the XLA backend (bit for bit: receive rows and routed
latent; the normed output within 1 bf16 ulp) and the NumPy model, with 1 and 2 GPUs in one process; many
layers in one jit (unrolled and in `lax.scan`) with XLA command buffers on (subprocess); the same program on
the record path (with and without PDL) and the traced path, bit for bit alike (subprocesses); one process per GPU
(subprocess, jax.distributed); bad input refused before any kernel runs (subprocess); the kernels' sequence
errors, dispatch twice and combine without dispatch, reported by `check()` (subprocess: the trap ends the
process's CUDA context).
"""

from __future__ import annotations

import os
import re
import pathlib
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_latent_ep.runtime import artifacts
from jax_latent_ep.shapes import KIMI_K3
from jax_latent_ep.runtime import symmetric
from jax_latent_ep.runtime.symmetric import RankRecord, check_records

REPO = pathlib.Path(__file__).resolve().parent.parent


def _gpus():
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def _have_library() -> str | None:
    try:
        artifacts.find(artifacts.FFI_LIBRARY)
        artifacts.find(artifacts.MANIFEST)
    except FileNotFoundError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------------------
# CPU


def _record(rank, **kw):
    base = dict(rank=rank, ranks=2, max_tokens=64, latent=3584, experts=896, topk=16, process=rank, bytes=1 << 20,
                handle=bytes(range(64)))
    base.update(kw)
    return RankRecord(**base)


def test_rank_record_roundtrip():
    rec = _record(1)
    assert RankRecord.decode(rec.encode()) == rec


def test_records_agree():
    check_records([_record(0), _record(1)], 2)


@pytest.mark.parametrize(
    "field, value, words",
    [("max_tokens", 32, ["max_tokens differs", "rank 0: 64", "rank 1: 32"]),
     ("ranks", 4, ["N differs"]),
     ("topk", 8, ["shape differs"])],
)
def test_records_disagree(field, value, words):
    with pytest.raises(ValueError) as info:
        check_records([_record(0), _record(1, **{field: value})], 2)
    for w in words:
        assert w in str(info.value)


def test_records_missing_rank():
    with pytest.raises(ValueError, match="one record per rank"):
        check_records([_record(0), _record(0)], 2)


def test_default_grids():
    from jax_latent_ep.backends.nvlink import COMBINE_MIN_CTAS, DISPATCH_MIN_CTAS, NvlinkBackend, default_grids

    # min(N * stride(T), DISPATCH_MIN_CTAS), min(N * stride(T), COMBINE_MIN_CTAS): the call's rows, not the buffer's
    assert default_grids(1, 2) == (16, 16)
    assert default_grids(5, 8) == (64, 64)
    assert default_grids(64, 8) == (min(512, DISPATCH_MIN_CTAS), min(512, COMBINE_MIN_CTAS))
    assert default_grids(1000, 2) == (1000, 1000)  # at least one CTA per token
    assert NvlinkBackend._check_grid(None) is None
    assert NvlinkBackend._check_grid(7) == (7, 7)
    assert NvlinkBackend._check_grid((3, 9)) == (3, 9)
    for bad in (0, (1,), (1, 0), True, 2.5):
        with pytest.raises(ValueError):
            NvlinkBackend._check_grid(bad)


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


class FakeRecordLibrary:
    """Stands in for the FFI library's record registration: answers with the codes given, in order."""

    def __init__(self, codes):
        self.codes, self.calls, self.message = list(codes), [], b""

    def ep_register_record_targets(self, dispatch, combine):
        self.calls.append((dispatch, combine))
        rc = self.codes.pop(0)
        self.message = {0: b"", 1: b"record stage not available: XLA refused (test)",
                        2: b"record stage not available yet: no XLA FFI API seen (test)"}[rc]
        return rc

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


@pytest.mark.slow
@pytest.mark.parametrize("record_api", [True, False], ids=["with_record_api", "without_record_api"])
def test_ffi_library_builds_with_installed_jaxlib(record_api, tmp_path):
    """ffi/ep_ffi.cc compiles warning-free against this environment's jaxlib headers (the wheel build uses
    jaxlib 0.11.2's) and, where xla/ffi/api/record_api.h is missing, without the record targets, whose
    registration then reports that the record stage is not available."""
    import ctypes
    import shutil

    cxx = shutil.which(os.environ.get("CXX", "")) or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    include = pathlib.Path(jax.ffi.include_dir())
    if not record_api:
        shutil.copytree(include / "xla", tmp_path / "include" / "xla")
        (tmp_path / "include" / "xla" / "ffi" / "api" / "record_api.h").unlink(missing_ok=True)
        include = tmp_path / "include"
    elif not (include / "xla" / "ffi" / "api" / "record_api.h").is_file():
        pytest.skip("this jaxlib has no FFI record stage")
    lib = tmp_path / "libjax_latent_ep_ffi.so"
    proc = subprocess.run([cxx, "-std=c++17", "-O0", "-Wall", "-Werror", "-fPIC", "-shared", "-fvisibility=hidden",
                           "-isystem", str(include), str(REPO / "ffi" / "ep_ffi.cc"), "-o", str(lib), "-ldl"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    so = ctypes.CDLL(str(lib))
    so.ep_last_error.restype = ctypes.c_char_p
    so.ep_register_record_targets.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    rc = so.ep_register_record_targets(b"test_dispatch_rec", b"test_combine_rec")  # no XLA FFI API reached it
    message = so.ep_last_error().decode()
    if record_api:
        assert rc == 2 and "no XLA FFI API seen" in message, (rc, message)
    else:
        assert rc == 1 and "record stage not available" in message and "record_api.h" in message, (rc, message)
    for symbol in ("EpDispatch", "EpCombine", "ep_register_rank", "ep_record_counts"):
        assert hasattr(so, symbol), symbol


def test_backend_refuses_cpu_mesh():
    from jax_latent_ep.backends.nvlink import NvlinkBackend

    devices = jax.devices()
    if devices[0].platform == "gpu":
        pytest.skip("this machine has GPUs")
    mesh = jax.make_mesh((2,), ("ep",), devices=devices[:2])
    with pytest.raises(ValueError, match="compute capability|CUDA"):
        NvlinkBackend(mesh, "ep", 8, KIMI_K3)


# ---------------------------------------------------------------------------------------------------------
# GPU, one process


def _mesh(n):
    return jax.make_mesh((n,), ("ep",), devices=_gpus()[:n])


def _as_stacked(per_rank):
    """run_case's per-rank results -> the model's layout (arrays stacked over ranks)."""
    from jax_latent_ep.testing.model import ModelReceived

    n = len(per_rank)
    recv1 = ModelReceived(*(np.stack([per_rank[r][0][i] for r in range(n)]) for i in range(5)))
    routed = np.stack([per_rank[r][1] for r in range(n)])
    recv2 = ModelReceived(*(np.stack([per_rank[r][2][i] for r in range(n)]) for i in range(5)))
    normed = np.stack([per_rank[r][3] for r in range(n)])
    return recv1, routed, recv2, normed


@pytest.mark.gpu
@pytest.mark.parametrize("n, tokens, max_tokens, routing", [
    (1, 5, 8, "random_topk"),
    (1, 64, 64, "random_topk"),
    (2, 5, 8, "random_topk"),
    (2, 37, 64, "random_topk"),
    (2, 16, 16, "all_to_one_rank"),
    (2, 1, 1, "random_topk"),
])
def test_two_layers_match_xla_and_model(n, tokens, max_tokens, routing):
    if len(_gpus()) < n:
        pytest.skip(f"needs {n} GPUs, found {len(_gpus())}")
    from jax_latent_ep.backends.nvlink import NvlinkBackend
    from jax_latent_ep.backends.xla import XlaBackend
    from jax_latent_ep.testing import check
    from jax_latent_ep.testing.model import bf16_ulp_diff

    mesh = _mesh(n)
    case = check.make_case(100 * n + tokens, KIMI_K3, n, tokens, max_tokens, routing)
    with NvlinkBackend(mesh, "ep", max_tokens, KIMI_K3) as nv:
        got = check.run_case(nv, case)
        got_again = check.run_case(nv, case)  # the buffers were re-armed: same results
        assert nv.status() == {(0, r): (0, 0, 0, 0) for r in range(n)}
    xla = _as_stacked(check.run_case(XlaBackend(mesh, "ep", max_tokens, KIMI_K3), case))
    model = check.model_two_layers(case)
    for r in range(n):
        # The contract, against the NumPy model: rows and routed bit-exact, normed within 1 ulp.
        check.compare_rank(got[r], model, r)
        check.compare_rank(got_again[r], model, r)
        # Against the XLA backend on the same GPUs: rows and routed bit-exact; normed within 2 ulp (both
        # may be 1 ulp off the exact model, in opposite directions).
        g_recv1, g_routed, g_recv2, g_normed = got[r]
        check.compare_received(g_recv1, xla[0], r, "layer 1 dispatch vs xla")
        np.testing.assert_array_equal(g_routed.view(np.uint16), xla[1][r].view(np.uint16), err_msg="routed vs xla")
        check.compare_received(g_recv2, xla[2], r, "layer 2 dispatch vs xla")
        assert bf16_ulp_diff(g_normed, xla[3][r]).max() <= 2, "normed vs xla"


@pytest.mark.gpu
def test_two_backends_coexist():
    n = min(2, len(_gpus()))
    from jax_latent_ep.backends.nvlink import NvlinkBackend
    from jax_latent_ep.testing import check

    mesh = _mesh(n)
    a = NvlinkBackend(mesh, "ep", 8, KIMI_K3)
    b = NvlinkBackend(mesh, "ep", 16, KIMI_K3, grid=(20, 3))
    try:
        ca = check.make_case(1, KIMI_K3, n, 7, 8)
        cb = check.make_case(2, KIMI_K3, n, 11, 16)
        ga, gb = check.run_case(a, ca), check.run_case(b, cb)
        wa, wb = check.model_two_layers(ca), check.model_two_layers(cb)
        for r in range(n):
            check.compare_rank(ga[r], wa, r)
            check.compare_rank(gb[r], wb, r)
    finally:
        a.close()
        b.close()
    a.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        a.dispatch(None, None, None)


# ---------------------------------------------------------------------------------------------------------
# GPU, subprocesses (flags that must precede JAX's start; several processes)

_LAYERS_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import jax, numpy as np
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.backends.nvlink import NvlinkBackend
    from jax_latent_ep.backends.xla import XlaBackend
    from jax_latent_ep.testing import check
    from jax_latent_ep.testing.model import bf16_ulp_diff

    n, tokens, max_tokens, layers = (int(v) for v in sys.argv[1:5])
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices()[:n])
    case = check.make_case(7, KIMI_K3, n, tokens, max_tokens)
    make = lambda ep, scan: check.chained_layers(ep, mesh, layers, scan)  # routed: bit-exact layer after layer
    args = check.sharded_inputs(case, mesh, "ep")
    xla = XlaBackend(mesh, "ep", max_tokens, KIMI_K3)
    with NvlinkBackend(mesh, "ep", max_tokens, KIMI_K3) as nv:
        for scan in (False, True):
            want = [np.asarray(a) for a in make(xla, scan)(*args)]
            fn = make(nv, scan)
            for rep in range(3):  # replays of one executable (command buffers: graph launches)
                got = [np.asarray(a) for a in fn(*args)]
                assert np.array_equal(got[0].view(np.uint16), want[0].view(np.uint16)), (scan, rep, "routed")
                assert bf16_ulp_diff(got[1], want[1]).max() <= 2, (scan, rep, "normed")
            jax.block_until_ready(fn(*args))
            t0 = time.perf_counter()
            reps = 20
            for _ in range(reps):
                out = fn(*args)
            jax.block_until_ready(out)
            dt = (time.perf_counter() - t0) / reps / (layers + 1)
            print(f"RESULT n={n} T={tokens} layers={layers + 1} scan={scan} us_per_layer={dt * 1e6:.1f}", flush=True)
        assert all(v == (0, 0, 0, 0) for v in nv.status().values())
    print("OK", flush=True)
    """
)

COMMAND_BUFFER_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


def _run(script: str, args, env_extra, timeout=300):
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("flags", [COMMAND_BUFFER_FLAGS, ""], ids=["command_buffers", "default"])
def test_many_layers_one_jit(flags):
    n = min(2, len(_gpus()))
    proc = _run(_LAYERS_SCRIPT, [n, 5, 8, 12], {"XLA_FLAGS": flags})
    print(proc.stdout)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


_PATH_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from jax_latent_ep.runtime import ffi
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.backends.nvlink import NvlinkBackend
    from jax_latent_ep.backends.xla import XlaBackend
    from jax_latent_ep.testing import check
    from jax_latent_ep.testing.model import bf16_ulp_diff

    n, tokens, max_tokens, layers = (int(v) for v in sys.argv[1:5])
    out_path = sys.argv[5]
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices()[:n])
    case = check.make_case(9, KIMI_K3, n, tokens, max_tokens)
    make = lambda ep, scan: check.chained_layers(ep, mesh, layers, scan)
    # New device buffers, same values: the executable's buffer addresses change between runs.
    fresh = lambda: check.sharded_inputs(case, mesh, "ep")

    inputs = [fresh(), fresh()]
    xla = XlaBackend(mesh, "ep", max_tokens, KIMI_K3)
    saved = {}
    with NvlinkBackend(mesh, "ep", max_tokens, KIMI_K3) as nv:
        print("PATH", ffi.launch_path(), "|", ffi.record_error(), flush=True)
        for scan in (False, True):
            want = [np.asarray(a) for a in make(xla, scan)(*inputs[0])]
            fn = make(nv, scan)
            first = None
            for rep in range(4):  # alternating inputs: command-buffer updates (record: UpdateLaunch)
                got = [np.asarray(a) for a in fn(*inputs[rep % 2])]
                assert np.array_equal(got[0].view(np.uint16), want[0].view(np.uint16)), (scan, rep, "routed")
                assert bf16_ulp_diff(got[1], want[1]).max() <= 2, (scan, rep, "normed")
                if first is None:
                    first = got
                for a, b in zip(got, first):
                    assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), (scan, rep, "replay differs")
            saved[f"routed_scan{int(scan)}"], saved[f"normed_scan{int(scan)}"] = (a.view(np.uint16) for a in first)
        assert all(v == (0, 0, 0, 0) for v in nv.status().values()), nv.status()
    np.savez(out_path, **saved)
    print("COUNTS", *ffi.record_counts(), flush=True)
    print("OK", flush=True)
    """
)


@pytest.mark.gpu
@pytest.mark.slow
def test_record_and_traced_paths_agree(tmp_path):
    """One jitted multi-layer program (unrolled and in lax.scan, command buffers on, inputs alternating
    between two sets of buffers) on the record path (with and without PDL) and on the traced path: each
    against the XLA backend (routed bit for bit, normed within 2 ulp), and all three bit for bit alike.
    The record handlers must have added and updated kernel nodes; the traced path must not touch them."""
    n = min(2, len(_gpus()))
    cases = {
        "record": ({"JAX_LATENT_EP_FFI_RECORD": "1", "JAX_LATENT_EP_PDL": "1"}, "record"),
        "record_no_pdl": ({"JAX_LATENT_EP_FFI_RECORD": "1", "JAX_LATENT_EP_PDL": "0"}, "record"),
        "traced": ({"JAX_LATENT_EP_FFI_RECORD": "0", "JAX_LATENT_EP_PDL": "1"}, "traced"),
    }
    results = {}
    for label, (env, path) in cases.items():
        out = tmp_path / f"{label}.npz"
        proc = _run(_PATH_SCRIPT, [n, 5, 8, 6, out], {"XLA_FLAGS": COMMAND_BUFFER_FLAGS, **env})
        print(label, proc.stdout)
        assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert f"PATH {path} " in proc.stdout, proc.stdout
        creates, updates = (int(v) for v in proc.stdout.split("COUNTS")[1].split()[:2])
        if path == "record":
            assert creates > 0 and updates > 0, (label, creates, updates)
        else:
            assert (creates, updates) == (0, 0), (label, creates, updates)
        with np.load(out) as z:
            results[label] = {k: z[k] for k in z.files}
    for label in ("record_no_pdl", "traced"):
        for key, want in results["record"].items():
            got = results[label][key]
            np.testing.assert_array_equal(got, want, err_msg=f"{label} {key} (bf16 bits)")


_MULTIPROCESS_SCRIPT = textwrap.dedent(
    """
    import os, sys
    rank, port, tokens, max_tokens = (int(v) for v in sys.argv[1:5])
    import jax
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.backends.nvlink import NvlinkBackend
    from jax_latent_ep.testing import check

    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices())
    case = check.make_case(11, KIMI_K3, 2, tokens, max_tokens)
    want = check.model_two_layers(case)
    with NvlinkBackend(mesh, "ep", max_tokens, KIMI_K3) as nv:
        assert nv._buffers[0].multiprocess and list(nv.status()) == [(0, rank)]
        fn = jax.jit(jax.shard_map(check.two_layers(nv), mesh=mesh,
                     in_specs=(P("ep"),) * 4 + (P(),), out_specs=P("ep")))
        n, rows = 2, case.rows
        flat = lambda a: a.reshape(n * a.shape[1], *a.shape[2:])
        junk = np.moveaxis(case.junk, 0, 1).reshape(n * 2, rows, -1)
        def put(a, spec):
            sharding = NamedSharding(mesh, spec)
            return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])
        args = [put(flat(case.x), P("ep")), put(flat(case.ids), P("ep")), put(flat(case.weights), P("ep")),
                put(junk, P("ep")), put(case.norm_weight, P())]
        for rep in range(3):
            res = fn(*args)
            recv1, routed, recv2, normed = jax.tree.map(
                lambda a: np.asarray(a.addressable_shards[0].data), res)
            stats = check.compare_rank((tuple(recv1), routed, tuple(recv2), normed), want, rank)
        jax.block_until_ready(res)
        print("OK", rank, stats, flush=True)
    jax.distributed.shutdown()
    """
)


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_one_gpu_each():
    if len(_gpus()) < 2:
        pytest.skip("needs 2 GPUs")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env.pop("XLA_FLAGS", None)
    procs = []
    for rank in range(2):
        e = dict(env, CUDA_VISIBLE_DEVICES=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-c", _MULTIPROCESS_SCRIPT, str(rank), str(port), "13", "16"],
                                      env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO)))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        outs.append((p.returncode, out, err))
    for rank, (rc, out, err) in enumerate(outs):
        print(out)
        assert rc == 0 and f"OK {rank}" in out, f"rank {rank} rc={rc}\n{out[-2000:]}\n{err[-6000:]}"


_TIMEOUT_SCRIPT = textwrap.dedent(
    """
    import os
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.backends.nvlink import NvlinkBackend

    nv = NvlinkBackend(jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2]), "ep", 8, KIMI_K3, timeout_s=0.5)
    # Rank 0 dispatches alone (a one-device program): it must time out waiting for rank 1's flag.
    alone = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
    fn = jax.jit(jax.shard_map(lambda x, i, w: nv.dispatch(x, i, w).src, mesh=alone, in_specs=(P("ep"),) * 3,
                               out_specs=P("ep")))
    put = lambda a: jax.device_put(a, jax.NamedSharding(alone, P("ep")))
    x = put(jnp.zeros((4, 3584), jnp.bfloat16))
    ids = put(jnp.zeros((4, 16), jnp.int32))  # every token to expert 0 (rank 0) only
    w = put(jnp.ones((4, 16), jnp.float32))
    try:
        jax.block_until_ready(fn(x, ids, w))
        print("NO ERROR", flush=True)
    except Exception as e:
        print("RAISED", type(e).__name__, str(e)[:300].replace(chr(10), " "), flush=True)
    print("STATUS", nv.status()[(0, 0)], flush=True)
    try:
        nv.check()
    except RuntimeError as e:
        print("CHECK", e, flush=True)
    os._exit(0)  # the trap killed the CUDA context: no orderly teardown
    """
)


@pytest.mark.gpu
@pytest.mark.slow
def test_flag_timeout_is_reported():
    if len(_gpus()) < 2:
        pytest.skip("needs 2 GPUs")
    proc = _run(_TIMEOUT_SCRIPT, [], {"XLA_FLAGS": ""}, timeout=120)
    print(proc.stdout)
    assert "RAISED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "STATUS (1, 0, 1, " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CHECK jax_latent_ep: dispatch on rank 0 timed out waiting for rank 1" in proc.stdout, proc.stdout


def test_grid_bound_is_checked_at_trace_time():
    from jax_latent_ep.backends.nvlink import NvlinkBackend

    nv = NvlinkBackend.__new__(NvlinkBackend)  # no GPU: only the grid rule's state
    nv.ranks, nv.max_tokens, nv._grid, nv.max_grids = 2, 1024, None, (396, 396)
    assert nv.grids(396) == (396, 396)
    with pytest.raises(ValueError, match="only 396 fit"):
        nv.grids(397)
    nv._grid = (10, 500)
    with pytest.raises(ValueError, match="combine kernel would need 500"):
        nv.grids(5)


# ---------------------------------------------------------------------------------------------------------
# CPU: a process's failed setup (error records in the key-value store)


class FakeKV:
    """jax.distributed's key-value client, in memory: a key is set once (the real store refuses overwrites)."""

    def __init__(self):
        self.store = {}

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        if key in self.store and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.store[key] = bytes(value)

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        if key not in self.store:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key} after {timeout_in_ms} ms")
        return self.store[key]


class FakeDevice:
    platform = "gpu"
    compute_capability = "9.0"

    def __init__(self, process_index, id_):
        self.process_index, self.id = process_index, id_

    def __repr__(self):
        return f"FakeDevice({self.id}, process {self.process_index})"


def test_exchange_reads_every_rank():
    kv = FakeKV()
    kv.key_value_set_bytes(f"{symmetric.KV_PREFIX}/k/rank1", _record(1).encode())  # the other process's
    published = set()
    records = symmetric.exchange_records(kv, "k", {0: _record(0)}, 2, 1.0, published)
    assert records == {0: _record(0), 1: _record(1)} and published == {0}
    assert symmetric.decode_record(kv.store[f"{symmetric.KV_PREFIX}/k/rank0"]) == _record(0)


def test_exchange_fails_at_once_on_an_error_record():
    kv = FakeKV()
    written = symmetric.publish_failure(kv, "k", [1], 3, LookupError("no compiled dispatch kernel"))
    assert written == [1]
    with pytest.raises(symmetric.PeerSetupError) as info:
        symmetric.exchange_records(kv, "k", {0: _record(0)}, 2, 300.0)
    message = str(info.value)
    assert "process 3 failed while setting up rank 1 of expert-parallel group 'k'" in message, message
    assert "LookupError: no compiled dispatch kernel" in message, message


def test_error_record_never_replaces_a_record():
    kv = FakeKV()
    kv.key_value_set_bytes(f"{symmetric.KV_PREFIX}/k/rank0", _record(0).encode())
    assert symmetric.publish_failure(kv, "k", [0, 1], 0, "late failure") == [1]
    assert symmetric.decode_record(kv.store[f"{symmetric.KV_PREFIX}/k/rank0"]) == _record(0)
    assert symmetric.publish_failure(None, "k", [0], 0, "no client") == []


def test_exchange_times_out_naming_the_rank():
    with pytest.raises(symmetric.SymmetricMemoryError, match="rank 1 of group 'k' did not publish its buffer"):
        symmetric.exchange_records(FakeKV(), "k", {0: _record(0)}, 2, 0.01)


def test_symmetric_buffers_publish_an_error_record_on_failure(monkeypatch):
    """A process whose setup fails before publishing leaves an error record under its ranks' keys."""
    kv = FakeKV()
    monkeypatch.setattr(symmetric, "_distributed_client", lambda: kv)

    def no_driver():
        raise symmetric.SymmetricMemoryError("cuda-bindings missing (test)")

    monkeypatch.setattr(symmetric, "_driver", no_driver)
    me = jax.process_index()
    devices = [FakeDevice(me, 0), FakeDevice(me + 1, 1)]  # rank 0 here, rank 1 in another process
    with pytest.raises(symmetric.SymmetricMemoryError, match="cuda-bindings missing"):
        symmetric.SymmetricBuffers(devices, 8, KIMI_K3, key="9/0")
    assert list(kv.store) == [f"{symmetric.KV_PREFIX}/9/0/rank0"]
    with pytest.raises(symmetric.PeerSetupError, match=f"process {me} failed .*cuda-bindings missing"):
        symmetric.decode_record(kv.store[f"{symmetric.KV_PREFIX}/9/0/rank0"], "9/0")


def test_backend_publishes_error_records_for_every_group(monkeypatch):
    """NvlinkBackend failing before its buffers exist (no kernel here) still answers the peers of each group."""
    from types import SimpleNamespace

    from jax_latent_ep.backends import nvlink
    from jax_latent_ep.runtime import ffi

    kv = FakeKV()
    monkeypatch.setattr(nvlink, "_distributed_client", lambda: kv)

    def no_kernel(*args):
        raise LookupError("no compiled dispatch kernel for this test")

    monkeypatch.setattr(ffi, "find_kernel", no_kernel)
    me = jax.process_index()
    devices = np.empty((2, 2), object)  # ("dp", "ep"): this process drives rank 0 of both groups
    for g in range(2):
        for r in range(2):
            devices[g, r] = FakeDevice(me + r, 2 * g + r)
    mesh = SimpleNamespace(shape={"dp": 2, "ep": 2}, axis_names=("dp", "ep"), devices=devices)
    with pytest.raises(LookupError, match="no compiled dispatch kernel"):
        nvlink.NvlinkBackend(mesh, "ep", 8, KIMI_K3)
    keys = sorted(kv.store)
    assert len(keys) == 2 and keys[0].endswith("/0/rank0") and keys[1].endswith("/1/rank0"), keys
    for key in keys:
        with pytest.raises(symmetric.PeerSetupError, match=f"process {me} failed .*LookupError: no compiled"):
            symmetric.decode_record(kv.store[key])


# ---------------------------------------------------------------------------------------------------------
# CPU: status, check, close and release on stand-ins for the GPU state


class FakeBuffers:
    """Stands in for SymmetricBuffers: local ranks with fixed error records; close() is logged."""

    def __init__(self, records, log=None):
        self.records, self.log = dict(records), log if log is not None else []
        self.local = [SimpleRank(r) for r in sorted(records)]
        self.closed = threading.Event()

    def status(self, rank):
        return self.records[rank]

    def close(self):
        self.log.append(("free", sorted(self.records)))
        self.closed.set()


class SimpleRank:  # a LocalRank stand-in
    def __init__(self, rank):
        self.rank = rank


def _stand_in(buffers, groups, registered=(), log=None, monkeypatch=None):
    from jax_latent_ep.runtime import ffi
    from jax_latent_ep.backends.nvlink import NvlinkBackend

    nv = NvlinkBackend.__new__(NvlinkBackend)  # no GPU: only the state status / check / close use
    nv.instance, nv.axis_name, nv._closed = 424242, "ep", False
    nv._buffers, nv._group_index, nv._registered = list(buffers), list(groups), list(registered)
    if monkeypatch is not None:
        monkeypatch.setattr(ffi, "unregister_rank",
                            lambda instance, ordinal: log.append(("unregister", instance, ordinal)))
    nv._track()
    return nv



def test_status_keys_by_group_and_rank():
    """Two EP groups in one process (a 2 x 2 ("dp", "ep") mesh): equal ranks no longer overwrite each other."""
    nv = _stand_in([FakeBuffers({0: (0, 0, 0, 0), 1: (0, 0, 0, 0)}),
                    FakeBuffers({0: (0, 0, 0, 0), 1: (2, 1, 0, 7)})], [0, 1])
    assert nv.status() == {(0, 0): (0, 0, 0, 0), (0, 1): (0, 0, 0, 0), (1, 0): (0, 0, 0, 0), (1, 1): (2, 1, 0, 7)}
    with pytest.raises(RuntimeError) as info:
        nv.check()
    assert str(info.value) == ("jax_latent_ep: combine on rank 1 timed out waiting for rank 0 at layer 7 "
                               "(group 1, error code 2)")


@pytest.mark.parametrize("record, message", [
    ((1, 0, 1, 3), "dispatch on rank 0 timed out waiting for rank 1 at layer 3 (group 0, error code 1)"),
    ((2, 1, 0, 4), "combine on rank 1 timed out waiting for rank 0 at layer 4 (group 0, error code 2)"),
    ((3, 1, 1, 5), "dispatch called twice without a combine on rank 1 at layer 5 (group 0, error code 3)"),
    # code 4: the kernel records the last dispatched layer; a combine before any dispatch records all ones.
    ((4, 0, 0, 0xFFFFFFFF), "combine called without its dispatch on rank 0 at layer 0 (group 0, error code 4)"),
    ((4, 0, 0, 2), "combine called without its dispatch on rank 0 at layer 3 (group 0, error code 4)"),
    ((9, 0, 1, 2), "unknown error on rank 0 (peer 1) at layer 2 (group 0, error code 9)"),
])
def test_check_names_every_error_code(record, message):
    rank = record[1]
    nv = _stand_in([FakeBuffers({rank: record, 1 - rank: (0, 0, 0, 0)})], [0])
    with pytest.raises(RuntimeError) as info:
        nv.check()
    assert str(info.value) == "jax_latent_ep: " + message


def test_check_passes_and_reports_every_failed_rank():
    nv = _stand_in([FakeBuffers({0: (0, 0, 0, 0), 1: (0, 0, 0, 0)})], [0])
    nv.check()
    nv = _stand_in([FakeBuffers({0: (3, 0, 0, 2), 1: (1, 1, 0, 2)})], [0])
    with pytest.raises(RuntimeError, match=r"dispatch called twice .* on rank 0 .*; dispatch on rank 1 timed out"):
        nv.check()


def test_close_unregisters_before_freeing_and_refuses_later_calls(monkeypatch):
    log = []
    nv = _stand_in([FakeBuffers({0: (0,) * 4}, log), FakeBuffers({1: (0,) * 4}, log)], [0, 0], registered=[0, 1],
                   log=log, monkeypatch=monkeypatch)
    nv.close()
    assert log == [("unregister", 424242, 0), ("unregister", 424242, 1), ("free", [0]), ("free", [1])]
    assert nv.status() == {}
    nv.close()  # idempotent
    assert len(log) == 4
    for call in (lambda: nv.dispatch(None, None, None), lambda: nv.combine(None, None)):
        with pytest.raises(ValueError, match="NvlinkBackend is closed"):
            call()
    del nv
    import gc

    gc.collect()
    assert len(log) == 4  # no second release by the finalizer


def test_dropped_backend_is_released(monkeypatch):
    """Garbage collection releases a backend not closed: unregistered at once, buffers closed off-thread."""
    import gc

    log = []
    bufs = FakeBuffers({0: (0,) * 4}, log)
    nv = _stand_in([bufs], [0], registered=[3], log=log, monkeypatch=monkeypatch)
    del nv
    gc.collect()
    assert bufs.closed.wait(10), log
    assert log == [("unregister", 424242, 3), ("free", [0])]


# ---------------------------------------------------------------------------------------------------------
# GPU, subprocesses: bad input and call-sequence errors on the nvlink backend

_BAD_INPUT_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_latent_ep import ExpertParallel
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.testing import check

    n, t, mt = int(sys.argv[1]), 5, 8
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices()[:n])
    ep = ExpertParallel(mesh, "ep", max_tokens=mt, shape=KIMI_K3, backend="nvlink", check_ids=True)
    spec = P("ep")
    case = check.make_case(5, KIMI_K3, n, t, mt)
    flat = lambda a: a.reshape(n * a.shape[1], *a.shape[2:])
    x, ids, w = flat(case.x), flat(case.ids), flat(case.weights)

    def layer(x, i, w):
        recv = ep.dispatch(x, i, w)
        return ep.combine(recv.x.astype(jnp.bfloat16), i)

    def bad_out(x, i, w):
        recv = ep.dispatch(x, i, w)
        return ep.combine(recv.x.astype(jnp.bfloat16)[:-1], i)

    bad_ids = ids.copy()
    bad_ids[1, 3] = KIMI_K3.experts
    attempts = [
        ("dtype", layer, (x.astype(np.float32), ids, w), "x must be bfloat16[5, 3584], got float32[5, 3584]"),
        ("shape", layer, (x[:, :1792], ids, w), "x must be bfloat16[5, 3584], got bfloat16[5, 1792]"),
        ("ids shape", layer, (x, ids[:, :8], w), "ids must be int32[5, 16], got int32[5, 8]"),
        ("too many tokens", layer, (np.concatenate([x, x]), np.concatenate([ids, ids]), np.concatenate([w, w])),
         "T=10 tokens"),
        ("out shape", bad_out, (x, ids, w), "out must be bfloat16"),
        ("ids out of range", layer, (x, bad_ids, w), "ExpertParallel.dispatch: ids[1, 3] = 896 on rank 0"),
    ]
    for label, fn, arrays, expect in attempts:
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
        try:
            jax.block_until_ready(f(*[jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]))
        except Exception as e:
            text = str(e).replace(chr(10), " ")
            assert expect in text, (label, text[:2000])
            print("REFUSED", label, ":", type(e).__name__, text[:200], flush=True)
        else:
            raise AssertionError(f"{label}: accepted")
        try:
            jax.effects_barrier()  # a failed host callback is also recorded in JAX's runtime tokens
        except Exception:
            pass
        assert ep.status() and all(v == (0, 0, 0, 0) for v in ep.status().values()), (label, ep.status())
    # No kernel ran: a dispatch without its combine would make this next dispatch fail (error code 3).
    got = check.run_case(ep, case)
    want = check.model_two_layers(case)
    for r in range(n):
        check.compare_rank(got[r], want, r)
    ep.check()
    print("OK", flush=True)
    """
)


@pytest.mark.gpu
@pytest.mark.slow
def test_bad_input_refused_before_any_kernel():
    """Wrong dtype / shape, T > max_tokens, a bad `out`, ids out of range (check_ids) on the nvlink backend:
    each refused with its message, no error record, and a correct two-layer run afterwards (so no kernel ran)."""
    n = min(2, len(_gpus()))
    proc = _run(_BAD_INPUT_SCRIPT, [n], {"XLA_FLAGS": ""}, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("REFUSED") == 6, proc.stdout


_SEQUENCE_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.backends.nvlink import NvlinkBackend

    mode, n = sys.argv[1], int(sys.argv[2])
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices()[:n])
    nv = NvlinkBackend(mesh, "ep", 8, KIMI_K3, timeout_s=2.0)

    def twice(x, i, w):
        first = nv.dispatch(x, i, w)
        x2 = x + (first.weights[0, 0] * 0).astype(x.dtype)  # the second dispatch follows the first
        return nv.dispatch(x2, i, w).src

    def without(x, i, w):
        out = jnp.zeros((nv.rows, 3584), jnp.bfloat16) + x[0, 0] * 0
        return nv.combine(out, i)

    spec = P("ep")
    fn = jax.jit(jax.shard_map({"twice": twice, "without": without}[mode], mesh=mesh, in_specs=(spec,) * 3,
                               out_specs=spec))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    x = put(jnp.zeros((n * 4, 3584), jnp.bfloat16))
    ids = put(jnp.tile(jnp.arange(16, dtype=jnp.int32), (n * 4, 1)))
    w = put(jnp.ones((n * 4, 16), jnp.float32))
    try:
        jax.block_until_ready(fn(x, ids, w))
        print("NO ERROR", flush=True)
    except Exception as e:
        print("RAISED", type(e).__name__, str(e)[:300].replace(chr(10), " "), flush=True)
    print("STATUS", nv.status()[(0, 0)], flush=True)
    try:
        nv.check()
        print("CHECK PASSED", flush=True)
    except RuntimeError as e:
        print("CHECK", e, flush=True)
    os._exit(0)  # the trap killed the CUDA context: no orderly teardown
    """
)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("mode, code, words", [
    ("twice", 3, "dispatch called twice without a combine on rank 0 at layer"),
    ("without", 4, "combine called without its dispatch on rank 0 at layer"),
])
def test_sequence_error_is_reported(mode, code, words):
    """A jitted program calling dispatch twice in a row (or combine first) fails; check() names the code."""
    n = min(2, len(_gpus()))
    proc = _run(_SEQUENCE_SCRIPT, [mode, n], {"XLA_FLAGS": ""}, timeout=120)
    print(proc.stdout)
    out = proc.stdout
    assert "RAISED" in out, out[-3000:] + proc.stderr[-6000:]
    assert f"STATUS ({code}, 0, 0, " in out, out[-3000:] + proc.stderr[-3000:]
    assert f"CHECK jax_latent_ep: {words}" in out and f"error code {code})" in out, out
