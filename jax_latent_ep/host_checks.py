"""Run-time checks on the host: a failed check raises one `HostCheckError` where the step's result is read.

A check is a `jax.pure_callback` that returns 0 (added to a value the program uses, so XLA keeps it) or records and
raises its `HostCheckError`; JAX then raises a `JaxRuntimeError` carrying the message where the step's result is
read. JAX also keeps a copy of the failure for `jax.effects_barrier()`, which its exit hook calls: the copy of a
failure already raised is consumed here (at exit, or by `checked`), so it is raised once. `checked(step)` raises
the `HostCheckError` itself instead of the `JaxRuntimeError`.
"""

from __future__ import annotations

import atexit
import functools
import logging

import jax


class HostCheckError(ValueError):
    """A run-time check of the library failed (its message names the value, where and on which rank)."""


#: The `HostCheckError`s host checks raised in this process since the last was reported (`checked` re-raises the
#: one JAX reports as itself; several devices of one process may each fail a check of the same step).
_last: list[HostCheckError] = []


def fail(error: HostCheckError):
    """Records `error` as a failed check of this process and raises it (inside a host callback)."""
    _last.append(error)
    raise error


class _Quiet(logging.Filter):
    """JAX logs every failed host callback with its traceback, once per rank; a `HostCheckError` is reported by
    the exception itself, once."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, HostCheckError)


logging.getLogger("jax._src.callback").addFilter(_Quiet())


def consume_copy():
    """Consumes JAX's copy of the last failed check (kept for `jax.effects_barrier()`); other errors stay."""
    if not _last:
        return
    texts = [str(e) for e in _last]
    _last.clear()
    try:
        jax.effects_barrier()
    except jax.errors.JaxRuntimeError as e:
        if not any(text in str(e) for text in texts):
            raise


atexit.register(consume_copy)  # runs before JAX's own (registered at its import, earlier)


def checked(fn):
    """`fn` (e.g. a jitted step) wrapped: calls it, waits for its results, and turns a failed check into the one
    `HostCheckError` itself (e.g. `BadIdError`, `CapacityError`) instead of the `JaxRuntimeError` that carries its
    text; JAX's copy of the failure is consumed. Other errors pass unchanged."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return jax.block_until_ready(fn(*args, **kwargs))
        except jax.errors.JaxRuntimeError as failure:
            error = next((e for e in _last if str(e) in str(failure)), None)
            if error is None:
                raise
            _last.clear()
            try:  # the failed callback is also kept in JAX's runtime tokens
                jax.effects_barrier()
            except jax.errors.JaxRuntimeError:
                pass
            raise error from None

    return wrapper
