"""A dead process ends its multi-process job, bounded and named: `watch` (failure records and heartbeats in
`jax.distributed`'s key-value store, read by a watcher thread), armed by every `ExpertParallel` whose mesh spans
processes (`ExpertParallel(..., liveness=False)` does not); `initialize` is `jax.distributed.initialize` with short
coordination timeouts, then `watch`, for a job that wants the bound from its first line on.

    jax.distributed.initialize(...)            # the plain path: ExpertParallel(mesh over processes) calls watch()
    liveness.watch(timeout_s=30)               # or arm it yourself, before anything can fail

Without it a process that raises waits in `jax.distributed`'s shutdown barrier (300 s by default) while its
peers wait in a collective for it, and both end in SIGABRT. With it:

- a process that raises (an uncaught exception, in the main thread or another) publishes
  `process P failed: <type>: <message>` under `jax_latent_ep/failed/P` and exits at once with status 1,
  skipping the shutdown barrier;
- every process runs a daemon thread that reads those records every `poll_s` (0.25 s); on finding another
  process's record it prints `jax_latent_ep: ending process Q: process P failed: ...` to stderr and exits
  with status 1 (it cannot raise into a thread blocked in a collective; the job is SPMD, so it would wait
  there for the dead process anyway);
- a process that dies without a word (SIGKILL, a crash) stops its heartbeat (a counter under
  `jax_latent_ep/alive/P`, raised every `BEAT_S`): a watcher that sees it unchanged for `timeout_s` prints
  `jax_latent_ep: ending process Q: process P stopped its heartbeat ...` and exits with status 1 (so does one
  that cannot reach the coordination service, process 0, for `timeout_s`). A gloo collective waiting for the dead
  process fails at once ("Connection closed by peer"), naming only a socket: `fail` then waits for the watcher.
  A process that ends normally marks its heartbeat `done`.

The bound from a death to every peer's end is therefore about `poll_s` for a raise and `timeout_s` plus a
second or two for a silent death (`DEFAULT_TIMEOUT_S`, 30 s). What it cannot see: a process that fails before it
arms (before its `ExpertParallel`, where nothing called `watch` earlier), and one that hangs with its threads alive.
The NVLink kernels bound their own waits (`timeout_s` of that backend, 5 s).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

PREFIX = "jax_latent_ep/failed/"
#: Each process's heartbeat counter (`done` once it ends normally).
ALIVE = "jax_latent_ep/alive/"
#: The default bound (seconds) on a silent death: a heartbeat unchanged this long ends the watching process.
DEFAULT_TIMEOUT_S = 30
#: Seconds between two heartbeats of one process.
BEAT_S = 1.0

_state = {"thread": None, "stop": None, "timeout_s": DEFAULT_TIMEOUT_S, "processes": set()}


def _client():
    from jax._src import distributed

    return distributed.global_state.client, distributed.global_state.process_id


def initialize(coordinator_address: str, num_processes: int, process_id: int, *, timeout_s: int = DEFAULT_TIMEOUT_S,
               initialization_timeout: int = 60, poll_s: float = 0.25, **kwargs) -> None:
    """`jax.distributed.initialize` with `heartbeat_timeout_seconds` and `shutdown_timeout_seconds` set to
    `timeout_s` (JAX's defaults: 100 s and 300 s), then `watch(poll_s)`. Other keyword arguments go to JAX."""
    import jax

    timeout_s = int(timeout_s)
    if timeout_s < 1:
        raise ValueError(f"timeout_s={timeout_s} must be at least 1 second")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=initialization_timeout,
                               heartbeat_timeout_seconds=timeout_s, shutdown_timeout_seconds=timeout_s, **kwargs)
    watch(poll_s, timeout_s=timeout_s)


def _others(client, pid, wait_s: float = 0.0) -> str:
    """The failure records of the other processes ("; "-joined), waiting up to `wait_s` for one to appear."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            records = client.key_value_dir_get(PREFIX)
        except Exception:
            return ""
        others = sorted(v for k, v in records if k.rsplit("/", 1)[-1] != str(pid))
        if others or time.monotonic() >= deadline:
            return "; ".join(others)
        time.sleep(0.05)


def report_failure(exc: BaseException | str) -> str:
    """Publishes this process's failure record (first one wins) and returns its text.

    A failure that follows another process's (a collective whose peer went away: "Connection closed by
    peer") names that process first: the record then reads "process P failed after process Q failed: ...".
    """
    client, pid = _client()
    if isinstance(exc, BaseException):
        where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        at = f" (at {where[0].filename}:{where[0].lineno} in {where[0].name})" if where else ""
        text = f"process {pid} failed: {type(exc).__name__}: {exc}{at}"
    else:
        text = f"process {pid} failed: {exc}"
    # A trapped NVLink kernel reaches JAX as a bare "launch failure": its error record names the peer it waited for.
    symmetric = sys.modules.get("jax_latent_ep.runtime.symmetric")
    records = symmetric.kernel_errors() if symmetric is not None else []
    if records:
        text += "; the NVLink kernels recorded: " + "; ".join(records)
    if client is not None:
        cause = _others(client, pid, wait_s=1.0 if "peer" in text.lower() else 0.0)
        if cause:
            text = f"{cause}; then process {pid} failed: {text.split(': ', 1)[1]}"
        try:
            client.key_value_set(f"{PREFIX}{pid}", text)
        except Exception:  # already published, or the service is gone: nothing more to tell
            pass
    return text


def fail(exc: BaseException) -> None:
    """Ends this process after `exc`: publishes its record and exits with status 1, skipping the shutdown barrier.

    A collective error that names only a peer's socket ("Connection closed by peer") with no failure record
    from any process means a peer died silently (SIGKILL, a crash): then this process waits (at most
    `timeout_s` + 10 s) for the coordination service's heartbeat timeout, which ends it with a message naming
    that process ("The following tasks are unhealthy ... 1"), instead of exiting without a name.
    """
    text = report_failure(exc)
    print(f"jax_latent_ep: {text}; exiting", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if "peer" in str(exc).lower() and " then process " not in text and _client()[0] is not None:
        print(f"jax_latent_ep: no process published a failure: a peer died silently; waiting up to "
              f"{_state['timeout_s']} s for the watcher to name it", file=sys.stderr, flush=True)
        time.sleep(_state["timeout_s"] + 10)
    os._exit(1)


def _die(exc_type, exc, tb):
    """Excepthook: print the traceback, then `fail`."""
    traceback.print_exception(exc_type, exc, tb)
    if exc is not None and exc.__traceback__ is None:
        exc.__traceback__ = tb
    fail(exc)


def _end(pid, text):
    print(f"jax_latent_ep: ending process {pid}: {text}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def _beat(client, pid, value: str):
    try:
        client.key_value_set(f"{ALIVE}{pid}", value, allow_overwrite=True)
    except TypeError:  # a client without allow_overwrite
        client.key_value_delete(f"{ALIVE}{pid}")
        client.key_value_set(f"{ALIVE}{pid}", value)


def _watch(stop: threading.Event, poll_s: float):
    """The watcher thread: beats every `BEAT_S`, ends this process on another's failure record, on a watched
    process's heartbeat unchanged for `timeout_s`, or on the coordination service unreachable for `timeout_s`."""
    seen: dict[int, tuple[str, float]] = {}  # process -> (its last heartbeat value, when this process first saw it)
    count, last_beat, reachable = 0, 0.0, time.monotonic()
    while not stop.wait(poll_s):
        client, pid = _client()
        if client is None:
            return
        now, timeout_s = time.monotonic(), _state["timeout_s"]
        try:
            if now - last_beat >= BEAT_S:
                count, last_beat = count + 1, now
                _beat(client, pid, str(count))
            records = client.key_value_dir_get(PREFIX)
            beats = {int(k.rsplit("/", 1)[-1]): v for k, v in client.key_value_dir_get(ALIVE)}
            reachable = now
        except Exception as e:  # noqa: BLE001 - the service's own error, reported after timeout_s
            if now - reachable > timeout_s and not stop.is_set():
                _end(pid, f"the coordination service (process 0) has not answered for {now - reachable:.0f} s "
                          f"({type(e).__name__}: {e}): process 0 died or is unreachable")
            continue
        others = sorted(v for k, v in records if k.rsplit("/", 1)[-1] != str(pid))
        if others and not stop.is_set():
            _end(pid, "; ".join(others))
        for q in sorted(_state["processes"] - {pid}):
            value = beats.get(q)
            if value is None or value == "done":
                continue  # not armed yet, or ended normally
            if seen.get(q, (None,))[0] != value:
                seen[q] = (value, now)
            elif now - seen[q][1] > timeout_s and not stop.is_set():
                _end(pid, f"process {q} stopped its heartbeat {now - seen[q][1]:.0f} s ago without publishing a "
                          "failure: it was killed or crashed")


def finish():
    """At a normal exit: stops the watcher and marks this process's heartbeat `done`."""
    _state["stop"].set()
    client, pid = _client()
    if client is not None:
        try:
            _beat(client, pid, "done")
        except Exception:  # noqa: BLE001 - the service is gone: nobody is left to tell
            pass


def watch(poll_s: float = 0.25, timeout_s: int = DEFAULT_TIMEOUT_S, processes=None) -> None:
    """Installs the failure hooks and starts the watcher thread, after `jax.distributed.initialize`.

    Args:
      poll_s: seconds between two reads of the failure records and heartbeats.
      timeout_s: seconds a watched heartbeat may stand still (and the coordination service stay silent) before
        this process ends, naming the process.
      processes: the process ids whose heartbeats to watch (an `ExpertParallel` passes its mesh's); None: every
        process of the job. Calling `watch` again adds them to the running watcher (its other settings stay).
    """
    import atexit

    client, _ = _client()
    if client is None:
        raise RuntimeError("liveness.watch needs jax.distributed.initialize first")
    if processes is None:
        import jax

        processes = range(jax.process_count())
    _state["processes"] |= {int(p) for p in processes}
    if _state["thread"] is not None:
        return
    sys.excepthook = _die
    threading.excepthook = lambda args: _die(args.exc_type, args.exc_value, args.exc_traceback)
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(stop, poll_s), name="jax_latent_ep-liveness", daemon=True)
    _state.update(thread=thread, stop=stop, timeout_s=int(timeout_s))
    atexit.register(finish)  # before jax.distributed.shutdown (atexit runs in reverse order of registration)
    thread.start()


def armed() -> bool:
    """Whether this process's watcher runs."""
    return _state["thread"] is not None
