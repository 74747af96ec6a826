"""Multi-process JAX launcher for tests: P CPU processes joined by `jax.distributed` (gloo collectives), or P
processes of one CUDA device each (`run(..., gpus=[...])`).

    from jax_latent_ep.testing.launcher import launch
    launch("/path/to/module.py:worker", processes=4, timeout=120, args={"seed": 1})

Each process runs `worker(process_id, num_processes, **args)` after `jax.distributed.initialize` (coordinator on
a free localhost port), with `devices_per_process` CPU devices. `launch` returns the processes' logs when all
exit with status 0; if any exits otherwise, it kills the rest at once (they may be stuck in a collective
waiting for it) and raises AssertionError; if they are not all done within `timeout` seconds it kills
them all and raises AssertionError. Both messages show every rank's exit status and log.

The processes join through `jax_latent_ep.runtime.liveness.initialize` (heartbeat and shutdown timeouts of
`liveness_s`, 60 s by default; its watcher ends a process whose peer failed), so a dead process ends the others
by itself, bounded and named. `plain=True` starts them as a user's job does instead: plain
`jax.distributed.initialize` with JAX's defaults, uncaught exceptions left to Python; there the worker's
`ExpertParallel` arms the watcher (`runtime.liveness`). `run` leaves them to it: it waits for every process and
returns each one's exit status, log and exit time (the dead-process tests measure with it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

_BOOTSTRAP = r"""
import importlib.util, json, os, sys
target, coordinator, nproc, pid, args = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
import jax
if os.environ.get("JAX_LATENT_EP_LAUNCH_PLATFORM", "cpu") == "cpu":
    jax.config.update("jax_platforms", "cpu")
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as e:  # older or newer jax: gloo is the default where the option is gone
        print(f"launcher: jax_cpu_collectives_implementation not set ({e})", flush=True)
plain = os.environ.get("JAX_LATENT_EP_LAUNCH_PLAIN") == "1"
if plain:  # as a user's job starts: JAX's defaults, nothing of the package's until the worker builds an ExpertParallel
    jax.distributed.initialize(coordinator, nproc, pid)
else:
    from jax_latent_ep.runtime import liveness
    liveness.initialize(coordinator, nproc, pid, timeout_s=int(os.environ.get("JAX_LATENT_EP_LIVENESS_S", "60")),
                        initialization_timeout=60)
path, _, name = target.rpartition(":")
if path.endswith(".py"):
    spec = importlib.util.spec_from_file_location(f"_launched_{pid}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
else:
    module = importlib.import_module(path)
print(f"launcher: process {pid}/{nproc} devices {jax.local_devices()} of {jax.device_count()}", flush=True)
work = lambda: getattr(module, name)(pid, nproc, **json.loads(args))
if plain:  # an uncaught exception goes to sys.excepthook, as in a user's script
    work()
else:
    try:
        work()
    except BaseException as e:
        import traceback
        traceback.print_exc()
        sys.stdout.flush(); sys.stderr.flush()
        liveness.fail(e)  # publish for the others' watchers, exit without jax.distributed's shutdown barrier
print(f"launcher: process {pid} done", flush=True)
from jax_latent_ep.runtime import liveness
if liveness.armed():
    liveness.finish()  # what atexit does, before the os._exit below skips it
jax.distributed.shutdown()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)  # past the shutdown barrier; the interpreter's teardown can abort in the distributed client's threads
"""


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the worker and anything it started
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _report(headline, procs, logs) -> str:
    parts = [headline]
    for i, (p, path) in enumerate(zip(procs, logs)):
        status = p.poll()
        with open(path, errors="replace") as f:
            text = f.read()
        if len(text) > 6000:
            text = "... (cut) ...\n" + text[-6000:]
        parts.append(f"----- rank {i}: exit status {status} -----\n{text.rstrip()}")
    return "\n".join(parts)


def _start(target, processes, args, devices_per_process, env, liveness_s, gpus=None, plain=False):
    import json

    coordinator = f"127.0.0.1:{free_port()}"
    base_env = dict(os.environ)
    base_env.update(env or {})
    if gpus is None:
        flags = [f for f in base_env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
        base_env["XLA_FLAGS"] = " ".join(flags)
        base_env["JAX_PLATFORMS"] = "cpu"
        base_env["JAX_LATENT_EP_LAUNCH_PLATFORM"] = "cpu"
    else:  # one CUDA device per process (several processes may share one GPU: CUDA IPC works within a device)
        base_env["JAX_PLATFORMS"] = "cuda"
        base_env["JAX_LATENT_EP_LAUNCH_PLATFORM"] = "cuda"
        base_env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    base_env["JAX_LATENT_EP_LIVENESS_S"] = str(int(liveness_s))
    base_env["JAX_LATENT_EP_LAUNCH_PLAIN"] = "1" if plain else "0"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, base_env.get("PYTHONPATH", "")) if p)
    logdir = tempfile.mkdtemp(prefix="jax_latent_ep_launch_")
    procs, logs = [], []
    for pid in range(processes):
        path = os.path.join(logdir, f"rank{pid}.log")
        logs.append(path)
        proc_env = base_env if gpus is None else {**base_env, "CUDA_VISIBLE_DEVICES": str(gpus[pid % len(gpus)])}
        with open(path, "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-u", "-c", _BOOTSTRAP, target, coordinator, str(processes), str(pid),
                 json.dumps(args or {})],
                stdout=log, stderr=subprocess.STDOUT, env=proc_env, start_new_session=True))
    return procs, logs


def _failure_headline(target: str, failed: list[int], texts: list[str]) -> str:
    """The first line of a failed run's report: the ranks that failed, apart from those their watcher ended on
    another's failure (`runtime.liveness`: "ending process Q: ..."), which a poll can see exit in the same
    instant."""
    ended = [i for i in failed if f"jax_latent_ep: ending process {i}: " in texts[i]]
    first = [i for i in failed if i not in ended] or failed
    also = f"; rank(s) {ended} ended on that failure" if ended and first != failed else ""
    return f"multi-process run of {target}: rank(s) {first} failed{also} (the others were killed)"


def _read(path) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def run(target: str, processes: int, timeout: float = 120.0, args: dict | None = None,
        devices_per_process: int = 1, env: dict | None = None, liveness_s: int = 60, gpus=None, plain: bool = False):
    """Like `launch`, but waits for every process to end by itself (killing those left after `timeout`).

    `gpus`: None for CPU processes; else CUDA device indices, process `i` seeing only `gpus[i % len(gpus)]`
    (`[0]`: every process on GPU 0). `plain`: start them as a user's job does (the module docstring).

    Returns `[(exit status, log, time.time() at which its exit was seen), ...]` per rank; a process killed at
    the timeout has status None.
    """
    procs, logs = _start(target, processes, args, devices_per_process, env, liveness_s, gpus, plain)
    ended = [None] * processes
    codes = [None] * processes
    try:
        deadline = time.monotonic() + timeout
        while any(e is None for e in ended) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i], codes[i] = time.time(), p.returncode
            time.sleep(0.05)
    finally:
        _kill(procs)
    return [(c, _read(path), e) for c, path, e in zip(codes, logs, ended)]


def launch(target: str, processes: int, timeout: float = 120.0, args: dict | None = None,
           devices_per_process: int = 1, env: dict | None = None, liveness_s: int = 60) -> list[str]:
    """Runs `target` ("path/to/file.py:function" or "package.module:function") in `processes` processes.

    Returns every rank's log. Raises AssertionError (with every rank's log) if one fails or the whole
    run outlives `timeout` seconds. `liveness_s`: the heartbeat / shutdown timeout (`runtime.liveness`).
    """
    procs, logs = _start(target, processes, args, devices_per_process, env, liveness_s)
    try:
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                time.sleep(0.5)  # let the failing rank's output land
                _kill(procs)
                raise AssertionError(_report(_failure_headline(target, failed, [_read(path) for path in logs]),
                                             procs, logs))
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                stuck = [i for i, c in enumerate(codes) if c is None]
                _kill(procs)
                raise AssertionError(_report(
                    f"multi-process run of {target}: timed out after {timeout:.0f} s; rank(s) {stuck} "
                    f"still running (killed)", procs, logs))
            time.sleep(0.1)
        out = []
        for path in logs:
            with open(path, errors="replace") as f:
                out.append(f.read())
        return out
    finally:
        _kill(procs)
