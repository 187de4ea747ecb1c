"""Running ``metaddp train``'s work: the run folder's lock, the worker every process runs, the
local launcher with restarts, and the exit statuses a run ends with. The command line parses
and prints; this is what it starts."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import _checkpoint
from ._config import TrainConfig
from ._folder import CHECKPOINT, RunLock, check_folder, prepare_folder
from ._trainer import NonFiniteError, train

# A run whose meta-loss or meta-gradient stopped being finite (a learning rate too large).
EXIT_DIVERGED = 3
# Stopped by SIGTERM or SIGINT after writing a checkpoint: "try again later" (sysexits.h).
EXIT_STOPPED = 75


def one_line_warning(message: Warning | str, *args: Any, **kwargs: Any) -> str:
    return f"metaddp train: warning: {message}\n"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def begin(out: Path, cfg: TrainConfig, resume: bool, force: bool) -> RunLock:
    """Take the folder's writer lock, then write the run's settings there (rank 0 alone)."""
    lock = RunLock.acquire(out)
    try:
        # Temporary files of writes a kill cut short: no other run writes here now.
        for tmp in out.glob(".*.tmp") if out.is_dir() else ():
            tmp.unlink(missing_ok=True)
        # Again, now that no other run can write here: one may have ended since settings().
        check_folder(out, resume=resume, force=force)
        prepare_folder(out, cfg, resume, force)
    except BaseException:
        lock.release()
        raise
    return lock


def worker(
    cfg_dict: dict,
    out: str,
    resume: bool,
    backend: str | None,
    threads: int,
    progress: bool,
    timeout: float,
    launched: bool = False,
) -> dict | None:
    """Run on every process: join the group and train (in a folder :func:`begin` prepared).

    Returns, on rank 0, the outcome for :func:`finish`: ``{"summary": ...}``,
    ``{"stopped": ...}`` or ``{"error": message, "code": status}``; ``None`` elsewhere.
    ``launched``: started by :func:`launch`, whose launcher reports a stop itself.
    """
    import torch
    import torch.distributed as dist

    from ..distributed import default_backend, init, rank, shutdown

    # One line per warning (a damaged checkpoint that falls back, a metrics file rebuilt), and
    # from one process: every process reads the same folder.
    warnings.formatwarning = one_line_warning
    if os.environ.get("RANK", "0") != "0":
        warnings.simplefilter("ignore")
    if cfg_dict.get("deterministic"):
        # CPU kernels split their work by the thread count, which changes their bits: one
        # thread per process, whatever the number of processes.
        threads = 1
    if threads:
        torch.set_num_threads(threads)
    if under_torchrun():
        backend = backend or default_backend()
        init(backend, timeout=timeout)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart > 0:
        # Started again by the launcher after a process failed: continue from the latest
        # checkpoint of this very run (the folder is this run's: its lock is held).
        resume = _checkpoint.exists(Path(out) / CHECKPOINT)
        if os.environ.get("RANK", "0") == "0":
            most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
            step = checkpoint_step(Path(out)) if resume else None
            where = f"from step {step}" if step is not None else "from the start"
            print(
                f"metaddp train: a process failed; restart {restart} of {most}, {where}",
                file=sys.stderr,
                flush=True,
            )
    try:
        me = rank()  # asked now: after shutdown() every process would say 0
        try:
            result = train(
                TrainConfig(**cfg_dict),
                out,
                resume=resume,
                progress=progress,
                backend=backend if dist.is_initialized() else None,
            )
        except NonFiniteError as e:  # every rank finds it at the same step
            return {"error": str(e), "code": EXIT_DIVERGED} if me == 0 else None
        stopped = result.get("stopped")
    finally:
        shutdown()
    if stopped and launched:
        # The launcher, stopping too, no longer collects results: returning would keep this
        # process waiting for it until it kills it. The checkpoint is written; leave now.
        os._exit(EXIT_STOPPED)
    if me != 0:
        return None
    return {"stopped": stopped} if stopped else {"summary": result["summary"]}


def quiet_launcher() -> None:
    """Quiet torch's elastic launcher: its own warnings and error reports on a stop, restart or
    failure repeat what this command reports in one line (--debug prints the failure report)."""
    # torch gives each of its modules' loggers a level of its own, so each is quieted.
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # ... and so does its "Terminating process ... via signal SIGTERM" as it ends the others.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


def launch(nproc: int, max_restarts: int, *args: Any) -> dict | None:
    """``worker(*args)`` on ``nproc`` local processes, started by torch's elastic launcher,
    forked from a server that has imported torch and metaddp where the platform has one (a
    two-process run's start: 12 s instead of 18, measured on 2 busy cores)."""
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ..distributed.launch import started_as_now

    quiet_launcher()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"metaddp-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        start_method=started_as_now(),
    )
    results = elastic_launch(config, worker)(*args, True)
    return results[0]


# How long a machine whose processes finished waits for the other machines' agents before it
# exits. torch's agent waits 300 s, spent in full where another machine's agent ended before
# its processes (under torchrun, whose processes outlive their agent, measured 304 s after
# the last step); every result is written before this wait.
EXIT_BARRIER_S = 10.0


def launch_nodes(
    entrypoint: Callable[..., Any],
    args: tuple,
    *,
    min_nodes: int,
    max_nodes: int,
    nproc: int,
    endpoint: str,
    run_id: str,
    max_restarts: int,
    exit_barrier_s: float = EXIT_BARRIER_S,
) -> None:
    """This machine's agent of an elastic run over ``min_nodes`` to ``max_nodes`` machines:
    ``entrypoint(*args)`` on ``nproc`` processes here, joined with the other machines' through
    the c10d rendezvous at ``endpoint`` (``HOST:PORT``, hosted by the machine at that
    address), restarted up to ``max_restarts`` times when a process fails or the machines
    change. As ``torchrun`` (``torch.distributed.launcher``'s agent), but it waits
    ``exit_barrier_s`` for the other agents at the end instead of torchrun's 300 s.

    Raises ``ChildFailedError`` when a process failed with no restart left and
    ``SignalException`` when the agent was told to stop (it passed the signal on).
    """
    from torch.distributed.elastic import events, metrics
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry
    from torch.distributed.launcher.api import LaunchConfig

    quiet_launcher()
    # torch's launch_agent with the agent built here, where its exit barrier can be set
    # (LaunchConfig has no field for it); LaunchConfig supplies torchrun's other defaults.
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        max_restarts=max_restarts,
        start_method="spawn",
    )
    rdzv = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=args,
        rdzv_handler=registry.get_rendezvous_handler(rdzv),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
    )
    assert config.logs_specs is not None and config.shutdown_timeout is not None
    agent = LocalElasticAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        exit_barrier_timeout=exit_barrier_s,
        shutdown_timeout=config.shutdown_timeout,
    )
    shutdown_rdzv = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            raise ChildFailedError(
                name=getattr(entrypoint, "__name__", ""), failures=result.failures
            )
    except SignalException:
        # As torch's: the rendezvous stays open, so the other machines may go on.
        shutdown_rdzv = False
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()


def checkpoint_world(out: Path) -> int | None:
    """The number of processes the folder's latest checkpoint was written by (``None``: a
    checkpoint from before it was recorded, or none)."""
    try:
        world = quiet_latest(out, {}).get("world")
    except _checkpoint.CheckpointError:
        return None
    return int(world) if world is not None else None


def checkpoint_step(out: Path) -> int | None:
    """The step the folder's latest checkpoint holds; ``None`` without one."""
    try:
        return int(quiet_latest(out, {})["step"])
    except _checkpoint.CheckpointError:
        return None


def quiet_latest(out: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The folder's latest readable checkpoint, read for a number: a damaged newest one is
    warned about once, where the run itself loads it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return _checkpoint.load_latest(out / CHECKPOINT, identity)
