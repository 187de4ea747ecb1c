"""Run a function on N local processes joined in one process group, and collect the results.

For tests, ``metaddp verify`` and quick experiments on one machine. Training on several
machines uses ``torchrun``, whose environment :func:`metaddp.init` reads.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from ._mesh import init, shutdown


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_server_environ: dict[str, str] | None = None
"""The environment the fork server started with: what its children start from."""


def _start_method() -> str:
    """How ranks start: forked from a server that imported torch and metaddp once (a world
    of two starts in 0.1 s instead of 3.6 s by spawning, measured), else spawned. Either way
    a rank starts from a fresh interpreter's state, not from the caller's. The server also
    imports ``torch._dynamo``, which a ``torch.optim`` optimizer imports when it is first
    built: 1.2 s of every rank's first optimizer at two processes, 0 s preloaded (measured)."""
    global _server_environ
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    if _server_environ is None:
        multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "metaddp"])
        try:
            multiprocessing.forkserver.ensure_running()
        except OSError:  # no server here (a sandbox without its socket): spawn instead
            return "spawn"
        _server_environ = dict(os.environ)
    return "forkserver"


def started_as_now() -> str:
    """The start method for ranks that take this process's environment as they find it (torch's
    elastic launcher sets only its own variables): forked where the fork server started with
    the environment this process has now, else spawned."""
    method = _start_method()
    return method if method == "spawn" or _server_environ == dict(os.environ) else "spawn"


def _entry(
    rank: int,
    fn,
    nproc: int,
    port: int,
    backend: str,
    timeout_s: float,
    threads: int,
    out_dir: str,
    args: tuple,
    environ: dict[str, str],
) -> None:
    # The caller's environment as it is now (a forkserver child starts from the server's).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    init(backend, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        # A worker may return an error of its own while the others are still inside a
        # collective (the fault tests): leave at once, so that they learn of it.
        shutdown(wait=False)


def cores() -> int:
    """The cores this process may run on (its affinity where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def oversubscribed(nproc: int, available: int | None = None) -> str | None:
    """A warning when ``nproc`` processes would share fewer cores: each collective then waits
    for ranks the scheduler has not run (64 processes on 2 cores finish no step in minutes)."""
    available = cores() if available is None else available
    if nproc <= available:
        return None
    return (
        f"{nproc} processes on {available} core(s): every collective waits for processes "
        "that are not running, so each step is far slower than on fewer processes; the result "
        f"is the same at any count, so --nproc {available} or fewer gives it sooner"
    )


def run_local(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    threads: int | None = None,
) -> list[Any]:
    """``fn(*args)`` on ``nproc`` spawned processes; returns each rank's return value, by rank.

    ``fn`` must be importable (defined at module level). If any rank raises, the others are
    stopped and the error is re-raised here with that rank's traceback.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // nproc)
    method = _start_method()
    with tempfile.TemporaryDirectory(prefix="metaddp-") as out_dir:
        mp.start_processes(
            _entry,
            args=(
                fn,
                nproc,
                free_port(),
                backend,
                timeout_s,
                threads,
                out_dir,
                args,
                dict(os.environ),
            ),
            nprocs=nproc,
            start_method=method,
        )
        return [
            torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(nproc)
        ]
