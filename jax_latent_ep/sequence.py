"""The call-sequence contract's trace-time checks, alike on every backend: rank-divergent control flow around a
call, a combine whose `out` does not derive from its dispatch's `Received`, a combine given other ids.

Every rank makes every call, in pairs (dispatch, then its combine). The NVLink kernels refuse a combine
without its dispatch at run time (error 4) and lose the CUDA context; what the traced program shows is refused
here, with the same words, before anything runs:

- a call traced inside a `lax.cond` / `lax.switch` branch whose predicate or index varies over the
  expert-parallel axis (its type says so: `shard_map`'s varying-axes tracking), or inside a `lax.while_loop`
  (and a `fori_loop` with traced bounds, which is one) within the `shard_map` body: its trip count may differ
  per rank. A `cond` on a value replicated over the axis, a `scan`, a `fori_loop` with static bounds, and
  control flow outside the `shard_map` are fine;
- a combine whose `out` does not derive, within the traced function, from the `Received` of the dispatch
  just before it (XLA drops a dispatch whose results nothing uses, so the combine would run without it);
- a combine whose `ids` are visibly not its dispatch's (another traced value, or other concrete values).

These inspect JAX's tracing internals of jax 0.11 (`DynamicJaxprTracer.parent`, the frames of
`lax.cond` / `while_loop`); where those are not there, the check passes silently (the kernels still catch the
run-time cases). What cannot be seen at trace time is listed in docs/bad_input.md.
"""

from __future__ import annotations

import sys
import weakref

import jax
import numpy as np

#: The message of the kernels' error 4 (kernels/abi.py), which the XLA backend now gives at trace time.
WITHOUT_DISPATCH = "combine called without its dispatch"

_COND_FUNCS = {"cond", "_cond", "switch", "_switch_internal"}
_LOOP_FUNCS = {"while_loop"}
_SHARD_MAP_FILES = ("shard_map.py",)


def divergent_control_flow(axis_name: str) -> str | None:
    """Why the current call sits under control flow that may differ per rank of `axis_name` (None if not).

    Walks the Python frames from here out to the innermost `shard_map` body: a `lax.cond` / `switch` frame
    whose predicate / index varies over `axis_name`, or a `while_loop` frame, on the way is reported."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        path = code.co_filename.replace("\\", "/")
        if "/jax/_src/" in path:
            if path.endswith(_SHARD_MAP_FILES):
                return None  # reached the shard_map that binds the axis: control flow outside it is uniform
            if path.endswith("conditionals.py") and code.co_name in _COND_FUNCS:
                pred = frame.f_locals.get("pred", frame.f_locals.get("index"))
                vma = _varying_axes(pred)
                if vma is None or axis_name in vma:
                    kind = "lax.switch" if "switch" in code.co_name else "lax.cond"
                    return (f"traced inside a {kind} branch whose predicate varies over {axis_name!r}: ranks may "
                            "take different branches")
            if path.endswith("loops.py") and code.co_name in _LOOP_FUNCS:
                return ("traced inside a lax.while_loop (or a fori_loop with traced bounds): its trip count may "
                        "differ per rank")
        frame = frame.f_back
    return None


def _varying_axes(value):
    """The mesh axes `value` varies over inside `shard_map` (None if the type does not say)."""
    aval = getattr(value, "aval", None)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and hasattr(mat, "varying"):
        return mat.varying
    return getattr(aval, "vma", None)


def weak_ref(value):
    """A weak reference to `value` (a callable returning it, or None once it is gone); one that always returns None
    where `value` cannot be weakly referenced."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: None


def _identity_ok(have, want_ref, want_copy) -> bool:
    want = want_ref()
    if want is None and want_copy is None:
        return True  # the dispatch's ids are gone: nothing to compare
    if have is want:
        return True
    if isinstance(have, jax.core.Tracer) or isinstance(want, jax.core.Tracer):
        return False
    try:
        return want_copy is not None and np.array_equal(np.asarray(have), want_copy)
    except Exception:
        return True


class DispatchRecord:
    """What a traced dispatch leaves for its combine: weak references to its ids and its `Received` leaves."""

    def __init__(self, ids, received):
        self.ids = weak_ref(ids)
        self.ids_copy = None if isinstance(ids, jax.core.Tracer) else np.asarray(ids).copy()
        self.leaves = [weak_ref(a) for a in jax.tree.leaves(received) if isinstance(a, jax.core.Tracer)]

    def ids_match(self, ids) -> bool:
        return _identity_ok(ids, self.ids, self.ids_copy)

    def derives(self, out, limit: int = 200_000) -> bool | None:
        """Whether `out` derives from a `Received` leaf within its trace (None: cannot tell)."""
        if not self.leaves:
            return None
        if not isinstance(out, jax.core.Tracer):
            return False  # a constant of the traced function: it derives from nothing traced
        if not hasattr(out, "parent"):
            return None  # not a jaxpr tracer (vmap, grad): its provenance is not visible
        targets = {id(t) for t in (r() for r in self.leaves) if t is not None}
        if not targets:
            return False  # every Received leaf is gone: nothing derived from them (a tracer keeps its parents)
        seen, stack = set(), [out]
        while stack:
            t = stack.pop()
            if id(t) in targets:
                return True
            if id(t) in seen:
                continue
            seen.add(id(t))
            if len(seen) > limit:
                return None  # too large to walk: assume it does
            eqn = getattr(t, "parent", None)
            if eqn is not None:
                stack.extend(x for x in getattr(eqn, "in_tracers", ()) if isinstance(x, jax.core.Tracer))
        return False
