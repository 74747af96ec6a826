"""The FFI library: loading, target registration, the rank registry and the two jax-level calls.

`libjax_latent_ep_ffi.so` (built from ffi/ep_ffi.cc) holds the XLA FFI handlers `EpDispatch` / `EpCombine`
and plain C functions that fill its rank registry (keyed by backend instance and CUDA device ordinal). The
handlers find their rank's peer table, rank, status record and loaded kernels there, so every device of an
SPMD program runs the same custom call with the same attributes.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jax_latent_ep import artifacts

DISPATCH_TARGET = "jax_latent_ep_dispatch"
COMBINE_TARGET = "jax_latent_ep_combine"

_lock = threading.Lock()


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded FFI library (found through `jax_latent_ep.artifacts`), its C signatures declared."""
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
    return lib


_registered = False

#: The parameters the handlers pass, in order (docs/kernel_abi.md); checked against the manifest's `params`.
DISPATCH_PARAMS = (
    ("x", "i64"), ("ids", "i64"), ("weights", "i64"), ("peers", "i64"), ("recv_x", "i64"), ("recv_sf", "i64"),
    ("recv_ids", "i64"), ("recv_weights", "i64"), ("recv_src", "i64"), ("status", "i64"), ("timeout_ns", "i64"),
    ("rank", "i32"), ("tokens", "i32"), ("max_tokens", "i32"),
)
COMBINE_PARAMS = (
    ("out", "i64"), ("ids", "i64"), ("norm_weight", "i64"), ("result", "i64"), ("peers", "i64"), ("status", "i64"),
    ("timeout_ns", "i64"), ("eps", "f32"), ("rank", "i32"), ("tokens", "i32"), ("max_tokens", "i32"),
    ("apply_norm", "i32"),
)


def register_targets() -> None:
    """Registers both FFI targets with JAX for the CUDA platform (once per process)."""
    global _registered
    with _lock:
        if _registered:
            return
        lib = library()
        jax.ffi.register_ffi_target(DISPATCH_TARGET, jax.ffi.pycapsule(lib.EpDispatch), platform="CUDA")
        jax.ffi.register_ffi_target(COMBINE_TARGET, jax.ffi.pycapsule(lib.EpCombine), platform="CUDA")
        _registered = True


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


def find_kernel(kernel: str, ranks: int, shape, arch: str) -> KernelImage:
    """The manifest's variant of `kernel` ('dispatch' or 'combine') for `ranks`, `shape` and `arch`.

    Raises:
      FileNotFoundError: no manifest / cubin; LookupError: no such variant (the message lists what exists).
    """
    directory, manifest = artifacts.manifest()
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
            params = v.get("params")
            expected = DISPATCH_PARAMS if kernel == "dispatch" else COMBINE_PARAMS
            if params is not None and tuple(tuple(p) for p in params) != expected:
                raise LookupError(
                    f"the manifest's {kernel} kernel takes {params}, but this FFI library passes {list(expected)} "
                    "(docs/kernel_abi.md): rebuild the artifacts and the library from one source tree"
                )
            cubin_path = pathlib.Path(directory) / _field(v, "cubin", "path", "file")
            return KernelImage(
                cubin_path.read_bytes(),
                _field(v, "name", "symbol"),
                _field(v, "block", "threads"),
                _field(v, "smem", "shared_bytes", default=0),
                str(cubin_path),
            )
    listing = "; ".join(
        f"{h['kernel']} N={h['ranks']} L={h['latent']} E={h['experts']} K={h['topk']} {h['arch']}" for h in have
    )
    raise LookupError(
        f"no compiled {kernel} kernel for N={ranks}, shape={shape}, arch={arch} in {directory}/manifest.json "
        f"(it has: {listing or 'nothing'}). Rebuild the artifacts with that variant (python -m jax_latent_ep.build)."
    )


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
    call = jax.ffi.ffi_call(DISPATCH_TARGET, out_types, has_side_effect=True)
    x, ids, weights = _opaque(x, ids, weights)
    return call(x, ids, weights, instance=np.int64(instance), grid=np.int64(grid))


def _opaque(*operands):
    """The operands behind an optimization barrier (no copy, no kernel): XLA's dynamic-slice fusion pass must
    not see `slice -> custom-call` through them. It wraps such a custom call into a fusion of its own and, the
    call having side effects, keeps the original too: the kernel then ran twice per call (measured with jaxlib
    0.11.2 on H200 whenever the ids / weights of a layer were slices of a larger array; the kernels' sequence
    guard reports it as "dispatch called twice")."""
    return jax.lax.optimization_barrier(operands)


def combine_call(out, ids, norm_weight, *, instance: int, grid: int, eps: float, apply_norm: bool):
    """The per-rank combine custom call: bf16 `[T, L]`."""
    out_type = jax.ShapeDtypeStruct((ids.shape[0], out.shape[1]), jnp.bfloat16)
    call = jax.ffi.ffi_call(COMBINE_TARGET, out_type, has_side_effect=True)
    out, ids, norm_weight = _opaque(out, ids, norm_weight)
    return call(out, ids, norm_weight, instance=np.int64(instance), grid=np.int64(grid),
                eps=np.float32(eps), apply_norm=np.int64(1 if apply_norm else 0))
