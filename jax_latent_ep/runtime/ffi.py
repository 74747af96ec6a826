"""The FFI library: loading, target registration, the rank registry and the two jax-level calls.

`libjax_latent_ep_ffi.so` (built from ffi/, `docs/architecture.md`) holds the XLA FFI handlers `EpDispatch` / `EpCombine`
and plain C functions that fill its rank registry (keyed by backend instance and CUDA device ordinal). The
handlers find their rank's peer table, rank, status record and loaded kernels there, so every device of an
SPMD program runs the same custom call with the same attributes.

Two sets of targets reach the same kernels (docs/kernel_abi.md, "Launch path"):
  * traced (`jax_latent_ep_dispatch` / `_combine`): the handler launches on XLA's stream; inside an XLA
    command buffer XLA captures it into a child graph and re-captures it when a buffer address changes.
  * record (`jax_latent_ep_dispatch_rec` / `_combine_rec`): handlers for the FFI RECORD stage too, which
    add a plain kernel node to the command buffer and later only update its parameters. Registered by the
    library itself (jax's registration drops record handlers); used by default once registered.
`launch_path()` says which one a call traced now uses; `JAX_LATENT_EP_FFI_RECORD=0` picks the traced targets,
`JAX_LATENT_EP_PDL=0` turns programmatic dependent launch off on the record targets.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jax_latent_ep import backends
from jax_latent_ep.kernels import abi
from jax_latent_ep.runtime import artifacts

DISPATCH_TARGET = "jax_latent_ep_dispatch"
COMBINE_TARGET = "jax_latent_ep_combine"
#: The record-capable targets (execute + RECORD stage), registered by `ep_register_record_targets`.
DISPATCH_RECORD_TARGET = "jax_latent_ep_dispatch_rec"
COMBINE_RECORD_TARGET = "jax_latent_ep_combine_rec"

#: "0" (read when a call is traced): use the traced targets even where the record targets are registered.
RECORD_ENV = "JAX_LATENT_EP_FFI_RECORD"
#: "0" (read when a call is traced): the record targets' `uses_pdl` attribute is False (no programmatic
#: dependent launch for their kernel nodes and launches). The traced targets always allow it.
PDL_ENV = "JAX_LATENT_EP_PDL"

_lock = threading.Lock()


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded FFI library (found through `jax_latent_ep.runtime.artifacts`), its C signatures declared."""
    path = artifacts.find(artifacts.FFI_LIBRARY)
    lib = ctypes.CDLL(str(path))
    lib.ep_last_error.restype = ctypes.c_char_p
    lib.ep_last_error.argtypes = []
    lib.ep_register_rank.restype = ctypes.c_int
    lib.ep_register_rank.argtypes = [
        ctypes.c_int64,  # instance
        ctypes.c_int,  # ordinal
        ctypes.c_int,  # rank
        ctypes.c_int,  # ranks
        ctypes.c_int,  # max_tokens
        ctypes.c_int,  # latent
        ctypes.c_int,  # topk
        ctypes.c_uint64,  # peers (device int64 [N + 1])
        ctypes.c_uint64,  # status (device address of the host-mapped record)
        ctypes.c_void_p,  # status (host address)
        ctypes.c_int64,  # timeout_ns
        ctypes.c_char_p,  # dispatch cubin
        ctypes.c_size_t,
        ctypes.c_char_p,  # dispatch kernel name
        ctypes.c_int,  # dispatch block
        ctypes.c_int,  # dispatch smem
        ctypes.c_char_p,  # combine cubin
        ctypes.c_size_t,
        ctypes.c_char_p,  # combine kernel name
        ctypes.c_int,  # combine block
        ctypes.c_int,  # combine smem
    ]
    lib.ep_unregister_rank.restype = ctypes.c_int
    lib.ep_unregister_rank.argtypes = [ctypes.c_int64, ctypes.c_int]
    lib.ep_max_grid.restype = ctypes.c_int64
    lib.ep_max_grid.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.ep_registered_count.restype = ctypes.c_int
    lib.ep_registered_count.argtypes = []
    if hasattr(lib, "ep_register_kernel"):  # absent from libraries built before the grouped GEMM
        lib.ep_register_kernel.restype = ctypes.c_int
        lib.ep_register_kernel.argtypes = [
            ctypes.c_char_p,  # op (kernels/abi.py)
            ctypes.c_int,  # ordinal
            ctypes.c_char_p,  # cubin
            ctypes.c_size_t,
            ctypes.c_char_p,  # kernel name
            ctypes.c_int,  # block
            ctypes.c_int,  # smem
        ]
    if hasattr(lib, "ep_register_record_targets"):  # absent from libraries built before the record targets
        lib.ep_register_record_targets.restype = ctypes.c_int
        lib.ep_register_record_targets.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        lib.ep_record_counts.restype = ctypes.c_int
        lib.ep_record_counts.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    if hasattr(lib, "ep_register_expert_record_targets"):  # absent from libraries built before them
        lib.ep_register_expert_record_targets.restype = ctypes.c_int
        lib.ep_register_expert_record_targets.argtypes = [ctypes.POINTER(ctypes.c_char_p)] * 2 + [ctypes.c_int]
    return lib


_registered = False
#: Why the record targets are not registered (None once they are).
_record_error: str | None = "not registered yet (register_targets was not called)"
_record_final = False  # registered, or failed for good (no record stage in this library or this jaxlib)
_RECORD_RETRY = 2  # ep_register_record_targets: no XLA FFI API seen yet (the CUDA backend was not initialized)



def register_targets() -> None:
    """Registers the FFI targets for the CUDA platform (once per process): the traced ones with JAX, then the
    record ones through the library (`record_error()` says why not, if it could not)."""
    global _registered, _record_error, _record_final
    with _lock:
        lib = library()
        if not _registered:
            # JAX registers at once if its CUDA backend is initialized (else when it is); XLA then queries the
            # handler's metadata, which shows the library the plugin's XLA FFI API (for the record targets).
            jax.ffi.register_ffi_target(DISPATCH_TARGET, jax.ffi.pycapsule(lib.EpDispatch), platform="CUDA")
            jax.ffi.register_ffi_target(COMBINE_TARGET, jax.ffi.pycapsule(lib.EpCombine), platform="CUDA")
            _registered = True
        if not _record_final:
            _record_error, _record_final = _register_record(
                lib, "ep_register_record_targets", (DISPATCH_RECORD_TARGET.encode(), COMBINE_RECORD_TARGET.encode()),
                "register_targets")


def _register_record(lib, symbol: str, args: tuple, caller: str) -> tuple[str | None, bool]:
    """Registers record targets through the library's `symbol(*args)`: `(why not, or None; whether that is final)`.
    Not final under the kill switch (a later call may register them) and while no XLA FFI API was seen (rc 2:
    no CUDA backend yet; NvlinkBackend and load_expert_kernels call again once their devices exist)."""
    if not _record_wanted():
        return f"not registered: {RECORD_ENV}=0 when {caller} ran", False
    if not hasattr(lib, symbol):
        return "record stage not available: this FFI library predates it (rebuild it)", True
    rc = getattr(lib, symbol)(*args)
    return (None if rc == 0 else (lib.ep_last_error().decode() or f"error {rc}")), rc != _RECORD_RETRY


def record_error() -> str | None:
    """Why the record targets are not registered in this process (None once they are)."""
    return _record_error


def _record_wanted() -> bool:
    return os.environ.get(RECORD_ENV, "1").strip() != "0"


def _pdl_wanted() -> bool:
    return os.environ.get(PDL_ENV, "1").strip() != "0"


def launch_path() -> str:
    """How a dispatch / combine traced now reaches its kernel: "record" (the record targets: a kernel node in
    XLA command buffers) or "traced" (the traced targets: a stream capture in command buffers), the latter
    when `JAX_LATENT_EP_FFI_RECORD=0` or the record targets are not registered (`record_error()`). Both launch
    on the stream outside command buffers. The choice is baked into the HLO at trace time: an executable keeps
    its path when the environment changes later."""
    return "record" if _record_wanted() and _record_error is None else "traced"


def _target(kind: str) -> tuple[str, dict]:
    """The target name and the extra attributes of a `kind` ("dispatch" / "combine") call traced now."""
    if launch_path() == "record":
        name = DISPATCH_RECORD_TARGET if kind == "dispatch" else COMBINE_RECORD_TARGET
        # XLA reads `uses_pdl` too: only with it True does the kernel node get programmatic edges.
        return name, {"uses_pdl": _pdl_wanted()}
    return (DISPATCH_TARGET if kind == "dispatch" else COMBINE_TARGET), {}


def record_counts() -> tuple[int, int]:
    """(creates, updates): how often the record handlers added or updated a kernel node in this process."""
    lib = library()
    if not hasattr(lib, "ep_record_counts"):
        return 0, 0
    creates, updates = ctypes.c_int64(0), ctypes.c_int64(0)
    lib.ep_record_counts(ctypes.byref(creates), ctypes.byref(updates))
    return creates.value, updates.value


def gpu_arch(device) -> str:
    """The cubin architecture ("sm_90a" / "sm_100a") of a CUDA `device`; ValueError for any other capability."""
    cc = str(getattr(device, "compute_capability", ""))
    arch = backends.NVLINK_CAPABILITIES.get(cc)
    if arch is None:
        raise ValueError(f"the NVLink backend has kernels for sm_90a and sm_100a only; {device} has compute "
                         f"capability {cc or 'unknown'}")
    return arch


class KernelImage:
    """One compiled kernel: cubin bytes, symbol name, block and dynamic shared memory (from the manifest)."""

    def __init__(self, cubin: bytes, name: str, block: int, smem: int, path: str = ""):
        self.cubin, self.name, self.block, self.smem, self.path = cubin, name, int(block), int(smem), path

    def __repr__(self):
        return f"KernelImage({self.name!r}, block={self.block}, smem={self.smem}, {len(self.cubin)} bytes, {self.path})"


def _variants(manifest: dict) -> list[dict]:
    variants = manifest.get("entries", manifest.get("variants", []))
    if isinstance(variants, dict):
        variants = [dict(v, key=k) for k, v in variants.items()]
    return list(variants)


def _field(v: dict, *names, default=None):
    for name in names:
        if name in v:
            return v[name]
        shape = v.get("shape")
        if isinstance(shape, dict) and name in shape:
            return shape[name]
    return default


def find_kernel(kernel: str, ranks: int, shape, arch: str, *, compile: bool = True) -> KernelImage:
    """The compiled `kernel` ('dispatch' or 'combine') for `ranks`, `shape` and `arch`, looked up in order:
    the installed manifest's variants, then the per-user kernel cache (`runtime/kernel_cache.py`), then (with
    `compile` and nvidia-cutlass-dsl importable) compiled on demand into that cache, with a progress line.

    Raises:
      LookupError: no such variant anywhere and it cannot be compiled here (the message lists what the
        manifest has, names the variant and the command that installs the compiler), or the manifest's
        parameter list differs from this library's.
    """
    from jax_latent_ep.runtime import kernel_cache

    try:
        directory, manifest = artifacts.manifest()
    except FileNotFoundError as error:  # no installed manifest: the cache may still serve
        directory, manifest, listing = None, {}, f"no installed manifest: {error}"
    else:
        listing = None
    want = {"kernel": kernel, "ranks": ranks, "latent": shape.latent, "experts": shape.experts,
            "topk": shape.topk, "arch": arch}
    have = []
    for v in _variants(manifest):
        got = {
            "kernel": _field(v, "kernel"),
            "ranks": _field(v, "ranks", "N"),
            "latent": _field(v, "latent", "L"),
            "experts": _field(v, "experts", "E"),
            "topk": _field(v, "topk", "K"),
            "arch": _field(v, "arch"),
        }
        have.append(got)
        if got == want:
            return _image(kernel, v, directory)
    listing = listing or f"{directory}/manifest.json has {_listing(have, kernel)}"
    try:
        cached = (kernel_cache.ensure(shape, ranks, arch) if compile
                  else kernel_cache.lookup(shape, ranks, arch))
        if cached is None:
            raise LookupError(kernel_cache.missing_message(shape, ranks, arch, "compile=False"))
    except LookupError as error:
        raise LookupError(f"no compiled {kernel} kernel for N={ranks}, shape={shape}, arch={arch} ({listing}); "
                          f"{error}") from None
    return _image(kernel, kernel_cache.entries(cached)[kernel], cached)


def _image(kernel: str, v: dict, directory) -> KernelImage:
    """The KernelImage of manifest entry `v` (its cubin relative to `directory`), its parameter list checked."""
    params = v.get("params")
    expected = abi.KERNELS[kernel].signature()
    if params is not None and tuple(tuple(p) for p in params) != expected:
        raise LookupError(
            f"the manifest's {kernel} kernel takes {params}, but this FFI library passes {list(expected)} "
            "(kernels/abi.py): rebuild the artifacts and the library from one source tree"
        )
    cubin_path = pathlib.Path(directory) / _field(v, "cubin", "path", "file")
    return KernelImage(
        cubin_path.read_bytes(),
        _field(v, "name", "symbol"),
        _field(v, "block", "threads"),
        _field(v, "smem", "shared_bytes", default=0),
        str(cubin_path),
    )


def _listing(have, kernel: str) -> str:
    """What a manifest holds of `kernel`, one entry per shape and arch with its rank counts: "L=3584 E=896 K=16
    sm_90a at N=1,2,4; ..." (or "nothing")."""
    by = {}
    for h in have:
        if h["kernel"] == kernel:
            by.setdefault((h["latent"], h["experts"], h["topk"], h["arch"]), set()).add(h["ranks"])
    return "; ".join(
        f"L={lat} E={e} K={k} {arch} at N={','.join(str(n) for n in sorted(ns))}"
        for (lat, e, k, arch), ns in sorted(by.items())
    ) or "nothing"


def register_rank(instance: int, ordinal: int, rank: int, ranks: int, max_tokens: int, shape, peers: int,
                  status_device: int, status_host: int, timeout_ns: int, dispatch: KernelImage,
                  combine: KernelImage) -> None:
    """Fills the C++ registry for (instance, ordinal) and loads the kernels on that device (not in capture)."""
    lib = library()
    rc = lib.ep_register_rank(
        instance, ordinal, rank, ranks, max_tokens, shape.latent, shape.topk, peers, status_device,
        status_host, timeout_ns,
        dispatch.cubin, len(dispatch.cubin), dispatch.name.encode(), dispatch.block, dispatch.smem,
        combine.cubin, len(combine.cubin), combine.name.encode(), combine.block, combine.smem,
    )
    if rc != 0:
        raise RuntimeError(f"jax_latent_ep: registering rank {rank} on device {ordinal} failed: "
                           f"{lib.ep_last_error().decode()}")


def max_grids(instance: int, ordinal: int) -> tuple[int, int]:
    """(dispatch, combine) co-residency bounds of a registered rank: the largest grid of one launch."""
    lib = library()
    return int(lib.ep_max_grid(instance, ordinal, 0)), int(lib.ep_max_grid(instance, ordinal, 1))


def unregister_rank(instance: int, ordinal: int) -> bool:
    """Forgets (instance, ordinal) in the C++ registry; True if it was registered.

    The FFI targets stay registered with JAX (for the process), so a custom call of this instance that XLA
    still launches through the handler finds no registration and fails the execution with an FFI error
    ("jax_latent_ep dispatch: no NvlinkBackend instance <instance> is registered on device ordinal
    <ordinal> (was the backend closed, ...)") before launching a kernel. A launch replayed from a CUDA graph
    captured earlier does not run the handler and is not stopped. The loaded modules stay loaded.
    """
    return library().ep_unregister_rank(instance, ordinal) == 0


def dispatch_call(x, ids, weights, *, instance: int, rows: int, grid: int, num_sf: int):
    """The per-rank dispatch custom call: `(recv_x, recv_sf, recv_ids, recv_weights, recv_src)`."""
    latent, topk = x.shape[1], ids.shape[1]
    out_types = (
        jax.ShapeDtypeStruct((rows, latent), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((rows, num_sf), jnp.uint8),
        jax.ShapeDtypeStruct((rows, topk), jnp.int32),
        jax.ShapeDtypeStruct((rows, topk), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
    )
    target, extra = _target("dispatch")
    call = jax.ffi.ffi_call(target, out_types, has_side_effect=False)
    x, ids, weights = _opaque(x, ids, weights)
    return _opaque(*call(x, ids, weights, instance=np.int64(instance), grid=np.int64(grid), call=_call_id(), **extra))


#: Numbers the calls traced in this process (the `call` attribute).
_CALL_IDS = itertools.count(1)


def _call_id() -> np.int64:
    """A number no other dispatch / combine call of this process carries: the calls are declared free of side
    effects (`has_side_effect=False`), which keeps JAX's C++ dispatch fast path for every program that holds
    them (a JAX effect sends every execution of the program through the Python path: about 0.3 ms each,
    with jaxlib 0.11.2), and this attribute keeps XLA from merging two calls with equal operands into one.
    What a side effect would also have guaranteed, the data flow gives: a layer's combine consumes its
    dispatch's rows, the next layer's dispatch consumes the combine's result; a call whose results are never
    used is dropped (its peers then time out waiting for it)."""
    return np.int64(next(_CALL_IDS))


def _opaque(*operands):
    """The operands (or results) behind an optimization barrier (no copy, no kernel): XLA's dynamic-slice fusion
    pass must see neither `slice -> custom-call` nor `custom-call -> dynamic-update-slice` through them. It wraps
    such a custom call into a fusion of its own and may keep the original too: the kernel then runs twice per
    call (measured with jaxlib 0.11.2 on H200: ids / weights of a layer sliced from a larger array, "dispatch
    called twice"; and under `jax.grad` of a `lax.scan` over layers, a combine whose result is also stacked into
    the scan's residuals, "combine called without its dispatch"). So both calls take their operands and give
    their results through it."""
    return jax.lax.optimization_barrier(operands)


def combine_call(out, ids, norm_weight, *, instance: int, grid: int, eps: float, apply_norm: bool):
    """The per-rank combine custom call: bf16 `[T, L]`."""
    out_type = jax.ShapeDtypeStruct((ids.shape[0], out.shape[1]), jnp.bfloat16)
    target, extra = _target("combine")
    call = jax.ffi.ffi_call(target, out_type, has_side_effect=False)
    out, ids, norm_weight = _opaque(out, ids, norm_weight)
    return _opaque(call(out, ids, norm_weight, instance=np.int64(instance), grid=np.int64(grid),
                        eps=np.float32(eps), apply_norm=np.int64(1 if apply_norm else 0), call=_call_id(),
                        **extra))[0]


# ---------------------------------------------------------------------------------------------------------
# The expert stage's kernels (`kernels/grouped_gemm.py`, `kernels/expert_plan.py`, `kernels/row_sum.py`): one cubin
# each for every shape, no rank.

#: op -> (FFI target name, exported handler symbol).
EXPERT_TARGETS = {"grouped_gemm": ("jax_latent_ep_grouped_gemm", "EpGroupedGemm"),
                  "expert_plan": ("jax_latent_ep_expert_plan", "EpExpertPlan"),
                  "expert_stage": ("jax_latent_ep_expert_stage", "EpExpertStage"),
                  "row_sum": ("jax_latent_ep_row_sum", "EpRowSum"),
                  "grouped_matmul": ("jax_latent_ep_grouped_matmul", "EpGroupedMatmul"),
                  "grouped_matmul_wgrad": ("jax_latent_ep_grouped_matmul_wgrad", "EpGroupedMatmulWgrad"),
                  "grouped_matmul_fp8": ("jax_latent_ep_grouped_matmul_fp8", "EpGroupedMatmulFp8"),
                  "grouped_matmul_mxfp4": ("jax_latent_ep_grouped_matmul_mxfp4", "EpGroupedMatmulMxfp4"),
                  "swiglu_mxfp8": ("jax_latent_ep_swiglu_mxfp8", "EpSwigluMxfp8"),
                  "grouped_matmul_fp8_wide": ("jax_latent_ep_grouped_matmul_fp8_wide", "EpGroupedMatmulFp8Wide"),
                  "grouped_matmul_fp8_wide_glu": ("jax_latent_ep_grouped_matmul_fp8_wide_glu",
                                                  "EpGroupedMatmulFp8WideGlu"),
                  **{f"{op}_n{p}": (f"jax_latent_ep_{op}_n{p}", f"Ep{name}N{p}")
                     for op, name in (("grouped_matmul_fp8", "GroupedMatmulFp8"),
                                      ("grouped_matmul_mxfp4", "GroupedMatmulMxfp4"))
                     for p in abi.MATMUL_FP8_SMALL_TILE_PAIRS}}
GROUPED_GEMM_TARGET = EXPERT_TARGETS["grouped_gemm"][0]
#: The cubins behind them (the grouped GEMM target launches its BF16 or its FP8 kernel by the weights' dtype).
EXPERT_KERNELS = ("grouped_gemm", "grouped_gemm_fp8", "expert_plan", "expert_stage", "row_sum", "grouped_matmul",
                  "grouped_matmul_wgrad", "grouped_matmul_fp8", "grouped_matmul_mxfp4", "swiglu_mxfp8",
                  *(k.op for k in abi.NARROW_VARIANTS), "grouped_matmul_fp8_wide", "grouped_matmul_fp8_wide_glu")
EXPERT_PLAN_TARGET = EXPERT_TARGETS["expert_plan"][0]
#: op -> its record target (execute + RECORD stage: a kernel node in XLA's command buffers, updated in place; the
#: traced target is stream-captured again at every record), registered by `ep_register_expert_record_targets`.
EXPERT_RECORD_TARGETS = {op: f"jax_latent_ep_{op}_rec" for op in (
    "grouped_gemm", "expert_plan", "expert_stage", "row_sum", "grouped_matmul_fp8", "grouped_matmul_mxfp4",
    "swiglu_mxfp8", "grouped_matmul_fp8_wide", "grouped_matmul_fp8_wide_glu",
    *(k.op for k in abi.NARROW_VARIANTS))}
#: The devices the expert kernels are loaded on (None: their targets are registered).
_expert_devices: set[int | None] = set()
#: Why the expert record targets are not registered (None once they are).
_expert_record_error: str | None = "not registered yet (load_expert_kernels was not called)"
_expert_record_final = False  # registered, or failed for good (as `_record_final`)


def _register_expert_record_targets(lib) -> None:
    """Registers the expert record targets once (after the traced ones: XLA has shown the library its FFI API);
    as `register_targets` for dispatch / combine, asked again only while no XLA FFI API was seen."""
    global _expert_record_error, _expert_record_final
    if not _expert_record_final:
        n = len(EXPERT_RECORD_TARGETS)
        ops = (ctypes.c_char_p * n)(*(op.encode() for op in EXPERT_RECORD_TARGETS))
        names = (ctypes.c_char_p * n)(*(name.encode() for name in EXPERT_RECORD_TARGETS.values()))
        _expert_record_error, _expert_record_final = _register_record(
            lib, "ep_register_expert_record_targets", (ops, names, n), "load_expert_kernels")


def _expert_target(op: str) -> tuple[str, dict]:
    """The target name and extra attributes of an expert `op` call traced now (the record target where it is
    registered and `JAX_LATENT_EP_FFI_RECORD` is not 0, else the traced one)."""
    if _record_wanted() and _expert_record_error is None:
        return EXPERT_RECORD_TARGETS[op], {"uses_pdl": _pdl_wanted()}
    return EXPERT_TARGETS[op][0], {}


def expert_record_error() -> str | None:
    """Why the expert stage's calls take their traced targets (None: they take the record targets)."""
    return _expert_record_error


def find_standalone_kernel(kernel: str, arch: str) -> KernelImage:
    """The installed cubin of a shape-independent `kernel` (one of `EXPERT_KERNELS`) for `arch`.

    Raises:
      LookupError: the manifest has none (an artifact directory built before it: rebuild it).
    """
    directory, manifest = artifacts.manifest()
    for v in _variants(manifest):
        if _field(v, "kernel") == kernel and _field(v, "arch") == arch:
            return _image(kernel, v, directory)
    raise LookupError(f"no compiled {kernel} kernel for {arch} in {directory}/manifest.json (rebuild the "
                      "artifacts: python -m jax_latent_ep.runtime.build)")


def load_expert_kernels(devices) -> None:
    """Registers the expert stage's targets and loads its cubins on each CUDA device of `devices` (once per
    device, outside CUDA graph capture: call it where the program is traced)."""
    with _lock:
        lib = library()
        if not all(hasattr(lib, symbol) for _, symbol in EXPERT_TARGETS.values()):
            raise LookupError("this FFI library predates the expert stage's kernels (rebuild it)")
        if None not in _expert_devices:  # the targets once per process, even if a device's load failed before
            for target, symbol in EXPERT_TARGETS.values():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
            _expert_devices.add(None)
        _register_expert_record_targets(lib)
        for device in devices:
            if device.id in _expert_devices:
                continue
            ordinal = int(getattr(device, "local_hardware_id", device.id))
            arch = gpu_arch(device)
            for op in EXPERT_KERNELS:
                if arch not in (abi.KERNELS[op].archs or (arch,)):
                    continue  # built for other archs only (`abi.Kernel.archs`)
                image = find_standalone_kernel(op, arch)
                if lib.ep_register_kernel(op.encode(), ordinal, image.cubin, len(image.cubin), image.name.encode(),
                                          image.block, image.smem):
                    raise RuntimeError(f"jax_latent_ep: loading the {op} kernel on {device} failed: "
                                       f"{lib.ep_last_error().decode()}")
            _expert_devices.add(device.id)


def expert_plan_call(ids, weights, src, rank, *, capacity: int, num_local_experts: int, num_work: int,
                     rows_per_source: int, max_tokens: int, work_pairs: int = abi.GEMM_BLOCK_M):
    """The expert plan custom call (`kernels/abi.py` EXPERT_PLAN, whose table says what each operand holds):
    `(pair_row, pair_expert, pair_weight, group_sizes, count [1], row_pairs, work)`; `rank` int32 `[1]`; `work`'s
    items of at most `work_pairs` (one of `abi.PLAN_WORK_PAIRS`) pairs."""
    rows, k = ids.shape
    m = min(k, num_local_experts)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    out_types = (i32(capacity), i32(capacity), jax.ShapeDtypeStruct((capacity,), jnp.float32),
                 i32(num_local_experts), i32(1), i32(rows, m), i32(num_work, abi.GEMM_WORK_WORDS), i32(3, rows * k))
    target, extra = _expert_target("expert_plan")
    call = jax.ffi.ffi_call(target, out_types, has_side_effect=False)
    return call(ids, weights, src, rank, rows_per_source=np.int64(rows_per_source),
                max_tokens=np.int64(max_tokens), work_pairs=np.int64(work_pairs), **extra)[:7]


def grouped_matmul_call(x, w, tiles, *, w_k_major: bool, x_rows=None, w_up=None, residual: bool = False):
    """The grouped matmul custom call (`kernels/abi.py` GROUPED_MATMUL, whose table says what each operand holds):
    bf16 `[P, N]`, the rows of the tiles' pairs written (the others hold whatever the buffer held). `x_rows` int32
    `[P]`: the row of `x` of each pair (None: `x` has a row a pair). With `w_up` (a SwiGLU's up weight, `w` its
    gate, both `[G, K, N]`): `h = bf16(silu(gate) * up)` of the bf16 `gate` and `up`; with `residual` too,
    `(h, gate_up)`: `gate_up` bf16 `[P, 2N]`, gate's and up's blocks alternating (`split_gate_up`)."""
    if residual and w_up is None:
        raise ValueError("grouped_matmul_call: residual=True needs w_up (gate and up are a SwiGLU's)")
    if w_up is not None and (w_k_major or tuple(w_up.shape) != tuple(w.shape)):
        raise ValueError(f"grouped_matmul_call: w_up {list(w_up.shape)} must match w {list(w.shape)}, [G, K, N]")
    n = w.shape[1] if w_k_major else w.shape[2]
    pairs = x.shape[0] if x_rows is None else x_rows.shape[0]
    outs = (jax.ShapeDtypeStruct((pairs, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((pairs, 2 * n) if residual else (1, 1), jnp.bfloat16))  # [1, 1]: unwritten
    call = jax.ffi.ffi_call(EXPERT_TARGETS["grouped_matmul"][0], outs, has_side_effect=False)
    out, gate_up = call(x, tiles if x_rows is None else x_rows, w, tiles, w if w_up is None else w_up,
                        w_k_major=np.int64(bool(w_k_major)), indexed=np.int64(x_rows is not None),
                        glu=np.int64(w_up is not None), residual=np.int64(bool(residual)))
    return (out, gate_up) if residual else out


def split_gate_up(gate_up):
    """`(gate, up)` bf16 `[P, N]` each from `grouped_matmul_call`'s `gate_up` `[P, 2N]` (blocks of
    `abi.MATMUL_FORWARD_TILE_N / 2` columns alternating)."""
    p, n2 = gate_up.shape
    half = abi.MATMUL_FORWARD_TILE_N // 2
    blocks = gate_up.reshape(p, n2 // (2 * half), 2, half)
    return blocks[:, :, 0].reshape(p, n2 // 2), blocks[:, :, 1].reshape(p, n2 // 2)


def grouped_matmul_fp8_call(x, x_scale, w, w_scale, tiles, *, splits: int, k_per_split: int, x_rows=None,
                            w_second=None, w_second_scale=None, tile_pairs: int = abi.MATMUL_FP8_TILE_PAIRS):
    """The FP8 grouped matmul custom call (`kernels/abi.py` GROUPED_MATMUL_FP8, whose table says what each operand
    holds): FP32 `[splits, P, N]` partials over the contraction's `splits` slices of `k_per_split` (`[splits, P,
    2N]`, `w`'s columns then `w_second`'s, with a second weight), the rows of the tiles' pairs written (the others
    hold whatever the buffer held). `x_rows` int32 `[P]`: the row of `x` of each pair (None: `x` has a row a
    pair). `tile_pairs`: the kernel of tiles of at most that many pairs (`abi.MATMUL_FP8_TILE_PAIRS`, one of
    `abi.MATMUL_FP8_SMALL_TILE_PAIRS`, or `abi.MATMUL_FP8_WIDE_TILE_PAIRS`: prefill's), as `tiles` holds them."""
    return _narrow_call(_narrow_op("grouped_matmul_fp8", tile_pairs), x, x_scale, w, w_scale, tiles, splits,
                        k_per_split, x_rows, w_second, w_second_scale)


def grouped_matmul_mxfp4_call(x, x_scale, w, w_scale, tiles, *, splits: int, k_per_split: int, x_rows=None,
                              w_second=None, w_second_scale=None, tile_pairs: int = abi.MATMUL_FP8_TILE_PAIRS):
    """The MXFP4 grouped matmul custom call (`kernels/abi.py` GROUPED_MATMUL_MXFP4): as `grouped_matmul_fp8_call`."""
    return _narrow_call(_narrow_op("grouped_matmul_mxfp4", tile_pairs), x, x_scale, w, w_scale, tiles, splits,
                        k_per_split, x_rows, w_second, w_second_scale)


def _narrow_op(op: str, tile_pairs: int) -> str:
    """The op of `op`'s variant of `tile_pairs`-pair tiles."""
    if tile_pairs == abi.MATMUL_FP8_TILE_PAIRS:
        return op
    if tile_pairs == abi.MATMUL_FP8_WIDE_TILE_PAIRS and op == "grouped_matmul_fp8":
        return "grouped_matmul_fp8_wide"
    if tile_pairs not in abi.MATMUL_FP8_SMALL_TILE_PAIRS:
        wide = (abi.MATMUL_FP8_WIDE_TILE_PAIRS,) if op == "grouped_matmul_fp8" else ()
        raise ValueError(f"{op}: tile_pairs={tile_pairs} must be one of "
                         f"{(abi.MATMUL_FP8_TILE_PAIRS, *abi.MATMUL_FP8_SMALL_TILE_PAIRS, *wide)}")
    return f"{op}_n{tile_pairs}"


def _narrow_call(op, x, x_scale, w, w_scale, tiles, splits, k_per_split, x_rows, w_second, w_second_scale):
    two = w_second is not None
    pairs = x.shape[0] if x_rows is None else x_rows.shape[0]
    out = jax.ShapeDtypeStruct((splits, pairs, w.shape[1] * (2 if two else 1)), jnp.float32)
    unread = tiles  # an operand the kernel does not read (no row list, no second weight)
    target, extra = _expert_target(op)
    return jax.ffi.ffi_call(target, out, has_side_effect=False)(
        x, x_scale, unread if x_rows is None else x_rows, w, w_scale, unread if not two else w_second,
        unread if not two else w_second_scale, tiles, k_per_split=np.int64(k_per_split),
        indexed=np.int64(x_rows is not None), two_weights=np.int64(two), **extra)


def grouped_matmul_fp8_glu_call(x, x_scale, w, w_scale, w_up, w_up_scale, tiles, *, x_rows=None):
    """The FP8 grouped matmul of prefill sizes with the SwiGLU in its epilogue (`kernels/abi.py`
    GROUPED_MATMUL_FP8_WIDE_GLU, whose table says what each operand holds): `(q, sf)`, float8_e4m3fn `[P, I]` and
    uint8 `[P, I / 32]`, `h = bf16(silu(gate) * up)` of gate `x @ w^T` and up `x @ w_up^T` (both `[G, I, K]`,
    `[out, in]`) rounded to MXFP8: `swiglu_mxfp8_call` of `grouped_matmul_fp8_call`'s unsplit products, bit for bit.
    `tiles`: `chunks` of `abi.MATMUL_FP8_WIDE_TILE_PAIRS`; the rows of the tiles' pairs written (the others hold
    whatever the buffers held). `x_rows` int32 `[P]`: the row of `x` of each pair (None: a row a pair)."""
    if tuple(w_up.shape) != tuple(w.shape):
        raise ValueError(f"grouped_matmul_fp8_glu_call: w_up {list(w_up.shape)} must match w {list(w.shape)}")
    pairs, inter = x.shape[0] if x_rows is None else x_rows.shape[0], w.shape[1]
    outs = (jax.ShapeDtypeStruct((pairs, inter), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((pairs, inter // 32), jnp.uint8))
    target, extra = _expert_target("grouped_matmul_fp8_wide_glu")
    return tuple(jax.ffi.ffi_call(target, outs, has_side_effect=False)(
        x, x_scale, tiles if x_rows is None else x_rows, w, w_scale, w_up, w_up_scale, tiles,
        indexed=np.int64(x_rows is not None), **extra))


def swiglu_mxfp8_call(gate, up, count):
    """The SwiGLU-and-MXFP8 custom call (`kernels/abi.py` SWIGLU_MXFP8, whose table says what each operand holds):
    `(q, sf)`, float8_e4m3fn `[P, I]` and uint8 `[P, I / 32]`, for the rows below `count` (int32 `[1]`; the others
    hold whatever the buffers held). `gate` f32 `[S, P, I]` and `up` the same, or `up` None and `gate`
    `[S, P, 2I]` (fused gate-up, up in the second half of each row)."""
    s, p, n = gate.shape
    inter = n if up is not None else n // 2
    out = (jax.ShapeDtypeStruct((p, inter), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((p, inter // 32), jnp.uint8))
    target, extra = _expert_target("swiglu_mxfp8")
    return jax.ffi.ffi_call(target, out, has_side_effect=False)(
        gate, gate if up is None else up, count, fused=np.int64(up is None), **extra)


def grouped_matmul_wgrad_call(x, dy, groups):
    """The grouped matmul's weights' gradient custom call (`kernels/abi.py` GROUPED_MATMUL_WGRAD): bf16
    `[G, K, N]`, `x_g^T @ dy_g` per group of `groups` int32 `[G, 2]` (first pair, pairs)."""
    out = jax.ShapeDtypeStruct((groups.shape[0], x.shape[1], dy.shape[1]), jnp.bfloat16)
    return jax.ffi.ffi_call(EXPERT_TARGETS["grouped_matmul_wgrad"][0], out, has_side_effect=False)(x, dy, groups)


def grouped_gemm_call(a, a_rows, w, w_second, work, *, indexed: bool, fuse_glu: bool, splits: int,
                      k_per_split: int, a_scale=None, w_scale=None, w_second_scale=None):
    """The grouped GEMM custom call (`kernels/abi.py` GROUPED_GEMM, whose table says what each operand holds):
    FP32 `[splits, P, N]` partials (`[splits, P, 2N]`, gate and up interleaved by the kernel's column tile, 64 or
    with FP8 weights 128, with `w_second`), or with `fuse_glu` bf16 `[P, N]`. `a_rows` int32 `[P]` is read only
    when `indexed`; float8_e4m3fn weights take MXFP8 activations (`a` float8_e4m3fn, `a_scale` uint8) and their
    FP32 block scales `w_scale` (and `w_second_scale`)."""
    two = w_second is not None
    n = w.shape[2]
    p = a_rows.shape[0]
    if fuse_glu:
        out_type = jax.ShapeDtypeStruct((p, n), jnp.bfloat16)
    else:
        out_type = jax.ShapeDtypeStruct((splits, p, n * (2 if two else 1)), jnp.float32)
    target, extra = _expert_target("grouped_gemm")
    call = jax.ffi.ffi_call(target, out_type, has_side_effect=False)
    unread = work  # an operand the kernel does not read (no scales of BF16 weights, no second weight)
    return call(a, a_rows, unread if a_scale is None else a_scale, w, w if w_second is None else w_second,
                unread if w_scale is None else w_scale,
                unread if w_second_scale is None else w_second_scale, work, indexed=np.int64(indexed),
                two_weights=np.int64(two), fuse_glu=np.int64(fuse_glu), k_per_split=np.int64(k_per_split), **extra)


def row_sum_call(parts, row_pairs, pair_weight, count):
    """The row-sum custom call (`kernels/abi.py` ROW_SUM, whose table says what each operand holds): bf16 `[R, L]`,
    each row's weighted sum of its pairs' outputs; `parts` f32 `[S, P, L]` (summed over S in split order),
    `row_pairs` int32 `[R, M]`, `pair_weight` f32 `[P]`, `count` int32 `[1]`."""
    target, extra = _expert_target("row_sum")
    out_type = jax.ShapeDtypeStruct((row_pairs.shape[0], parts.shape[2]), jnp.bfloat16)
    return jax.ffi.ffi_call(target, out_type, has_side_effect=False)(parts, row_pairs, pair_weight, count, **extra)


def expert_stage_call(x, sf, a_rows, w_gate, w_up, w_down, work, *, k_gate: int, k_down: int):
    """The fused expert stage custom call (`kernels/abi.py` EXPERT_STAGE, whose table says what each operand holds):
    FP32 `[S2, P, L]` partials of down, `S2 = ceil(I / k_down)`. `x` float8_e4m3fn `[R, L]` and `sf` uint8
    `[R, L / 32]` the receive rows, `a_rows` int32 `[P]` the plan's row of each pair, bf16 weights `[J, L, I]`,
    `[J, L, I]`, `[J, I, L]`, `work` int32 `[W, 4]` (each item at most `abi.STAGE_DIRECT_PAIRS` pairs: the caller
    guarantees it, the kernel traps on more); `k_gate <= abi.STAGE_DIRECT_K`."""
    lat = x.shape[1]
    p = a_rows.shape[0]
    inter = w_gate.shape[2]
    s1, s2 = -(-lat // k_gate), -(-inter // k_down)
    counts = jnp.zeros((1 + work.shape[0] * (1 + inter // abi.GEMM_BLOCK_N),), jnp.int32)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    out_types = (jax.ShapeDtypeStruct(counts.shape, jnp.int32),
                 f32(s1, p, 2 * inter) if s1 > 1 else f32(1), jax.ShapeDtypeStruct((p, inter), jnp.bfloat16),
                 f32(s2, p, lat))
    target, extra = _expert_target("expert_stage")
    call = jax.ffi.ffi_call(target, out_types, has_side_effect=False, input_output_aliases={7: 0})
    return call(x, sf, a_rows, w_gate, w_up, w_down, work, counts, k_gate=np.int64(k_gate), k_down=np.int64(k_down),
                **extra)[3]
