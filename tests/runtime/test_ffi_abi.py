"""The FFI library's C++ (ffi/) against the kernel ABI's one declaration, jax_latent_ep/kernels/abi.py (CPU only).

ffi/ includes `ep_abi.h`, which the build generates from abi.py (`abi.header()`). These tests compile ffi/ with a
C++ compiler against a header generated here: as it is (the library builds warning-free and loads, with and
without the FFI record stage), from an ABI with a parameter added, removed or moved on the Python side only (the
C++ build fails naming it), and a small program that prints what the header says (limits, status record, error
messages through the library's own formatting, struct fields in order) to compare with abi.py.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import os
import pathlib
import shutil
import subprocess

import pytest

from jax_latent_ep.kernels import abi

REPO = pathlib.Path(__file__).resolve().parents[2]
FFI = REPO / "ffi"
SOURCES = sorted(FFI.glob("*.cc"))
#: The language and the warnings CMakeLists.txt builds ffi/ with (checked below), plus -Werror: warning-free.
FLAGS = ["-std=c++20", "-Wall", "-Wextra", "-Werror=missing-field-initializers"]


def _compiler():
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


CXX = _compiler()
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++, c++, clang++ or $CXX) found")


@pytest.fixture(scope="module")
def ffi_include() -> pathlib.Path:
    jax = pytest.importorskip("jax")
    include = pathlib.Path(jax.ffi.include_dir())
    if not (include / "xla" / "ffi" / "api" / "ffi.h").is_file():
        pytest.skip(f"no XLA FFI headers under {include}")
    return include


def _header(directory: pathlib.Path) -> pathlib.Path:
    """Writes ep_abi.h as abi.py (as it is now, monkeypatched or not) generates it into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "ep_abi.h"
    path.write_text(abi.header())
    return path


def _run_all(commands, timeout=120):
    """Runs the compiler commands concurrently; returns their CompletedProcess objects in order."""
    workers = max(1, min(len(commands), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        run = lambda c: subprocess.run(c, check=False, capture_output=True, text=True, timeout=timeout)
        return list(pool.map(run, commands))


def _compile(source, generated, include, extra=()):
    return [CXX, *FLAGS, "-Werror", "-fPIC", "-fvisibility=hidden", "-I", str(generated), "-isystem", str(include),
            *extra, "-c", str(source)]


def test_cmake_builds_ffi_with_these_flags():
    """The flags that make a parameter missing in the C++ an error are the build's, and the build generates the
    header from abi.py."""
    cmake = (REPO / "CMakeLists.txt").read_text()
    assert "set(CMAKE_CXX_STANDARD 20)" in cmake
    for flag in FLAGS[1:]:
        assert flag in cmake, flag
    assert "-m jax_latent_ep.kernels.abi --header" in cmake and "jax_latent_ep/kernels/abi.py" in cmake
    for source in SOURCES:
        assert f"ffi/{source.name}" in cmake, f"{source.name} is not in the library's sources"


@pytest.mark.slow
def test_library_builds_and_loads(ffi_include, tmp_path):
    """ffi/ compiles warning-free against the generated header and this environment's jaxlib headers (the wheel
    build uses jaxlib 0.11.2's) and, where xla/ffi/api/record_api.h is missing, without the record targets, whose
    registration then reports that the record stage is not available. The library exports its C ABI, and its
    limit checks are the header's."""
    without = tmp_path / "without_record_api"
    shutil.copytree(ffi_include / "xla", without / "xla")
    (without / "xla" / "ffi" / "api" / "record_api.h").unlink(missing_ok=True)
    variants = {"without_record_api": without}
    if (ffi_include / "xla" / "ffi" / "api" / "record_api.h").is_file():
        variants["with_record_api"] = ffi_include
    generated = tmp_path / "generated"
    _header(generated)
    # Sources that do not see the record stage (no launch.h) compile once for both variants.
    shared = [s for s in SOURCES if '#include "launch.h"' not in s.read_text()]
    objects = {v: [tmp_path / f"{s.stem}.o" if s in shared else tmp_path / v / f"{s.stem}.o" for s in SOURCES]
               for v in variants}
    jobs = {}
    for v, include in variants.items():
        (tmp_path / v).mkdir(exist_ok=True)
        for source, obj in zip(SOURCES, objects[v]):
            jobs.setdefault(obj, _compile(source, generated, include, ["-O0", "-o", str(obj)]))
    for obj, proc in zip(jobs, _run_all(list(jobs.values()))):
        assert proc.returncode == 0, f"{obj}:\n{proc.stderr[-6000:]}"
    for v in variants:
        lib = tmp_path / v / "libjax_latent_ep_ffi.so"
        link = subprocess.run([CXX, "-shared", *map(str, objects[v]), "-o", str(lib), "-ldl"], check=False,
                              capture_output=True, text=True, timeout=120)
        assert link.returncode == 0, link.stderr[-6000:]
        _check_library(ctypes.CDLL(str(lib)), record_api=v == "with_record_api")


def _check_library(so, record_api):
    so.ep_last_error.restype = ctypes.c_char_p
    so.ep_register_record_targets.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    rc = so.ep_register_record_targets(b"test_dispatch_rec", b"test_combine_rec")  # no XLA FFI API reached it
    message = so.ep_last_error().decode()
    if record_api:
        assert rc == 2 and "no XLA FFI API seen" in message, (rc, message)
    else:
        assert rc == 1 and "record stage not available" in message and "record_api.h" in message, (rc, message)
    so.ep_register_expert_record_targets.argtypes = [ctypes.POINTER(ctypes.c_char_p)] * 2 + [ctypes.c_int]

    def register_expert(*ops):
        names = [f"test_{op}_rec".encode() for op in ops]
        rc = so.ep_register_expert_record_targets((ctypes.c_char_p * len(ops))(*(op.encode() for op in ops)),
                                                  (ctypes.c_char_p * len(ops))(*names), len(ops))
        return rc, so.ep_last_error().decode()

    rc, message = register_expert("grouped_gemm", "expert_plan", "grouped_matmul_fp8_n8", "swiglu_mxfp8")
    assert (rc, "no XLA FFI API seen" in message) == ((2, True) if record_api else (1, False)), (rc, message)
    if record_api:  # an op without record handlers is refused by name before anything is registered
        assert register_expert("grouped_gemm", "no_such_op") == (1, "no record target for expert op 'no_such_op'")
    for symbol in ("EpDispatch", "EpCombine", "EpGroupedGemm", "EpExpertPlan", "EpExpertStage", "EpRowSum",
                   "ep_last_error", "ep_register_rank",
                   "ep_unregister_rank", "ep_max_grid", "ep_registered_count", "ep_register_record_targets",
                   "ep_register_expert_record_targets", "ep_register_kernel", "ep_record_counts"):
        assert hasattr(so, symbol), symbol
    # The limits come from the header: one rank past kMaxRanks, one token at kMaxTokensExclusive.
    so.ep_register_rank.argtypes = [ctypes.c_int64] + [ctypes.c_int] * 6 + [ctypes.c_uint64] * 2 + [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int,
        ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]

    def register(ranks, max_tokens, latent, topk):
        rc = so.ep_register_rank(0, 0, 0, ranks, max_tokens, latent, topk, 1, 0, None, 0, b"x", 1, b"d", 128, 0,
                                 b"x", 1, b"c", 128, 0)
        return rc, so.ep_last_error().decode()

    n, t = abi.NUM_MAX_RANKS, abi.NUM_MAX_TOKENS_EXCLUSIVE
    assert register(n + 1, 8, 64, 4) == (1, f"rank=0 ranks={n + 1} out of range")
    assert register(2, t, 64, 4) == (1, f"max_tokens={t} out of range")
    assert register(2, 8, abi.MX_BLOCK + 16, 4) == (1, f"bad shape latent={abi.MX_BLOCK + 16} topk=4")
    assert register(2, 8, 64, abi.NUM_MAX_TOPK + 1) == (1, f"bad shape latent=64 topk={abi.NUM_MAX_TOPK + 1}")
    rc, message = register(n, t - 1, 64, abi.NUM_MAX_TOPK)  # in range: fails later (no GPU, or no valid cubin)
    assert rc == 1 and "out of range" not in message and "bad shape" not in message, message


def _mutated(kernel: abi.Kernel, params) -> abi.Kernel:
    return dataclasses.replace(kernel, params=tuple(params))


def _mutations():
    """Headers from an abi.py changed on one side only: {case: ({op: its new parameters}, {op: words the compiler's
    error names})}, two changes per header (one per kernel, each in its own initializer)."""
    d, c = abi.DISPATCH, abi.COMBINE
    extra = abi.Param("extra_param", "i32", False, "a parameter added to abi.py only")
    i = d.names().index("peer_tokens")
    moved = list(d.params)
    moved[i - 1], moved[i] = moved[i], moved[i - 1]
    return {
        "added_removed": ({"dispatch": [*d.params, extra], "combine": [p for p in c.params if p.name != "eps"]},
                          {"dispatch": ["extra_param"], "combine": ["eps"]}),
        "moved_added": ({"dispatch": moved, "combine": [*c.params[:3], extra, *c.params[3:]]},
                        {"dispatch": ["order", "peer_tokens"], "combine": ["extra_param"]}),
    }


def _diagnoses_missing_designated_fields(tmp_path) -> bool:
    probe = tmp_path / "probe.cc"
    probe.write_text("struct P { int a; int b; };\nP f() { return P{.a = 1}; }\n")
    proc = subprocess.run([CXX, *FLAGS, "-fsyntax-only", str(probe)], check=False, capture_output=True, timeout=60)
    return proc.returncode != 0


def test_parameter_on_one_side_only_fails_the_build(ffi_include, tmp_path, monkeypatch):
    """A parameter added to, removed from or moved in abi.py but not in ffi/handlers.cc (or the reverse) fails the
    C++ build, and the compiler names it."""
    if not _diagnoses_missing_designated_fields(tmp_path):
        pytest.skip(f"{CXX} does not diagnose a missing designated initializer with {FLAGS}")
    handlers = FFI / "handlers.cc"
    cases = _mutations()
    commands = []
    for name, (params, _) in cases.items():
        with monkeypatch.context() as m:
            for op, new in params.items():
                changed = _mutated(abi.KERNELS[op], new)
                m.setattr(abi, op.upper(), changed)
                m.setitem(abi.KERNELS, op, changed)
            _header(tmp_path / name)
        commands.append(_compile(handlers, tmp_path / name, ffi_include, ["-fsyntax-only"]))
    for (name, (_, words)), proc in zip(cases.items(), _run_all(commands)):
        assert proc.returncode != 0, f"{name}: handlers.cc compiled against an ABI that differs from it"
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        for op, want in words.items():
            struct = abi.c_name(op) + "Params"
            found = any(struct in e and all(w in e for w in want) for e in errors)
            assert found, f"{name}, {op}:\n" + "\n".join(errors)
    assert abi.KERNELS["dispatch"] is abi.DISPATCH and abi.KERNELS["combine"] is abi.COMBINE  # restored


# Records whose message the C++ formats: every code of the ABI, an unknown one, edge values of the fields.
RECORDS = [(e.code, rank, peer, layer) for e in abi.ERRORS
           for rank, peer, layer in ((0, 1, 3), (31, 7, 0), (2, -1, -1), (5, 2**31 - 1, 2**31 - 1))]
RECORDS += [(0, 1, 2, 3), (99, 3, 4, 5), (-7, 0, -1, -2), (5, 1, 1, 1)]


def _probe_program() -> str:
    """C++ that prints what ep_abi.h says, one `key value...` line each, to compare with abi.py."""
    out = [
        "#include <cstddef>", "#include <cstdio>", "#include <type_traits>", '#include "ep_abi.h"',
        '#include "status.h"', "using namespace ep_abi;", "int main() {",
        ('std::printf("limits %d %d %d %d %d %d\\n", kMaxRanks, kMaxTopk, kTokenBits, kMaxTokensExclusive, '
         "kRowBlock, kMxBlock);"),
        'std::printf("gemm %d %d %d %d\\n", kGemmBlockM, kGemmBlockN, kGemmBlockK, kGemmWorkWords);',
        'std::printf("status %d %d %d %d %d\\n", kStatusCode, kStatusRank, kStatusPeer, kStatusLayer, kStatusWords);',
        "for (int n = 1; n <= 70; ++n) std::printf(\"stride %d %d\\n\", n, stride(n));",
        'std::printf("stride %d %d\\n", kMaxTokensExclusive - 1, stride(kMaxTokensExclusive - 1));',
    ]
    for e in abi.ERRORS:
        constant = "kError" + "".join(w.capitalize() for w in e.name.split("_"))
        out.append(f'std::printf("code {e.name} %d\\n", {constant});')
    for record in RECORDS:
        args = ", ".join(str(v) for v in record)
        out.append(f'std::printf("describe %s\\n", jax_latent_ep::describe_error({args}).c_str());')
    for kernel in abi.KERNELS.values():
        struct = abi.c_name(kernel.op) + "Params"
        symbol = abi.c_name(kernel.op) + "Symbol"
        out.append(f'std::printf("params {kernel.op} %d %s\\n", k{struct}Count, k{symbol});')
        for p in kernel.params:
            t = f"decltype({struct}::{p.name})"
            out.append(f'std::printf("field {kernel.op} {p.name} %zu %zu %d\\n", offsetof({struct}, {p.name}), '
                       f"sizeof({t}), (int)std::is_floating_point_v<{t}>);")
        # Distinct values in ABI order, visited in order with their address flags.
        values = ", ".join(f".{p.name} = {i + 1}" for i, p in enumerate(kernel.params))
        out.append(f"visit_params({struct}{{{values}}}, [](auto v, bool a) "
                   f'{{ std::printf("visit {kernel.op} %lld %d\\n", (long long)v, (int)a); }});')
    out += ["return 0;", "}"]
    return "\n".join(out) + "\n"


def test_header_says_what_abi_py_says(tmp_path):
    """The generated header's limits, stride, status record, error codes, messages (formatted by the library's own
    describe_error in ffi/status.h) and parameter structs (fields, types, order, visit order) equal abi.py's."""
    generated = tmp_path / "generated"
    _header(generated)
    source = tmp_path / "probe.cc"
    source.write_text(_probe_program())
    exe = tmp_path / "probe"
    proc = subprocess.run([CXX, *FLAGS, "-Werror", "-I", str(generated), "-I", str(FFI), str(source), "-o", str(exe)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    said = {}
    for line in lines:
        key, _, rest = line.partition(" ")
        said.setdefault(key, []).append(rest)

    assert said["limits"] == [" ".join(map(str, (abi.NUM_MAX_RANKS, abi.NUM_MAX_TOPK, abi.TOKEN_BITS,
                                                   abi.NUM_MAX_TOKENS_EXCLUSIVE, abi.ROW_BLOCK, abi.MX_BLOCK)))]
    assert said["gemm"] == [" ".join(map(str, (abi.GEMM_BLOCK_M, abi.GEMM_BLOCK_N, abi.GEMM_BLOCK_K,
                                                 abi.GEMM_WORK_WORDS)))]
    assert said["status"] == [" ".join(map(str, (abi.STATUS_CODE, abi.STATUS_RANK, abi.STATUS_PEER,
                                                   abi.STATUS_LAYER, abi.STATUS_WORDS)))]
    assert abi.STATUS_FIELDS == ("code", "rank", "peer", "layer")
    for entry in said["stride"]:
        n, s = map(int, entry.split())
        assert s == -(-n // abi.ROW_BLOCK) * abi.ROW_BLOCK, entry
    assert said["code"] == [f"{e.name} {e.code}" for e in abi.ERRORS]
    assert said["describe"] == [abi.describe_error(r) for r in RECORDS]
    for kernel in abi.KERNELS.values():
        assert f"{kernel.op} {len(kernel.params)} {kernel.symbol}" in said["params"]
        fields = [f.split()[1:] for f in said["field"] if f.split()[0] == kernel.op]
        assert [f[0] for f in fields] == list(kernel.names())
        sizes = {"i64": 8, "i32": 4, "f32": 4}
        assert [(int(f[2]), f[3] == "1") for f in fields] == [(sizes[p.ctype], p.ctype == "f32") for p in kernel.params]
        offsets = [int(f[1]) for f in fields]
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets), fields
        visits = [v.split()[1:] for v in said["visit"] if v.split()[0] == kernel.op]
        assert visits == [[str(i + 1), str(int(p.address))] for i, p in enumerate(kernel.params)]


def test_installed_header_is_current():
    """The ep_abi.h installed next to the cubins (the build's) is what abi.py generates now."""
    from jax_latent_ep.runtime import artifacts

    try:
        path = artifacts.find("ep_abi.h")
    except FileNotFoundError as error:
        pytest.skip(f"no installed ep_abi.h: {error}")
    assert path.read_text() == abi.header(), f"{path} is stale: rebuild (pip install .)"
