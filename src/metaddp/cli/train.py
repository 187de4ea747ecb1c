"""``metaddp train``: meta-train on a task family, on one process or many.

  metaddp train sinusoid --nproc 2 --steps 2000 --out runs/sinusoid
  metaddp train digits --ways 5 --shots 1 --nproc 2
  metaddp train --resume runs/sinusoid --steps 4000      # continue, any number of processes
  metaddp train omniglot --data DIR --nnodes 1:2 --nproc 8 --rdzv-endpoint HOST:29500 \
      --max-restarts 3 --resume auto --out DIR     # on every machine: an elastic run

--nnodes MIN:MAX starts this machine's share of a run over several machines (the same command
on each, --nproc processes per machine), joined at --rdzv-endpoint (the machine there hosts
the rendezvous) under --rdzv-id; a run that loses a machine continues on the ones left after a
restart (--max-restarts). At the end each machine's agent waits at most 10 s for the others.
Under torchrun (python -m metaddp train ...) the same run works, but its agents wait 300 s
where another machine's agent ended before its processes, and log a traceback.

Settings come from the defaults, then the task's own defaults, then --config FILE (TOML, the
option names with underscores, all at top level or all under [train]), then the flags given.
Every setting is checked before anything is created. The output folder receives
config.toml/json, metrics.csv, checkpoint.pt (every --checkpoint-every steps, written
atomically), summary.json and plots/*.png; while a run writes it, .lock names the run's host
and PID and refuses a second run there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import traceback
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._output import quoted
from ..algorithms import having
from ..distributed import DEFAULT_TIMEOUT, keep_freed_memory
from ..distributed.launch import oversubscribed
from ..tasks import FAMILIES, family_class
from ..train import (
    CHECKPOINT,
    EXIT_STOPPED,
    RunLock,
    TrainConfig,
    begin,
    check_folder,
    checkpoint_exists,
    checkpoint_step,
    checkpoint_world,
    launch,
    launch_nodes,
    one_line_warning,
    quiet_latest,
    read_toml,
    saved_config,
    settings_before,
    under_torchrun,
    unsaved_start,
    way_back,
    worker,
)

S = argparse.SUPPRESS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="meta-train on a task family (" + ", ".join(FAMILIES) + ")",
        description=__doc__,
        epilog="each task's defaults (none given: the general default; flags and --config "
        "override them; --show-settings prints a run's resolved settings):\n"
        + TrainConfig.defaults_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "task",
        nargs="?",
        choices=FAMILIES,
        default=None,
        help="task family (taken from the run when resuming)",
    )
    g = p.add_argument_group("what to train (default: the task's own, in the table below)")
    add_settings(g, "train")
    g = p.add_argument_group("evaluation and output")
    add_settings(g, "output")
    g.add_argument("--out", default=None, help="output folder (default: runs/TASK-ALGORITHM)")
    g.add_argument(
        "--resume",
        metavar="DIR",
        default=None,
        help="continue the run in DIR; 'auto' continues the run in --out if it has a "
        "checkpoint, else starts it (for restarts by a launcher or a scheduler)",
    )
    g.add_argument("--force", action="store_true", help="replace a previous run in --out")
    g.add_argument("--config", metavar="FILE", default=None, help="TOML file of settings")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--show-settings",
        action="store_true",
        help="check everything a run checks before it starts (the settings, the processes, "
        "--out, the data, the algorithm built on the task's network), print every resolved "
        "setting, and exit without training. What a run finds only as it trains (a step that "
        "diverges, a device out of memory, a CUDA graph it cannot record) it cannot check",
    )
    g.add_argument(
        "--debug", action="store_true", help="show the full traceback of an error in the settings"
    )
    g = p.add_argument_group("processes")
    g.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local processes to start (default: 1; a resumed run: the count it ran on); with "
        "--nnodes, on each machine",
    )
    g.add_argument(
        "--nnodes",
        default=None,
        metavar="MIN:MAX",
        help="run over several machines: start the same command on each; the run starts "
        "once MIN have joined, takes up to MAX, and continues on the ones left when one is "
        "lost (with --max-restarts and --resume auto --out DIR on a shared file system). "
        "Needs --rdzv-endpoint",
    )
    g.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="with --nnodes: where the machines meet; the machine at HOST hosts the "
        "rendezvous (losing it ends the run)",
    )
    g.add_argument(
        "--rdzv-id",
        default="metaddp",
        metavar="ID",
        help="with --nnodes: the run's name at the rendezvous, the same on every machine "
        "(default: %(default)s; give each run that shares an endpoint its own)",
    )
    add_settings(g, "processes")
    g.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl with GPUs, gloo otherwise",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT.total_seconds(),
        metavar="SECONDS",
        help="longest wait for the other processes at any collective before every process "
        "stops with an error (default: %(default)g)",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="with --nproc or --nnodes: restart all processes this many times after one fails "
        "or a machine is lost; they continue from the latest checkpoint (default: 0)",
    )
    p.set_defaults(func=main)


def add_settings(g: argparse._ArgumentGroup, flags: str) -> None:
    """The flags of the settings listed in the help's group ``flags``, from the fields of
    :class:`TrainConfig` (``metaddp.train.setting``). A flag not given sets nothing, so that
    the defaults, the task's defaults and ``--config`` apply in turn."""
    for f in dataclasses.fields(TrainConfig):
        m = f.metadata
        if m["flags"] != flags:
            continue
        kind = str(f.type).split(" | ")[0]
        how: dict[str, Any] = (
            {"action": argparse.BooleanOptionalAction if m["negatable"] else "store_true"}
            if kind == "bool"
            else {"type": {"int": int, "float": float}.get(kind), "choices": m["choices"]}
        )
        if m["metavar"] is not None:
            how["metavar"] = m["metavar"]
        g.add_argument("--" + f.name.replace("_", "-"), default=S, help=m["help"], **how)


class UsageError(Exception):
    pass


# What a user's settings, files or machine can raise before a run starts: one line, status 2.
USER_ERRORS = (UsageError, ValueError, ImportError, OSError)
MOST_TIMEOUT_S = 1e7  # about 16 weeks


def user_error(e: BaseException) -> int:
    print(f"metaddp train: error: {e}", file=sys.stderr)
    return 2


def check_processes(args: argparse.Namespace) -> None:
    """What can be checked before any process group exists: --nproc and --backend."""
    import torch

    if under_torchrun() and args.nproc is not None:
        raise UsageError("already started by torchrun; drop --nproc")
    if under_torchrun() and args.nnodes is not None:
        raise UsageError("already started by torchrun; drop --nnodes")
    if args.nnodes is None and args.rdzv_endpoint is not None:
        raise UsageError("--rdzv-endpoint is where the machines of --nnodes meet: give --nnodes")
    if args.nproc is None:
        args.nproc = 1
    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.max_restarts and args.nproc == 1 and not under_torchrun() and args.nnodes is None:
        raise UsageError(
            "--max-restarts restarts the processes that --nproc starts: give --nproc 2 or more "
            "(one process runs without a launcher)"
        )
    if not 0.1 <= args.timeout <= MOST_TIMEOUT_S:
        # Below it no collective completes; above it (or infinite) the store's millisecond
        # count overflows.
        raise UsageError(
            f"--timeout must be between 0.1 and {MOST_TIMEOUT_S:g} seconds, got {args.timeout}"
        )
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise UsageError(
            "--backend nccl needs CUDA GPUs, and torch finds none on this machine: use "
            "--backend gloo, or leave --backend out"
        )


def worlds(args: argparse.Namespace) -> tuple[int, ...]:
    """Check the flags that start processes and return the numbers of processes the run may
    run on: under torchrun its world; with ``--nnodes MIN:MAX``, ``--nproc`` on each of MIN
    to MAX machines; else ``--nproc`` (a resume: the count it ran on, where not given)."""
    if under_torchrun():
        check_processes(args)
        return (int(os.environ["WORLD_SIZE"]),)
    if args.nnodes is not None:
        least, most = nnodes_range(args.nnodes)
        if args.rdzv_endpoint is None:
            raise UsageError("--nnodes needs --rdzv-endpoint HOST:PORT, the same on every machine")
        check_processes(args)
        return tuple(args.nproc * n for n in range(least, most + 1))
    if args.nproc is None:
        args.nproc = recorded_world(args)  # a resume keeps the run's process count
    check_processes(args)
    return (args.nproc,)


def settings(args: argparse.Namespace, *world: int) -> tuple[TrainConfig, Path, bool]:
    """Resolve the run's settings, output folder and whether it resumes, for each of the
    ``world`` process counts it may run on; check them all, the folder, the data and the
    algorithm built on the task's network, and create nothing. A run and ``--show-settings``
    both check with this."""
    flags = {
        k: v
        for k, v in vars(args).items()
        if k in TrainConfig.names() and not (k == "task" and v is None)
    }
    where = args.resume
    if where == "auto":  # continue the run in --out if it has a checkpoint, else start it
        if args.out is None:
            raise UsageError("--resume auto needs --out FOLDER: the run to continue or start")
        where = args.out if checkpoint_exists(Path(args.out) / CHECKPOINT) else None
    resume = where is not None
    values: dict[str, Any] = {}
    if resume and args.force:
        raise UsageError(
            "--force replaces the run in --out and --resume continues it: give one of them"
        )
    if resume:
        out = Path(where)
        if args.out is not None and Path(args.out).resolve() != out.resolve():
            raise UsageError(
                f"--resume {where} continues in its own folder; drop --out "
                f"{args.out} (or copy the run there and resume that)"
            )
        check_folder(out, resume=True, force=False)
        saved = saved_config(out)
        if "task" in flags and saved.get("task") not in (None, flags["task"]):
            raise UsageError(
                f"the run in {out} is a {saved['task']} run; this command trains "
                f"{flags['task']}: drop the task name to continue it, or give another --out"
            )
        # A run from before a setting existed resumes as it ran (no BatchNorm, SGD steps...).
        values.update({**settings_before(saved), **saved})
    # What this command sets (its file, then its flags), beside what a resumed run recorded.
    # The command's own flags (--nproc, --out ...), which a config file does not hold.
    launch_flags = [k for k in vars(args) if k not in (*TrainConfig.names(), "func", "command")]
    asked = {**(read_toml(args.config, launch_flags) if args.config else {}), **flags}
    values.update(asked)
    if "task" not in values:
        raise UsageError("name a task: metaddp train {" + ",".join(FAMILIES) + "} [options]")
    cfg = TrainConfig(**values).resolved()
    for n in world:
        cfg.check_for(asked, n)
    if cfg.cuda_graphs and args.backend == "gloo" and (under_torchrun() or max(world) > 1):
        raise UsageError(  # else refused at the first step, the processes started
            "cuda_graphs records CUDA graphs, and --backend gloo runs the processes on the CPU: "
            "use --backend nccl, or drop cuda_graphs (--no-cuda-graphs)"
        )
    if not resume:
        out = (
            Path(args.out) if args.out is not None else Path("runs") / f"{cfg.task}-{cfg.algorithm}"
        )
        if not args.force and unsaved_start(out, cfg.identity()):
            # This very run, stopped or failed before its first checkpoint (a launcher's
            # restart, or the same command again): nothing in the folder to keep.
            args.force = True
        check_folder(out, resume=False, force=args.force)
    family_class(cfg.task).check_data(cfg.data)
    family = cfg.family()  # building it runs the family's checks (e.g. enough classes for --ways)
    # ... and building the algorithm its constructor's (a method that cannot rebuild its steps),
    # and what it says of sharded meta-parameters.
    cfg.check_algorithm(cfg.build(family.model()))
    if resume:
        # A run still going in the folder rotates its checkpoints under us: say that the
        # folder is busy before reading them (begin() takes the lock for good).
        RunLock.acquire(out).release()
        step = quiet_latest(out, cfg.identity())["step"]
        if step > cfg.steps:
            raise UsageError(
                f"the checkpoint in {out} is at step {step}, beyond --steps "
                f"{cfg.steps}: give a larger --steps"
            )
    return cfg, out, resume


def recorded_world(args: argparse.Namespace) -> int | None:
    """The number of processes the run to resume ran on (``None``: not a resume, or a
    checkpoint that predates the record)."""
    where = args.resume
    if where == "auto":
        where = args.out if args.out is not None else None
    if where is None or not checkpoint_exists(Path(where) / CHECKPOINT):
        return None
    return checkpoint_world(Path(where))


def world_change(before: int, now: int, cfg: TrainConfig) -> str:
    """One line for a resume on another number of processes, with what it costs."""
    s = lambda n: f"{n} process{'es' if n > 1 else ''}"  # noqa: E731
    cost = (
        "deterministic: the same bits as on the same count"
        if cfg.deterministic
        else "the same steps, equal only to rounding"
        + (
            " (bit for bit with --deterministic)"
            if cfg.algorithm in having("deterministic")
            else ""
        )
    )
    return f"note: the run ran on {s(before)} and continues on {s(now)}: {cost}"


def report(summary: dict, cfg: TrainConfig, out: Path) -> None:
    n, k = summary["eval_tasks"], summary["eval_steps"]
    if family_class(cfg.task).run:  # two training runs: plain, and with what was learned
        print(f"\ntest on {n} held-out batches after a training run of {k} steps:")
        print(
            f"  accuracy: plain training {summary['test_acc_before']:.4f}, with the learned "
            f"weighting {summary['test_acc_after']:.4f} ± {summary['test_acc_after_ci']:.4f}"
        )
        print(
            f"  loss: plain training {summary['test_before']:.4f}, with the learned "
            f"weighting {summary['test_after']:.4f} ± {summary['test_after_ci']:.4f}"
        )
        _files(summary, out)
        return
    if k == 0 and "test_acc_after" in summary:  # a network scored as trained (noisy-digits)
        print(f"\ntest on {n} held-out batches, mean and 95% CI:")
        print(
            f"  accuracy {summary['test_acc_after']:.4f} ± {summary['test_acc_after_ci']:.4f}, "
            f"loss {summary['test_after']:.4f} ± {summary['test_after_ci']:.4f}"
        )
        _files(summary, out)
        return
    what = "tasks of held-out classes" if "test_acc_after" in summary else "held-out tasks"
    print(f"\nmeta-test on {n} {what}, {k} adaptation step(s), mean and 95% CI:")
    if "test_acc_after" in summary:
        print(
            f"  accuracy before adaptation {summary['test_acc_before']:.4f}, after "
            f"{summary['test_acc_after']:.4f} ± {summary['test_acc_after_ci']:.4f}"
        )
    if "test_acc_baseline" in summary:
        print(
            f"  pixel nearest-mean baseline on the same tasks "
            f"{summary['test_acc_baseline']:.4f} ± {summary['test_acc_baseline_ci']:.4f}"
        )
    name = summary.get("metric", "loss")
    print(
        f"  query {name} before adaptation {summary['test_before']:.4f}, after "
        f"{summary['test_after']:.4f} ± {summary['test_after_ci']:.4f}"
    )
    _files(summary, out)


def _files(summary: dict, out: Path) -> None:
    for p in summary.get("plots", []):
        print(f"  plot: {p}")
    print(
        f"  metrics: {out / 'metrics.csv'}; checkpoint: {out / CHECKPOINT} "
        f"(continue with: metaddp train --resume {quoted(out)} --steps N)"
    )


def finish(outcome: dict | None, cfg: TrainConfig, out: Path) -> int:
    """Report a run's outcome (rank 0) and return the exit status."""
    if outcome is None:
        return 0
    if "error" in outcome:
        print(f"metaddp train: {outcome['error']}", file=sys.stderr)
        return int(outcome["code"])
    if "stopped" in outcome:
        halt = outcome["stopped"]
        return stopped(halt["signal"], halt["step"], out, held=halt.get("held", False))
    report(outcome["summary"], cfg, out)
    return 0


def torchrun_main(args: argparse.Namespace) -> int:
    """Under ``torchrun``: join the group first, then rank 0 checks the settings, takes the
    folder's lock and prepares it, and tells every rank the outcome (so no rank sees the
    folder rank 0 is writing). Only rank 0 reports."""
    import torch.distributed as dist

    from ..distributed import default_backend, init, rank, shutdown

    try:
        worlds(args)  # on every rank, before a backend that cannot work is used
    except UsageError as e:
        if args.debug:
            raise
        return user_error(e) if os.environ["RANK"] == "0" else 2
    backend = args.backend or default_backend()
    init(backend, timeout=args.timeout)
    me = rank()  # asked now: after shutdown() every process would say 0
    message: list[Any] = [None]
    lock: contextlib.AbstractContextManager = contextlib.nullcontext()
    if me == 0:
        try:
            cfg, out, resume = settings(args, int(os.environ["WORLD_SIZE"]))
            lock = begin(out, cfg, resume, args.force)
            recorded = checkpoint_world(out) if resume else None
            message = [("ok", cfg.to_dict(), str(out), resume, recorded)]
        except USER_ERRORS as e:
            if args.debug:  # the other ranks wait for the outcome: show it, then tell them
                traceback.print_exc()
            message = [("error", str(e))]
    dist.broadcast_object_list(message, src=0)
    if message[0][0] == "error":
        shutdown()
        return user_error(message[0][1]) if me == 0 else 2
    _, cfg_dict, out, resume, recorded = message[0]
    world = int(os.environ["WORLD_SIZE"])
    if me == 0 and resume and recorded is not None and recorded != world:
        print(
            f"metaddp train: {world_change(recorded, world, TrainConfig(**cfg_dict))}",
            file=sys.stderr,
        )
    with lock:
        try:
            outcome = worker(cfg_dict, out, resume, backend, 0, not args.no_progress, args.timeout)
        except Exception as e:  # one line; the launcher restarts the processes if it may
            if args.debug:
                raise
            left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            )
            then = (
                f"the launcher restarts it ({left} restart(s) left)"
                if left > 0
                else "no restart left"
            )
            print(
                f"metaddp train: process {me} failed: {_first_line(e)}; {then}; "
                f"{_kept(checkpoint_step(Path(out)), Path(out))}",
                file=sys.stderr,
                flush=True,
            )
            return 1
    return finish(outcome, TrainConfig(**cfg_dict), Path(out))


def nnodes_range(text: str) -> tuple[int, int]:
    """``--nnodes``: ``N`` or ``MIN:MAX`` machines."""
    lo, _, hi = text.partition(":")
    try:
        least, most = int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"--nnodes takes N or MIN:MAX machines, like 1:2; got {text!r}") from None
    if not 1 <= least <= most:
        raise UsageError(f"--nnodes needs 1 <= MIN <= MAX, got {text!r}")
    return least, most


def nodes_main(args: argparse.Namespace) -> int:
    """``--nnodes``: this machine's agent, whose processes run the command as under torchrun
    (rank 0 checks the settings and takes the folder); it reports only a failure."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    try:
        least, most = nnodes_range(args.nnodes)
        worlds(args)
    except UsageError as e:
        if args.debug:
            raise
        return user_error(e)
    launched = argparse.Namespace(
        **{**vars(args), "nproc": None, "nnodes": None, "rdzv_endpoint": None}
    )
    try:
        launch_nodes(
            processes_main,
            (launched,),
            min_nodes=least,
            max_nodes=most,
            nproc=args.nproc,
            endpoint=args.rdzv_endpoint,
            run_id=args.rdzv_id,
            max_restarts=args.max_restarts,
        )
    except SignalException as e:
        # Passed on to the processes, which end their step, write a checkpoint and say so.
        print(f"metaddp train: stopped by {signal_name(e.sigval)}", file=sys.stderr)
        return EXIT_STOPPED
    except ChildFailedError as e:
        if args.debug:
            print(e, file=sys.stderr)
        first = e.get_first_failure()[0]
        failure = e.failures[first]
        if failure.exitcode == EXIT_STOPPED:
            return EXIT_STOPPED  # stopped by a signal to the processes: they said so
        error = _recorded_error(failure)
        how = (
            f"was killed by {failure.signal_name()}"
            if failure.exitcode < 0
            else f"exited with status {failure.exitcode}"
            if error is None
            else f"failed: {error}"
        )
        print(f"metaddp train: process {first} {how}; no restart left", file=sys.stderr)
        return 1
    except RendezvousError as e:  # the endpoint unreachable, or too few machines in time
        if args.debug:
            raise
        print(f"metaddp train: the machines did not meet: {_first_line(e)}", file=sys.stderr)
        return 1
    return 0


def processes_main(args: argparse.Namespace) -> None:
    """What each process that ``--nnodes`` starts runs: the command, as under torchrun."""
    keep_freed_memory()
    status = main(args)
    if status:
        raise SystemExit(status)


def show_settings(args: argparse.Namespace) -> int:
    """``--show-settings``: check everything a run checks before it starts (:func:`settings`),
    print every resolved setting, and run nothing (under torchrun, on rank 0)."""
    counts = worlds(args)
    if os.environ.get("RANK", "0") != "0":
        return 0
    cfg, _, _ = settings(args, *counts)
    width = max(len(k) for k in TrainConfig.names())
    every = [
        f"  {k.ljust(width)}  {'(not set)' if v is None else v}" for k, v in cfg.to_dict().items()
    ]
    print("\n".join([*cfg.lines(), "every setting:", *every]))
    return 0


def main(args: argparse.Namespace) -> int:
    warnings.formatwarning = one_line_warning  # e.g. a damaged checkpoint that falls back
    if getattr(args, "show_settings", False):
        try:
            return show_settings(args)
        except USER_ERRORS as e:
            if args.debug:
                raise
            return user_error(e)
    if args.nnodes is not None and not under_torchrun():
        return nodes_main(args)
    if under_torchrun():
        return torchrun_main(args)
    try:
        asked = args.nproc
        cfg, out, resume = settings(args, *worlds(args))
        lock = begin(out, cfg, resume, args.force)
    except USER_ERRORS as e:
        if args.debug:
            raise
        return user_error(e)
    recorded = recorded_world(args) if resume and asked is not None else None
    if recorded is not None and asked != recorded:
        print(f"metaddp train: {world_change(recorded, asked, cfg)}", file=sys.stderr)
    if crowded := oversubscribed(args.nproc):
        print(f"metaddp train: warning: {crowded}", file=sys.stderr)
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    if (asked_threads := os.environ.get("OMP_NUM_THREADS", "")).isdigit() and int(asked_threads):
        threads = int(asked_threads)  # the user's own choice (several runs side by side)
    common = (
        cfg.to_dict(),
        str(out),
        resume,
        args.backend,
        threads,
        not args.no_progress,
        args.timeout,
    )
    with lock:  # held by this process while it, or the processes it starts, write the run
        if args.nproc == 1:
            try:
                outcome = worker(*common)
            except Exception as e:  # a full disk, an unwritable folder, a bug: one line
                if args.debug:
                    raise
                return failed_here(e, out)
            except KeyboardInterrupt:  # a second Ctrl-C: the step was left unfinished
                if args.debug:
                    raise
                print(
                    "metaddp train: interrupted by a second Ctrl-C before the step ended; "
                    f"{_kept(checkpoint_step(out), out)}",
                    file=sys.stderr,
                )
                return 130
        else:
            from torch.distributed.elastic.multiprocessing.api import SignalException
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

            try:
                outcome = launch(args.nproc, args.max_restarts, *common)
            except SignalException as e:
                # The launcher was told to stop and passed the signal on: the processes end
                # their step and write a checkpoint, unless a step outlasts the launcher's
                # grace period (30 s) and they are killed. So the line names the step of the
                # checkpoint the folder holds, without saying that this stop wrote it.
                step = checkpoint_step(out)
                outcome = {"stopped": {"signal": signal_name(e.sigval), "step": step, "held": True}}
            except ChildFailedError as e:
                if args.debug:
                    print(e, file=sys.stderr)
                return failed(e.failures, e.get_first_failure()[0], out)
    return finish(outcome, cfg, out)


def stopped(by: str, step: int | None, out: Path, held: bool = False) -> int:
    """Say that a stop request ended the run, and what the folder keeps (``held``: the
    checkpoint there, which the stop may not have written)."""
    if held and step is not None:
        print(
            f"metaddp train: stopped by {by}; the last checkpoint holds step {step}. "
            f"Continue with: metaddp train --resume {quoted(out)}",
            file=sys.stderr,
        )
    elif step is None:
        print(
            f"metaddp train: stopped by {by} before its first checkpoint: nothing was saved. "
            "Start it again with the same command",
            file=sys.stderr,
        )
    else:
        print(
            f"metaddp train: stopped by {by} after step {step}; checkpoint written. Continue "
            f"with: metaddp train --resume {quoted(out)}",
            file=sys.stderr,
        )
    return EXIT_STOPPED


def failed(failures: Mapping[int, Any], first: int, out: Path) -> int:
    """One line for processes the launcher saw end badly (and no restart left), with what the
    folder keeps; returns the exit status."""
    step = checkpoint_step(out)
    if all(f.exitcode == EXIT_STOPPED for f in failures.values()):
        # A stop signal sent to the processes alone: they ended their step and checkpointed.
        return stopped("a signal to its processes", step, out)
    failure = failures[first]
    error = _recorded_error(failure)
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    elif error is not None:
        how = f"failed: {error}"
    else:
        how = f"exited with status {failure.exitcode}"
    print(f"metaddp train: process {first} {how}; {_kept(step, out)}", file=sys.stderr)
    return 1


def failed_here(e: Exception, out: Path) -> int:
    """One line for an error that ended a run on this process (``--debug`` shows its
    traceback); returns the exit status."""
    print(
        f"metaddp train: failed: {_first_line(e)}; {_kept(checkpoint_step(out), out)}",
        file=sys.stderr,
    )
    return 1


def _kept(step: int | None, out: Path) -> str:
    return way_back(step, out)


def _first_line(e: BaseException | str) -> str:
    """An error's first line (a collective's error carries a C++ stack after it), shortened."""
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= 400 else line[:397] + "..."


def _recorded_error(failure: Any) -> str | None:
    """The exception a process ended with, as the launcher recorded it (its error file)."""
    message = getattr(failure, "message", None)
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str) or not message or "To enable traceback" in message:
        return None
    return _first_line(message)


def signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name
