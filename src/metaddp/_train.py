"""The training loop behind ``metaddp train``: the same on one process or many.

Outer step ``t`` trains on tasks ``t * B .. t * B + B - 1`` of the training stream (``B`` the
meta-batch); each process takes its part through the mesh (tasks over the task axis, each
task's samples over the sample axis), computes its share of the meta-loss, and
:class:`metaddp.MetaDDP` sums the meta-gradients. Because tasks are functions of their index
and gradients are exact sums, the run follows the same trajectory on any number of processes
(to rounding), and a resumed run needs only the step number to continue the task stream.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import _checkpoint
from ._algorithms import build
from ._data import shard_range
from ._evaluate import evaluate, to
from ._metrics import MetricsLog
from ._runconfig import TrainConfig, toml_text
from ._share import global_value
from ._world import rank
from ._wrapper import MetaDDP
from .scenarios import mesh_for
from .tasks import make

CHECKPOINT = "checkpoint.pt"
CONFIG_JSON = "config.json"
CONFIG_TOML = "config.toml"
# What a run writes; --force removes exactly these before a new run starts.
ARTIFACTS = (CHECKPOINT, CONFIG_JSON, CONFIG_TOML, "metrics.csv", "summary.json", "plots",
             "tensorboard")


class RunFolderError(ValueError):
    """The output folder cannot hold this run without losing something."""


def check_folder(out: Path, resume: bool, force: bool) -> None:
    """Refuse to start a new run over an earlier one (unless ``force``), or to resume nothing."""
    out = Path(out)
    if resume:
        if not (out / CHECKPOINT).exists():
            raise RunFolderError(f"{out} holds no {CHECKPOINT}: nothing to resume")
        return
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise RunFolderError(
            f"{out} is not empty (it holds {', '.join(sorted(p.name for p in out.iterdir())[:4])}"
            f"...). Continue that run with --resume {out}, choose another --out, or pass "
            "--force to replace it")


def prepare_folder(out: Path, cfg: TrainConfig, resume: bool, force: bool) -> None:
    """Create the folder (clearing a previous run's files with ``force``); write the config."""
    import shutil

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if force and not resume:
        for name in ARTIFACTS:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    (out / "plots").mkdir(exist_ok=True)
    _checkpoint.atomic_write(out / CONFIG_TOML, lambda f: f.write(toml_text(cfg.to_dict()).encode()))
    _checkpoint.atomic_write(out / CONFIG_JSON,
                             lambda f: f.write(json.dumps(cfg.to_dict(), indent=2).encode()))


def saved_config(out: Path) -> dict[str, Any]:
    """The settings a run recorded in its folder (for ``--resume``)."""
    path = Path(out) / CONFIG_JSON
    try:
        return TrainConfig.from_mapping(json.loads(path.read_text()), str(path))
    except (OSError, json.JSONDecodeError) as e:
        raise RunFolderError(f"cannot read the settings of the run in {out} ({e})") from None


def device_for(backend: str | None) -> torch.device:
    if backend != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def train(cfg: TrainConfig, out: str | Path, *, resume: bool = False, progress: bool = True,
          backend: str | None = None) -> dict[str, Any]:
    """Train on every process of the (already initialised) process group.

    Args:
        cfg: the resolved settings (:meth:`TrainConfig.resolved`).
        out: the output folder (prepared by :func:`prepare_folder` on rank 0).
        resume: continue from ``out/checkpoint.pt``.
        progress: show a progress bar on rank 0.
        backend: the process group's backend ("gloo", "nccl") or ``None`` for one process.

    Returns:
        On every rank: ``losses`` (global meta-loss per step trained here), ``final`` (last
        evaluation), ``start`` (first step trained here) and ``weights`` (the final
        meta-parameters, on the CPU).
    """
    out = Path(out)
    me = rank()
    device = device_for(backend)
    dtype = getattr(torch, cfg.dtype)
    family = make(cfg.task, shots=cfg.shots, query=cfg.query, ways=cfg.ways, hidden=cfg.hidden,
                  data=cfg.data)
    mesh = mesh_for(cfg.layout)

    torch.manual_seed(cfg.seed)
    algorithm = build(cfg.algorithm, family.model(), cfg).to(device=device, dtype=dtype)
    optimizer = torch.optim.Adam(algorithm.parameters(), lr=cfg.outer_lr)
    start = 0
    if resume:
        state = _checkpoint.load(out / CHECKPOINT, cfg.identity(), map_location=device)
        algorithm.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if start > cfg.steps:
            raise _checkpoint.CheckpointError(
                f"the checkpoint is at step {start}, beyond --steps {cfg.steps}: raise --steps")
    ddp = MetaDDP(algorithm, mesh)

    log = MetricsLog(out, start) if me == 0 else None
    bar = progress_bar(cfg, start) if me == 0 and progress else None

    def run_eval() -> dict[str, float]:
        return evaluate(algorithm, family, mesh, ddp.reduce, seed=cfg.seed, n_tasks=cfg.eval_tasks,
                        steps=cfg.eval_steps, dtype=dtype, device=device)

    def save(step: int) -> None:
        if me == 0:
            _checkpoint.save(out / CHECKPOINT, step=step, config=cfg.to_dict(),
                             model=algorithm.state_dict(), optimizer=optimizer.state_dict())

    losses: list[float] = []
    last_eval: dict[str, float] = {}
    # Elapsed seconds continue from the last row kept when resuming.
    t0 = time.perf_counter() - (log.seconds if log is not None else 0.0)
    B = cfg.meta_batch
    try:
        for step in range(start, cfg.steps):
            batch = range(B * step, B * (step + 1))  # global task indices of this step
            r = shard_range(B, mesh.task_index, mesh.tasks)
            tasks = [to(family.task(cfg.seed, i).split(mesh.sample_index, mesh.samples), dtype, device)
                     for i in batch[r.start: r.stop]]
            optimizer.zero_grad(set_to_none=True)
            loss = algorithm.meta_loss(tasks, family.loss, B, reduce=ddp.reduce)
            loss.backward()
            ddp.sync_grads()
            optimizer.step()
            value = float(global_value(loss, mesh.group))
            losses.append(value)
            done = step + 1
            row: dict[str, float] = {"step": done, "meta_loss": value,
                                     "seconds": time.perf_counter() - t0}
            if done == cfg.steps or (cfg.eval_every and done % cfg.eval_every == 0):
                last_eval = run_eval()
                row.update(last_eval)
            if log is not None:
                log.write(row)
            if done == cfg.steps or done % cfg.checkpoint_every == 0:
                save(done)
            if bar is not None:
                shown = {"loss": f"{value:.4g}"}
                if "test_acc_after" in last_eval:
                    shown["test acc"] = f"{last_eval['test_acc_after']:.3f}"
                elif last_eval:
                    shown["test " + ("mse" if cfg.task == "sinusoid" else "loss")] = \
                        f"{last_eval['test_after']:.4g}"
                bar.set_postfix(shown, refresh=False)
                bar.update(1)
        if not last_eval:  # resumed at the last step: evaluate what the checkpoint holds
            last_eval = run_eval()
    finally:  # the progress bar and metrics file close even when a step raises
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
    summary = {"step": cfg.steps, "eval_tasks": cfg.eval_tasks, "eval_steps": cfg.eval_steps,
               **last_eval}
    if me == 0:
        _checkpoint.atomic_write(out / "summary.json",
                                 lambda f: f.write(json.dumps(summary, indent=2).encode()))
        summary["plots"] = write_plots(out, cfg, family, algorithm)
    if dist.is_initialized():
        dist.barrier()
    weights = {k: v.detach().cpu().clone() for k, v in algorithm.state_dict().items()}
    return {"losses": losses, "final": last_eval, "start": start, "weights": weights,
            "summary": summary}


def write_plots(out: Path, cfg: TrainConfig, family, algorithm) -> list[str]:
    """The run's PNG figures (none when matplotlib is missing); returns their paths."""
    from . import _plots
    from ._metrics import read

    if not _plots.available():
        return []
    paths = [out / "plots" / "training.png"]
    _plots.training_curves(read(out / "metrics.csv"), paths[0],
                           classification=family.classification,
                           title=f"{cfg.algorithm} on {cfg.task}")
    if cfg.task == "sinusoid":
        paths.append(out / "plots" / "adaptation.png")
        _plots.sinusoid_adaptation(algorithm, family, seed=cfg.seed, index=0, steps=(1, 10),
                                   path=paths[1])
    return [str(p) for p in paths]



def progress_bar(cfg: TrainConfig, start: int):
    """A tqdm bar (steps, rate, ETA) when tqdm is installed (the ``train`` extra), else None."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=cfg.steps, initial=start, desc=f"{cfg.algorithm} {cfg.task}", unit="step",
                dynamic_ncols=True)
