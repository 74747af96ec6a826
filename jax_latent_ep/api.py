"""`ExpertParallel`: the user-facing dispatch / combine of a latent MoE layer over one mesh axis.

    ep = ExpertParallel(mesh, "ep", max_tokens=T, shape=KIMI_K3)   # backend="auto" | "xla" | "nvlink"

    def layer(x, ids, weights, norm_weight):          # inside jax.shard_map over "ep"
        recv = ep.dispatch(x, ids, weights)           # Received, [N*S, ...] rows, source-major
        out = experts(recv)                           # bf16 [N*S, L]: routing-weighted sum of local experts
        return ep.combine(out, ids, norm_weight)      # bf16 [T, L]

Both calls are traced inside `jax.shard_map(..., mesh=mesh)` over `axis_name` (other mesh axes may be
mapped too), with the constructor's mesh: a trace-time check compares the mesh the body is traced for (its
axis names and sizes) with it. JAX gives a `shard_map` body only that abstract mesh, without device ids, so
a mesh of the same shape over the devices in another order cannot be told apart: do not do that with the
nvlink backend (its kernels number the ranks by the constructor's mesh, `lax.axis_index` by the
`shard_map`'s). Every rank makes every call, in pairs: dispatch, then combine, then the next dispatch; what the
traced program shows against that is refused at trace time on every backend (`jax_latent_ep.sequence`),
whatever other functions traced before: a layer's dispatch and combine are traced into one function.

Ids must lie in `[0, E)`, or be -1 (`NO_EXPERT`: a padded token or an unused slot, routed to no rank). With
`check_ids=True` (a debugging flag; it works under vmap, grad, scan and remat) every dispatch and combine checks
them: each rank finds its first bad id, a small `lax.all_gather` shares that, and a host `jax.pure_callback` (a
device-host round trip) raises `BadIdError` (a ValueError) on every rank at the same point, which JAX surfaces
once, where the step's result is read, as a `JaxRuntimeError` carrying its message (not logged per rank, not
raised again at exit; `ep.checked(step)` raises the `BadIdError` itself: docs/usage.md#ids-and-check_ids) naming
the first bad id, its token, its rank and the call that first received it (combine's check runs after its
dispatch's, through a data dependency on `out`, so a bad id passed to both is reported by dispatch). Without
it nothing is
checked; both backends then ignore an out-of-range id for routing (it selects no rank, in dispatch and combine
alike, is carried unchanged in the received `ids`, and is never local to a rank; the kernels compute the rank
unsigned, `kernels.common.expert_rank_bit`). Duplicate ids within a token are allowed: a token reaches a rank once,
however many of its ids live there.

Gradients: `jax.grad` through both calls (inside `jax.jit`) follows `jax_latent_ep.autodiff`: straight-through
MXFP8, the backward of dispatch a combine and of combine a dispatch, over XLA collectives on both backends; the
experts take `latent` from `ep.dispatch(..., dequantize=True)` (a gradient reaching the float8 `Received.x` is
refused).

A stuck peer (nvlink): every wait inside the kernels is bounded by `timeout_s` (a backend option, 5 s by
default); a rank whose peer never answers traps its kernel, so the computation fails with a CUDA error, and
`ep.check()` then raises RuntimeError naming the rank, the peer it waited for and the layer (`ep.status()`
gives the raw records). A dead process (multi-process meshes): the failure watcher this object arms
(docs/usage.md#a-dead-process-ends-the-job).
"""

from __future__ import annotations

import math
import numbers
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_latent_ep import autodiff, backends, host_checks, sequence
from jax_latent_ep.shapes import KIMI_K3, LatentMoEShape, check_max_tokens
from jax_latent_ep.layout import stride

BACKENDS = backends.NAMES


def _describe(a) -> str:
    return f"{jnp.dtype(a.dtype).name}{list(a.shape)}"


def _mesh_signature(mesh) -> tuple[tuple[str, int], ...]:
    """((axis name, size), ...) of a concrete or abstract mesh."""
    return tuple((str(k), int(v)) for k, v in dict(mesh.shape).items())


def _describe_mesh(sig) -> str:
    return "(" + ", ".join(f"{k!r}: {v}" for k, v in sig) + ")"


class BadIdError(host_checks.HostCheckError):
    """`check_ids=True` found an id outside `[0, E)` other than -1 ("no expert"): names the id, its token, its
    rank and the call."""


#: The id of "no expert" (a padded token or an unused slot): accepted by `check_ids`, routed to no rank.
NO_EXPERT = -1


def _check_ids_host(table, experts, where):
    """Raises `BadIdError` (on every rank alike) if any rank's `[count, t, k, id]` row of `table` counts a bad
    id; `table` is `[N, 4]`, or `[..., N, 4]` under `jax.vmap` (the first bad batch element is named)."""
    table = np.asarray(table)
    flat = table.reshape(-1, *table.shape[-2:])
    for b, rows in enumerate(flat):
        total = int(rows[:, 0].sum())
        if total:
            rank = int(np.flatnonzero(rows[:, 0])[0])
            _, t, k, value = (int(v) for v in rows[rank])
            batch = f" (batch element {b} of {len(flat)})" if len(flat) > 1 else ""
            error = BadIdError(
                f"ExpertParallel.{where}: ids[{t}, {k}] = {value} on rank {rank} is outside [0, {experts}) and not "
                f"{NO_EXPERT} (no expert){batch} ({total} bad id(s) on all ranks)"
            )
            host_checks.fail(error)
    return np.zeros(table.shape[:-2], np.int32)


def _as_eps(eps) -> float:
    """`eps` as a Python float: a finite non-negative real number (Python, NumPy or a concrete 0-d JAX array)."""
    bad = ValueError(f"ExpertParallel.combine: eps={eps!r} must be a finite non-negative float")
    if isinstance(eps, (bool, np.bool_)) or isinstance(eps, jax.core.Tracer):
        raise bad
    if hasattr(eps, "dtype") and (getattr(eps, "shape", ()) != () or jnp.dtype(eps.dtype).kind not in "fiu"):
        raise bad
    if not isinstance(eps, (numbers.Real, np.generic)) and not hasattr(eps, "dtype"):
        raise bad
    try:
        value = float(eps)
    except Exception:
        raise bad from None
    if not (math.isfinite(value) and value >= 0):
        raise bad
    return value


class ExpertParallel:
    """Expert-parallel dispatch / combine over the mesh axis `axis_name`.

    Args:
      mesh: a `jax.sharding.Mesh` holding `axis_name`.
      axis_name: the expert-parallel axis; its size `N` must satisfy `shape.check_ranks(N)`.
      max_tokens: the largest number of tokens `T` a rank sends in one call, `1 <= T < 2**16`.
      shape: the layer's `LatentMoEShape` (default Kimi K3: L=3584, E=896, K=16).
      backend: "xla" (XLA collectives, any device), "nvlink" (the CuTe DSL kernels over NVLink symmetric
        memory, CUDA GPUs only) or "auto" (nvlink when N > 1, every mesh device is a CUDA GPU, the kernel artifacts
        exist, the module imports and a kernel is compiled for this N / shape / GPU; xla otherwise, with
        the reason in `fallback_reason`). The chosen one is `self.backend`.
      check_ids: a debugging flag: check at run time that every id is in `[0, E)` or -1 ("no expert"); see
        the module docstring. It changes nothing else (it works under vmap, grad, scan and remat).
      liveness: where the mesh spans processes, arm this process's failure watcher (`runtime.liveness.watch`
        over the mesh's processes), so that a peer's raise or silent death ends this process, naming the peer,
        instead of leaving it in a collective; False leaves that to the caller.
      **backend_opts: passed to the nvlink backend's constructor (e.g. `timeout_s`, `grid`); ignored when
        "auto" falls back to xla; an error with backend="xla".

    Raises:
      ValueError: naming the bad value, for a bad axis, rank count, max_tokens, backend or backend option; with
        backend="nvlink", also when that backend cannot serve the mesh (the message says why; the cause, e.g. a
        LookupError for a rank count without compiled kernels, or a SymmetricMemoryError when peer access, CUDA
        IPC or another process of the group failed, is chained as `__cause__`); "auto" falls back to xla then.
    """

    def __init__(
        self,
        mesh,
        axis_name: str = "ep",
        max_tokens: int | None = None,
        shape: LatentMoEShape = KIMI_K3,
        backend: str = "auto",
        *,
        check_ids: bool = False,
        liveness: bool = True,
        **backend_opts,
    ):
        if max_tokens is None:
            raise ValueError("ExpertParallel needs max_tokens (the largest T of one call per rank)")
        max_tokens = check_max_tokens(max_tokens)  # a Python int from here on
        if not isinstance(shape, LatentMoEShape):
            raise ValueError(f"shape={shape!r} must be a LatentMoEShape")
        axes = dict(mesh.shape)
        if not isinstance(axis_name, str):
            raise ValueError(
                f"axis_name={axis_name!r} must be one mesh axis name (a str): expert parallelism over several mesh "
                "axes is not supported (the kernels number the ranks of one axis and exchange over it); make the EP "
                f"group one axis of the mesh (mesh axes: {list(axes)})"
            )
        if axis_name not in axes:
            raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh (axes: {list(axes)})")
        self.ranks = shape.check_ranks(int(axes[axis_name]))
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
        self.mesh, self.axis_name, self.max_tokens, self.shape = mesh, axis_name, max_tokens, shape
        self.check_ids = bool(check_ids)
        if not isinstance(liveness, bool):
            raise ValueError(f"liveness={liveness!r} must be a bool")
        processes = sorted({d.process_index for d in np.asarray(mesh.devices).flat})
        if liveness and len(processes) > 1:
            # Before the backend: the nvlink backend's buffer exchange already waits on every process.
            from jax_latent_ep.runtime import liveness as watcher

            watcher.watch(processes=processes)
        self.stride = stride(max_tokens)
        self.rows = self.ranks * self.stride
        #: Why "auto" did not pick nvlink (None when it did, or when the backend was named).
        self.fallback_reason = None
        self._impl = None
        if backend in ("auto", "nvlink"):
            reason = backends.unavailable("nvlink", mesh)
            if reason is None and backend == "auto" and self.ranks == 1:
                # With one rank nothing crosses NVLink, and the XLA backend needs no symmetric buffer (it is
                # faster at T = 1 and within 0.3 us up to T = 32: docs/performance.md).
                reason = "N=1: nothing to communicate; the xla backend needs no symmetric buffer there"
            if reason is None:
                try:
                    self._impl = backends.load("nvlink")(mesh, axis_name, max_tokens, shape, **backend_opts)
                # No kernel compiled for this N / shape / arch, the FFI library or cuda-bindings missing, no
                # peer access, a module that does not load: "auto" falls back, "nvlink" raises.
                except (LookupError, FileNotFoundError, OSError, RuntimeError, ImportError) as e:
                    if backend == "nvlink":
                        raise ValueError(f"backend='nvlink' is not available: {type(e).__name__}: {e}") from e
                    reason = f"{type(e).__name__}: {e}"
            if backend == "nvlink" and reason is not None:
                raise ValueError(f"backend='nvlink' is not available: {reason}")
            if self._impl is not None:
                backend = "nvlink"
            else:
                self.fallback_reason = reason
                backend_opts = {}  # options were meant for nvlink
        if self._impl is None:
            if backend_opts and backend == "xla":
                raise ValueError(f"the xla backend takes no options, got {sorted(backend_opts)}")
            self._impl = backends.load("xla")(mesh, axis_name, max_tokens, shape)
            backend = "xla"
        self.backend = backend
        self._closed = False
        # The kind of the last call traced into each JAX trace (the pairing check, `_check_pairing`).
        self._last_call = weakref.WeakKeyDictionary()
        # The last dispatch traced into each JAX trace (`sequence.DispatchRecord`, the combine's source check).
        self._dispatches = weakref.WeakKeyDictionary()
        # A weak reference to the result of the last combine traced into each JAX trace (`_after_combine`).
        self._combines = weakref.WeakKeyDictionary()

    # -- checks (trace time) -----------------------------------------------------------------------

    def _check_axis(self, where: str):
        try:
            size = lax.axis_size(self.axis_name)
        except NameError:
            raise ValueError(
                f"ExpertParallel.{where} must be called inside jax.shard_map over the mesh axis "
                f"{self.axis_name!r} (that axis is not bound here)"
            ) from None
        if size != self.ranks:
            raise ValueError(
                f"ExpertParallel.{where}: axis {self.axis_name!r} has size {size} here, but the ExpertParallel "
                f"was built for N={self.ranks}"
            )

    def _check_array(self, where, name, a, dtype, shape):
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise ValueError(f"ExpertParallel.{where}: {name} must be an array, got {type(a).__name__}")
        if jnp.dtype(a.dtype) != jnp.dtype(dtype) or tuple(a.shape) != tuple(shape):
            raise ValueError(
                f"ExpertParallel.{where}: {name} must be {jnp.dtype(dtype).name}{list(shape)}, got {_describe(a)}"
            )

    def _check_mesh(self, where: str):
        """The `shard_map` being traced must run over a mesh of the constructor's axes and sizes."""
        try:
            current = jax.sharding.get_abstract_mesh()
        except Exception:  # pragma: no cover - a JAX without abstract meshes: nothing to compare
            return
        if current is None or getattr(current, "empty", True):
            return  # not traced for a mesh (e.g. vmap with an axis name): the axis check is all we can do
        have, want = _mesh_signature(current), _mesh_signature(self.mesh)
        if have != want:
            raise ValueError(
                f"ExpertParallel.{where}: traced inside a shard_map over the mesh {_describe_mesh(have)}, but the "
                f"ExpertParallel was built for the mesh {_describe_mesh(want)}; call it inside "
                f"jax.shard_map(..., mesh=<the mesh given to ExpertParallel>)"
            )

    def _check_tokens(self, where, name, a):
        if not hasattr(a, "shape") or len(a.shape) != 2:
            got = _describe(a) if hasattr(a, "shape") else type(a).__name__
            raise ValueError(f"ExpertParallel.{where}: {name} must be 2-D [T, ...], got {got}")
        t = int(a.shape[0])
        if not 1 <= t <= self.max_tokens:
            raise ValueError(
                f"ExpertParallel.{where}: T={t} tokens ({name} {_describe(a)}) must satisfy 1 <= T <= "
                f"max_tokens={self.max_tokens}"
            )
        return t

    def _checked_ids(self, ids, where, after=None):
        """`ids` with the run-time range check attached (with `check_ids`).

        `after`: an array the check must wait for (combine passes `out`, which derives from its dispatch's
        result, so the dispatch's check of the same ids runs first and names the right call).
        """
        if not self.check_ids:
            return ids
        # Every rank learns every rank's first bad id (a tiny all_gather) and the host check raises on all
        # ranks at the same point, so no rank is left waiting in a later collective for a failed one.
        bad = (ids < NO_EXPERT) | (ids >= self.shape.experts)
        first = jnp.argmax(bad.reshape(-1)).astype(jnp.int32)
        k = self.shape.topk
        info = jnp.stack([jnp.sum(bad, dtype=jnp.int32), first // k, first % k, ids.reshape(-1)[first]])
        table = lax.all_gather(info, self.axis_name)  # [N, 4]
        # stop_gradient: the ordering operand carries no tangent, so the check is transparent to jax.grad.
        operands = (table,) if after is None else (table, lax.stop_gradient(after.reshape(-1)[:1]))
        experts = self.shape.experts
        ok = jax.pure_callback(
            lambda *a: _check_ids_host(a[0], experts, where), jax.ShapeDtypeStruct((), jnp.int32), *operands,
            vmap_method="broadcast_all",
        )
        return ids + ok  # a data dependency keeps the check

    # -- the calls ----------------------------------------------------------------------------------

    def dispatch(self, x, ids, weights, *, dequantize: bool = False):
        """Sends every token to each rank holding one of its experts.

        Args:
          x: bfloat16 `[T, L]`, `1 <= T <= max_tokens`.
          ids: int32 `[T, K]` global expert ids in `[0, E)`.
          weights: float32 `[T, K]` routing weights.
          dequantize: also return the received rows dequantized (the differentiable path of `x`).

        Returns:
          `Received(x, sf, ids, weights, src)` with `N * S` rows (see `jax_latent_ep.received.Received`); with
          `dequantize=True`, `(Received, latent)`, `latent` float32 `[N*S, L]`: `f32(x) * 2^(sf - 127)` per
          32-block of every received row, 0 in empty rows (XLA computes it only where it is used).

        Gradients (`jax.grad`, `jax.vjp`; `jax_latent_ep.autodiff` has the rule, `docs/numerics.md` the
        numerics): the backward is a combine over XLA collectives. Each token's `x` gradient is the FP32 sum,
        over the ranks its rows reached in ascending order, of those rows' `latent` gradients, rounded to BF16:
        the MXFP8 round trip differentiates as the identity (straight-through). `weights` get the FP32 sum of
        their rows' `Received.weights` gradients. `ids` are integers. A gradient reaching the float8
        `Received.x` (e.g. through `mxfp8_dequantize(recv.x, recv.sf)`) is refused with a ValueError at trace
        time: it would be rounded to float8 before any rule sees it; use `latent`.
        """
        self._check_open()
        self._check_axis("dispatch")
        self._check_mesh("dispatch")
        t = self._check_tokens("dispatch", "x", x)
        shp = self.shape
        self._check_array("dispatch", "x", x, jnp.bfloat16, (t, shp.latent))
        self._check_array("dispatch", "ids", ids, jnp.int32, (t, shp.topk))
        self._check_array("dispatch", "weights", weights, jnp.float32, (t, shp.topk))
        if not isinstance(dequantize, bool):
            raise ValueError(f"ExpertParallel.dispatch: dequantize={dequantize!r} must be a bool")
        previous = self._previous_combine(x, ids, weights)
        self._check_pairing("dispatch", t, x, ids, weights)
        self._check_control_flow("dispatch")
        if previous is not None:
            # Calls run in the contract's order only where the data orders them (XLA has no other order): this
            # dispatch's tokens wait for the previous combine's result, even when they are not computed from it.
            x, _ = lax.optimization_barrier((x, previous))
        recv, latent = autodiff.dispatch(self._impl, self.axis_name, x, self._checked_ids(ids, "dispatch"), weights)
        self._record_dispatch(ids, (recv, latent), x, ids, weights)
        return (recv, latent) if dequantize else recv

    def combine(self, out, ids, norm_weight=None, eps: float = 1e-5):
        """Returns every own token's routed latent (FP32 sum over its ranks, one bf16 rounding), RMS-normed
        with `norm_weight` unless that is None.

        Args:
          out: bfloat16 `[N*S, L]`, the expert output of every receive row.
          ids: int32 `[T, K]`, the same ids as this layer's dispatch.
          norm_weight: bfloat16 `[L]` or None.
          eps: RMSNorm epsilon.

        Returns:
          bfloat16 `[T, L]`.

        Gradients (`jax_latent_ep.autodiff`): the backward is a dispatch over XLA collectives. The RMSNorm's
        backward (FP32) gives `norm_weight`'s gradient and the routed latent's, rounded once to BF16 (the
        routed latent's BF16 rounding differentiates as the identity); every row of `out` that sent a partial of
        token `t` gets that gradient, other rows 0. Under differentiation the nvlink backend's forward computes
        the RMSNorm in XLA (as the xla backend does; against its fused kernel at most 1 BF16 ulp differs, on a
        small fraction of elements).

        `out` must be computed from this layer's dispatch result (as an expert stage is): XLA drops a call
        whose results nothing uses, so a combine fed from elsewhere may run without its dispatch, which the
        nvlink kernels refuse at run time (error 4, "combine called without its dispatch", `check()`).
        """
        self._check_open()
        self._check_axis("combine")
        self._check_mesh("combine")
        t = self._check_tokens("combine", "ids", ids)
        shp = self.shape
        self._check_array("combine", "out", out, jnp.bfloat16, (self.rows, shp.latent))
        self._check_array("combine", "ids", ids, jnp.int32, (t, shp.topk))
        if norm_weight is not None:
            self._check_array("combine", "norm_weight", norm_weight, jnp.bfloat16, (shp.latent,))
        eps = _as_eps(eps)
        self._check_control_flow("combine")
        last = self._last_kind(out, ids)
        self._check_pairing("combine", t, out, ids)
        self._check_combine_source(out, ids, last)
        ids = self._checked_ids(ids, "combine", after=out)
        result = autodiff.combine(self._impl, self.axis_name, out, ids, norm_weight, eps)
        self._record_combine(result, out, ids)
        return result

    def _record_combine(self, result, *arrays):
        trace = self._trace_of(arrays)
        if trace is not None:
            try:
                self._combines[trace] = sequence.weak_ref(result)
            except TypeError:  # pragma: no cover - a trace that is not weakly referenceable
                pass

    def _previous_combine(self, *arrays):
        """The result of the combine traced last into the trace of `arrays`, if that was the last call there and
        its result is still alive (else None)."""
        trace = self._trace_of(arrays)
        if trace is None or self._last_kind(*arrays) != "combine":
            return None
        try:
            ref = self._combines.get(trace)
        except TypeError:  # pragma: no cover
            return None
        return None if ref is None else ref()

    # -- the call-sequence contract (trace time; `jax_latent_ep.sequence`) ---------------------------------

    def _check_control_flow(self, where: str):
        reason = sequence.divergent_control_flow(self.axis_name)
        if reason is not None:
            raise ValueError(
                f"ExpertParallel.{where}: {reason}. Every rank must make every dispatch and combine, in the same "
                "order (a rank with no tokens still calls them, e.g. with its ids all -1, 'no expert')"
            )

    def _record_dispatch(self, ids, received, *arrays):
        trace = self._trace_of(arrays)
        if trace is not None:
            try:
                self._dispatches[trace] = sequence.DispatchRecord(ids, received)
            except TypeError:  # pragma: no cover - a trace that is not weakly referenceable
                pass

    def _last_kind(self, *arrays):
        """"dispatch" / "combine" / None: the last call traced into the trace of `arrays`."""
        trace = self._trace_of(arrays)
        try:
            return None if trace is None else self._last_call.get(trace, (None, None))[0]
        except TypeError:  # pragma: no cover
            return None

    def _check_combine_source(self, out, ids, last):
        """A combine after a dispatch of the same trace (`last`, before this combine) takes that dispatch's ids
        and an `out` derived from its `Received` (else XLA drops the dispatch: the kernels' error 4)."""
        trace = self._trace_of((out, ids))
        record = self._dispatches.get(trace) if last == "dispatch" and trace is not None else None
        if record is None:
            return
        if not record.ids_match(ids):
            raise ValueError(
                "ExpertParallel.combine: ids are not the ids given to this layer's dispatch; combine takes the "
                "ids of its dispatch (the same array)"
            )
        if record.derives(out) is False:
            raise ValueError(
                f"ExpertParallel.combine: {sequence.WITHOUT_DISPATCH}: out does not derive from the Received of "
                "this layer's dispatch in this traced function, so XLA drops that dispatch (nothing uses it) and "
                "the combine would run without it; compute out from the dispatch's result"
            )

    @staticmethod
    def _trace_of(arrays):
        return next((getattr(a, "_trace", None) for a in arrays if isinstance(a, jax.core.Tracer)), None)

    def _check_pairing(self, where: str, tokens: int, *arrays):
        """Calls traced into one function must alternate: dispatch, combine, dispatch, ... (the contract's
        pairs; the NVLink kernels fail a second dispatch or combine at run time, error 3 / 4, and lose the CUDA
        context), and a combine takes the `T` of its dispatch (its `ids` are the dispatch's; the NVLink combine
        reduces and sends by its own `T`). A combine needs its dispatch traced before it in its own trace, or in
        a trace enclosing it (a combine inside a `jax.checkpoint` or a nested `jit` of the layer's function),
        whatever other functions traced before. Keyed by the JAX trace of the first traced argument; outside
        tracing nothing is checked."""
        trace = self._trace_of(arrays)
        if trace is None:
            return
        try:
            last, last_tokens = self._last_call.get(trace, (None, None))
        except TypeError:  # pragma: no cover - a JAX whose traces are not weakly referenceable
            return
        if where == "combine" and last is None:
            # A trace nested in the layer's function: its dispatch is the enclosing trace's last call.
            outer = getattr(trace, "parent_trace", None)
            while outer is not None and last is None:
                last, last_tokens = self._last_call.get(outer, (None, None))
                if last is None:
                    outer = getattr(outer, "parent_trace", None)
            if last == "dispatch":
                self._last_call[outer] = ("combine", tokens)  # that dispatch is taken
        if last == "dispatch" and where == "combine" and tokens != last_tokens:
            raise ValueError(
                f"ExpertParallel.combine: ids has T={tokens} tokens, but this layer's dispatch sent T={last_tokens}; "
                "combine takes the ids of its dispatch"
            )
        if last == where == "dispatch":
            raise ValueError(
                "ExpertParallel.dispatch: called again in this traced function before the combine of the previous "
                "dispatch; each layer is one dispatch followed by its combine"
            )
        if where == "combine" and last is None:
            raise ValueError(
                f"ExpertParallel.combine: {sequence.WITHOUT_DISPATCH}: no dispatch was traced before it in this "
                "traced function; trace each layer's dispatch and combine into one function (a combine is refused "
                "without its own dispatch, whatever was traced before)"
            )
        if last == where == "combine":
            raise ValueError(
                "ExpertParallel.combine: called again in this traced function without a dispatch since the last "
                "combine; every combine needs its own dispatch (for both the routed latent and its RMSNorm, apply "
                "jax_latent_ep.numerics.rms_norm to the routed latent, or run the layer twice)"
            )
        self._last_call[trace] = (where, tokens)

    def _check_open(self):
        if self._closed:
            raise ValueError("ExpertParallel is closed")

    # -- run-time errors ------------------------------------------------------------------------------

    @staticmethod
    def checked(fn):
        """`fn` (e.g. a jitted step) wrapped for debugging with `check_ids=True`: calls it, waits for its results,
        and turns a failed id check into the one `BadIdError` itself (naming the id, its token, rank and call),
        instead of the `JaxRuntimeError` that carries its text (`host_checks.checked`: any failed check of the
        library, a `CapacityError` too). Other errors pass unchanged.

            step = ep.checked(jax.jit(step))
            try: step(params, batch)
            except BadIdError as e: ...
        """
        return host_checks.checked(fn)

    def status(self) -> dict[tuple[int, int], tuple[int, int, int, int]]:
        """The kernels' error records of the ranks this process drives: `{(group, rank): (code, rank, peer,
        layer)}` (nvlink; see `jax_latent_ep.backends.nvlink.NvlinkBackend.status` for the codes), `{}` for xla, whose
        collectives record nothing. Host memory: no synchronization, readable after a failed computation."""
        status = getattr(self._impl, "status", None)
        return {} if status is None else status()

    def check(self) -> None:
        """Raises RuntimeError naming every rank whose kernel recorded an error: a peer that never answered
        within `timeout_s` (the rank, the peer waited for, the layer), or a call-sequence error. Call it after a
        computation failed (the kernels trap on a timeout, so JAX raises a CUDA error without the cause). No-op
        for xla."""
        check = getattr(self._impl, "check", None)
        if check is not None:
            check()

    def close(self):
        """Releases the backend's resources (symmetric buffers for nvlink); idempotent.

        Afterwards `dispatch` and `combine` raise ValueError when traced. Executables compiled earlier cannot
        be intercepted and must not run after `close()`. With the nvlink backend (see
        `jax_latent_ep.backends.nvlink.NvlinkBackend.close`): where XLA runs the FFI handler at launch, the execution
        fails with "no NvlinkBackend instance ... is registered" instead of launching a kernel; but a CUDA graph
        (XLA command buffer) captured earlier replays the kernel launches without the handler, on the freed
        memory. Close when the model is done (or leave it to interpreter exit), not between steps.

        Without `close()`, the nvlink backend's buffers are released when this object (and every function
        that closes over it) is garbage-collected; keep it alive as long as an executable compiled with it
        (e.g. `jax.jit(f).lower(...).compile()` kept on its own) may run.
        """
        if not self._closed:
            self._closed = True
            self._impl.close()

    def __enter__(self):
        if self._closed:
            raise ValueError("ExpertParallel is closed: `with` needs an open instance (build a new one)")
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return (
            f"ExpertParallel(axis_name={self.axis_name!r}, N={self.ranks}, max_tokens={self.max_tokens}, "
            f"shape={self.shape}, backend={self.backend!r})"
        )
