"""The harness's CUDA side on `cuda.bindings.driver` (no JAX): the kernels from the build manifest, device and
host-mapped arrays, one `Rank` per rank (its context, stream, symmetric buffer, peer table, inputs and outputs)
and the `System` of N ranks with its launch rules."""

from __future__ import annotations

import ctypes
import json
import os
import pathlib

import numpy as np

from jax_latent_ep.kernels import abi
from jax_latent_ep.layout import TRACE, TRACE_LAYERS, EpLayout, stride
from jax_latent_ep.runtime.artifacts import ENV_VAR
from jax_latent_ep.shapes import SHAPES

#: The cubins the harness loads: `JAX_LATENT_EP_ARTIFACTS` where set (as for the library, `runtime.artifacts`),
#: else the source tree's build.
DEFAULT_ARTIFACTS = pathlib.Path(os.environ.get(ENV_VAR) or
                                 pathlib.Path(__file__).resolve().parents[2] / "jax_latent_ep" / "_artifacts")

#: The kernels' parameters in launch order: the ABI's (`kernels/abi.py`), never listed here again.
DISPATCH_PARAMS = abi.DISPATCH.names()
COMBINE_PARAMS = abi.COMBINE.names()
#: The launch's own addresses (peer table, status record): every other address parameter is a `Rank` array of
#: the same name, which a launch may replace by a raw address (`System.launch_dispatch(**pointers)`).
_LAUNCH_ADDRESSES = ("peers", "status")


def buffer_params(kernel: abi.Kernel) -> tuple[str, ...]:
    """The address parameters of `kernel` that name a rank's input or output array, in ABI order."""
    return tuple(p.name for p in kernel.params if p.address and p.name not in _LAUNCH_ADDRESSES)


def _cu():
    from cuda.bindings import driver

    return driver


def check(result):
    """Unwraps a cuda.bindings (err, *values) result; raises RuntimeError naming the error."""
    cu = _cu()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise RuntimeError(f"CUDA error {int(err)} ({name.decode() if isinstance(name, bytes) else name})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# ---------------------------------------------------------------------------------------------------------
# Kernels from the manifest


class Manifest:
    def __init__(self, artifacts=DEFAULT_ARTIFACTS):
        self.dir = pathlib.Path(artifacts)
        path = self.dir / "manifest.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run python -m jax_latent_ep.runtime.build")
        self.entries = json.loads(path.read_text())["entries"]

    def entry(self, kernel, shape_name, ranks, arch):
        for e in self.entries:
            if (e["kernel"], e["shape"]["name"], e["ranks"], e["arch"]) == (kernel, shape_name, ranks, arch):
                return e
        raise KeyError(f"no {kernel} cubin for {shape_name} n{ranks} {arch} in {self.dir}")


_CTYPES = {"i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float}


class Kernel:
    """One cubin loaded into the current context; its parameters are the ABI's (a manifest that records others
    is refused: the cubin was built against another ABI)."""

    def __init__(self, manifest: Manifest, entry: dict):
        self.entry = entry
        self.abi = abi.KERNELS[entry["kernel"]]
        recorded = tuple((n, t) for n, t in entry["params"])
        if recorded != self.abi.signature():
            raise ValueError(f"{entry['file']}: parameters {list(recorded)} differ from kernels/abi.py's "
                             f"{list(self.abi.signature())}: rebuild (python -m jax_latent_ep.runtime.build)")
        cu = _cu()
        data = (manifest.dir / entry["file"]).read_bytes()
        self.module = check(cu.cuModuleLoadData(data))
        self.function = check(cu.cuModuleGetFunction(self.module, entry["name"].encode()))
        self.names = self.abi.names()
        self.types = tuple(_CTYPES[p.ctype] for p in self.abi.params)

    def occupancy(self) -> int:
        cu = _cu()
        return check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, self.entry["block"], self.entry["smem"]))

    def launch(self, stream, grid, pdl=True, **args):
        cu = _cu()
        if set(args) != set(self.names):
            raise ValueError(f"arguments {sorted(args)} != {sorted(self.names)}")
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = int(grid), 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = self.entry["block"], 1, 1
        config.sharedMemBytes = self.entry["smem"]
        config.hStream = stream
        if pdl:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config.attrs = [attr]
            config.numAttrs = 1
        else:
            config.numAttrs = 0
        values = tuple(args[n] for n in self.names)
        check(cu.cuLaunchKernelEx(config, self.function, (values, self.types), 0))


#: A one-thread kernel that spins until `ns` nanoseconds of `%globaltimer` have passed (PTX, JIT-compiled by the
#: driver): `latency(delay_ns=...)` puts it before one rank's dispatch, to make that rank the late one.
_SPIN_PTX = b"""
.version 7.8
.target sm_90
.address_size 64
.visible .entry spin_ns(.param .u64 ns)
{
  .reg .u64 %t0, %t1, %d, %n;
  .reg .pred %p;
  ld.param.u64 %n, [ns];
  mov.u64 %t0, %globaltimer;
SPIN:
  mov.u64 %t1, %globaltimer;
  sub.u64 %d, %t1, %t0;
  setp.lt.u64 %p, %d, %n;
  @%p bra SPIN;
  ret;
}
\0"""


class SpinKernel:
    """`_SPIN_PTX` loaded into the current context."""

    def __init__(self):
        cu = _cu()
        self.module = check(cu.cuModuleLoadData(_SPIN_PTX))
        self.function = check(cu.cuModuleGetFunction(self.module, b"spin_ns"))

    def launch(self, stream, ns):
        cu = _cu()
        check(cu.cuLaunchKernel(self.function, 1, 1, 1, 1, 1, 1, 0, stream, ((int(ns),), (ctypes.c_uint64,)), 0))


# ---------------------------------------------------------------------------------------------------------
# Arrays


class DeviceArray:
    def __init__(self, nbytes):
        cu = _cu()
        self.nbytes = max(int(nbytes), 16)
        self.ptr = int(check(cu.cuMemAlloc(self.nbytes)))

    def upload(self, array):
        cu = _cu()
        array = np.ascontiguousarray(array)
        assert array.nbytes <= self.nbytes, (array.nbytes, self.nbytes)
        check(cu.cuMemcpyHtoD(self.ptr, array.ctypes.data, array.nbytes))

    def download(self, dtype, shape):
        cu = _cu()
        out = np.empty(shape, dtype)
        check(cu.cuMemcpyDtoH(out.ctypes.data, self.ptr, out.nbytes))
        return out


class HostMappedArray(DeviceArray):
    """Pinned host memory mapped into every context (`cuMemHostAlloc` DEVICEMAP | PORTABLE): kernels reach it at
    `ptr` (unified addressing); the CPU reads and writes it directly, also after a GPU context was lost."""

    def __init__(self, nbytes):
        cu = _cu()
        self.nbytes = max(int(nbytes), 16)
        self.host = int(check(cu.cuMemHostAlloc(self.nbytes, cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE)))
        self.ptr = int(check(cu.cuMemHostGetDevicePointer(self.host, 0)))
        ctypes.memset(self.host, 0, self.nbytes)

    def upload(self, array, offset=0):
        array = np.ascontiguousarray(array)
        assert offset + array.nbytes <= self.nbytes, (offset, array.nbytes, self.nbytes)
        ctypes.memmove(self.host + offset, array.ctypes.data, array.nbytes)

    def download(self, dtype, shape, offset=0):
        out = np.empty(shape, dtype)
        ctypes.memmove(out.ctypes.data, self.host + offset, out.nbytes)
        return out


class HostMappedView(DeviceArray):
    """A window of a `HostMappedArray` (no memory of its own)."""

    def __init__(self, array: HostMappedArray, offset, nbytes):
        self.array, self.offset = array, int(offset)
        self.ptr, self.nbytes = array.ptr + self.offset, int(nbytes)

    def upload(self, values):
        self.array.upload(values, self.offset)


class DeviceView(DeviceArray):
    """A window `[ptr, ptr + nbytes)` of another allocation (no memory of its own)."""

    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = int(ptr), int(nbytes)


def host_status(cu):
    """A zeroed, mapped, portable host record for the kernels' `status` argument (`fail` writes the ABI's
    `STATUS_FIELDS` there before it traps): `(device address, ctypes view)`."""
    words = abi.STATUS_WORDS
    host = check(cu.cuMemHostAlloc(4 * words, cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE))
    record = (ctypes.c_int32 * words).from_address(int(host))
    for i in range(words):
        record[i] = 0
    return int(check(cu.cuMemHostGetDevicePointer(host, 0))), record


def device_name():
    cu = _cu()
    check(cu.cuInit(0))
    name = check(cu.cuDeviceGetName(64, check(cu.cuDeviceGet(0))))
    return name.split(b"\0")[0].decode().replace(",", " ")


# ---------------------------------------------------------------------------------------------------------
# Ranks


class Rank:
    """One rank: its context, stream, symmetric buffer, peer table, inputs and outputs (each array attribute is
    named after the kernel parameter it is passed as, `buffer_params`)."""

    def __init__(self, rank, ctx, layout: EpLayout, kernels, host_buffer=False):
        cu = _cu()
        self.rank, self.ctx, self.layout = rank, ctx, layout
        check(cu.cuCtxSetCurrent(ctx))
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self.dispatch, self.combine = kernels
        shape, n, tmax = layout.shape, layout.ranks, layout.tokens
        rows, latent, topk = layout.rows, shape.latent, shape.topk
        if host_buffer:  # the symmetric buffer in mapped host memory: readable after the context is lost
            self.buffer = HostMappedArray(layout.bytes)
            self.peers = HostMappedView(self.buffer, layout.peers, 8 * (n + 1))
        else:
            self.buffer = DeviceArray(layout.bytes)
            self.peers = DeviceView(self.buffer.ptr + layout.peers, 8 * (n + 1))  # the layout's local peer table
        self.x = DeviceArray(tmax * latent * 2)
        self.ids = DeviceArray(tmax * topk * 4)
        self.weights = DeviceArray(tmax * topk * 4)
        self.recv_x = DeviceArray(rows * latent)
        self.recv_sf = DeviceArray(rows * shape.num_sf)
        self.recv_ids = DeviceArray(rows * topk * 4)
        self.recv_weights = DeviceArray(rows * topk * 4)
        self.recv_src = DeviceArray(rows * 4)
        self.out = DeviceArray(rows * latent * 2)
        self.result = DeviceArray(tmax * latent * 2)
        self.norm_weight = self.norm = DeviceArray(latent * 2)
        self.arm()

    def arm(self):
        """Zero the buffer but its peer table: the protocol's initial state, as `SymmetricBuffers` leaves it
        (its `_arm` zeroes the whole buffer before the table is written; here the table stays for a re-arm)."""
        cu = _cu()
        lay = self.layout
        check(cu.cuCtxSetCurrent(self.ctx))
        if isinstance(self.buffer, HostMappedArray):
            check(cu.cuCtxSynchronize())  # no kernel still writes it
            ctypes.memset(self.buffer.host, 0, lay.peers)
        else:
            check(cu.cuMemsetD8(self.buffer.ptr, 0, lay.peers))
            check(cu.cuCtxSynchronize())

    def trace(self):
        """The kernel trace of a trace build (`kernels.common.TRACE`): `(timer_ns, cycles)`, each int64
        `[TRACE_LAYERS, 16]`, one row per layer of the ring (stamp meanings: `modes.latency.TRACE_STAMPS`)."""
        cu = _cu()
        check(cu.cuCtxSetCurrent(self.ctx))
        raw = np.empty((TRACE_LAYERS, 2, 16), np.int64)
        check(cu.cuMemcpyDtoH(raw.ctypes.data, self.buffer.ptr + self.layout.ctrl + TRACE, raw.nbytes))
        return raw[:, 0], raw[:, 1]

    def ctrl_words(self):
        cu = _cu()
        check(cu.cuCtxSetCurrent(self.ctx))
        out = np.empty(8, np.int32)
        check(cu.cuMemcpyDtoH(out.ctypes.data, self.buffer.ptr + self.layout.ctrl, 32))
        return out


def launch_grid(tokens, peer_tokens, ranks, cap):
    """CTAs of one launch: `min(cap, max(T, N * stride(peer_tokens)))` (below T where T > cap: the kernels loop
    over their tokens).

    The FFI's rule (`backends.nvlink.default_grids` lowered to the co-residency bound) is the same formula with
    the bound and `DISPATCH_MIN_CTAS = COMBINE_MIN_CTAS = 256` both at `cap` and `peer_tokens = T`; the harness
    caps at its residency bound (`System.cap`, or `--grid-cap`) instead, so that its latency and stress runs may
    try grids beyond 256, and follows `peer_tokens` because its ranks may each draw their own T."""
    return min(cap, max(tokens, ranks * stride(peer_tokens)))


class System:
    """N ranks on one GPU (virtual) or on N GPUs, with their kernels loaded."""

    def __init__(self, shape_name, ranks, max_tokens, mode, artifacts=DEFAULT_ARTIFACTS, arch="sm_90a", host_ranks=()):
        cu = _cu()
        check(cu.cuInit(0))
        self.cu = cu
        self.shape_name, self.shape = shape_name, SHAPES[shape_name]
        self.n, self.mode = ranks, mode
        manifest = Manifest(artifacts)
        entries = [manifest.entry(k, shape_name, ranks, arch) for k in ("dispatch", "combine")]
        devices = check(cu.cuDeviceGetCount())
        if mode == "devices" and devices < ranks:
            raise RuntimeError(f"{ranks} ranks on devices need {ranks} GPUs, found {devices}")
        ordinals = list(range(ranks)) if mode == "devices" else [0] * ranks
        self.ctxs = {}
        for o in sorted(set(ordinals)):
            dev = check(cu.cuDeviceGet(o))
            self.ctxs[o] = check(cu.cuDevicePrimaryCtxRetain(dev))
        if mode == "devices":
            for a in self.ctxs:
                check(cu.cuCtxSetCurrent(self.ctxs[a]))
                for b in self.ctxs:
                    if a != b:
                        err = cu.cuCtxEnablePeerAccess(self.ctxs[b], 0)[0]
                        if err not in (cu.CUresult.CUDA_SUCCESS, cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                            check((err,))
        kernels = {}
        for o, ctx in self.ctxs.items():
            check(cu.cuCtxSetCurrent(ctx))
            kernels[o] = (Kernel(manifest, entries[0]), Kernel(manifest, entries[1]))
        check(cu.cuCtxSetCurrent(self.ctxs[ordinals[0]]))
        sms = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, check(cu.cuDeviceGet(0))))
        resident = min(k.occupancy() for k in kernels[ordinals[0]]) * sms
        per_device_ranks = ranks if mode == "virtual" else 1
        # Every CTA of every rank on a GPU may spin at once: keep them all resident. The grids stop there, T does
        # not (a CTA takes the tokens c, c + G, ...).
        self.cap = max(1, resident // (2 * per_device_ranks))
        self.max_tokens = max_tokens
        #: Most CTAs of one launch (`launch_grid`).
        self.grid_cap = self.cap
        self.layout = EpLayout(ranks, max_tokens, self.shape)
        self.ranks = [Rank(r, self.ctxs[ordinals[r]], self.layout, kernels[ordinals[r]], r in host_ranks)
                      for r in range(ranks)]
        for r in self.ranks:
            table = np.array([p.buffer.ptr for p in self.ranks] + [r.buffer.ptr], np.int64)
            check(cu.cuCtxSetCurrent(r.ctx))
            r.peers.upload(table)
        self.status = 0
        self.timeout_ns = 0

    def sync(self):
        for r in self.ranks:
            check(self.cu.cuCtxSetCurrent(r.ctx))
            check(self.cu.cuStreamSynchronize(r.stream))

    def launch_dispatch(self, r: Rank, tokens, timeout_ns=None, peer_tokens=None, **pointers):
        """Launches rank `r`'s dispatch of `tokens` tokens on its stream. `peer_tokens`: the largest T of any rank
        in this call (every rank must pass the same; None: `tokens`, every rank sends as many). `pointers` (raw
        device addresses, by parameter name: `buffer_params(abi.DISPATCH)`) replace the rank's own arrays."""
        check(self.cu.cuCtxSetCurrent(r.ctx))
        peer_tokens = tokens if peer_tokens is None else peer_tokens
        args = _buffers(r, abi.DISPATCH, pointers)
        r.dispatch.launch(
            r.stream, launch_grid(tokens, peer_tokens, self.n, self.grid_cap), peers=r.peers.ptr, status=self.status,
            timeout_ns=self.timeout_ns if timeout_ns is None else timeout_ns,
            rank=r.rank, tokens=tokens, peer_tokens=peer_tokens, max_tokens=self.max_tokens, **args,
        )

    def launch_combine(self, r: Rank, tokens, apply_norm, eps=1e-6, peer_tokens=None, **pointers):
        """Launches rank `r`'s combine of `tokens` tokens on its stream; `peer_tokens` as its dispatch's. `pointers`
        (raw device addresses, by parameter name: `buffer_params(abi.COMBINE)`) replace the rank's own arrays."""
        check(self.cu.cuCtxSetCurrent(r.ctx))
        peer_tokens = tokens if peer_tokens is None else peer_tokens
        args = _buffers(r, abi.COMBINE, pointers)
        r.combine.launch(
            r.stream, launch_grid(tokens, peer_tokens, self.n, self.grid_cap), peers=r.peers.ptr, status=self.status,
            timeout_ns=self.timeout_ns, eps=eps, rank=r.rank, tokens=tokens, peer_tokens=peer_tokens,
            max_tokens=self.max_tokens, apply_norm=apply_norm, **args,
        )


def _buffers(r: Rank, kernel: abi.Kernel, pointers):
    """The rank's arrays for `kernel`'s buffer parameters, some replaced by `pointers` (known names only: a typo
    must not pass silently)."""
    args = {name: getattr(r, name).ptr for name in buffer_params(kernel)}
    unknown = set(pointers) - set(args)
    if unknown:
        raise ValueError(f"unknown pointer arguments {sorted(unknown)}; expected some of {sorted(args)}")
    args.update({k: int(v) for k, v in pointers.items()})
    return args
