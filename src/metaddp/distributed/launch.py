"""Run a function on N local processes joined in one process group, and collect the results.

For tests, ``metaddp verify`` and quick experiments on one machine. Training on several
machines uses ``torchrun``, whose environment :func:`metaddp.init` reads.
"""

from __future__ import annotations

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
) -> None:
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
        shutdown()


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
    with tempfile.TemporaryDirectory(prefix="metaddp-") as out_dir:
        mp.start_processes(
            _entry,
            args=(fn, nproc, free_port(), backend, timeout_s, threads, out_dir, args),
            nprocs=nproc,
            start_method="spawn",
        )
        return [
            torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(nproc)
        ]
