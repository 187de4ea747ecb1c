"""The training loop behind ``metaddp train``: the same on one process or many.

Outer step ``t`` trains on tasks ``t * B .. t * B + B - 1`` of the training stream (``B`` the
meta-batch); each process takes its part through the mesh (tasks over the task axis, each
task's samples over the sample axis), computes its share of the meta-loss, and
:class:`metaddp.MetaDDP` sums the meta-gradients. Because tasks are functions of their index
and gradients are exact sums, the run follows the same trajectory on any number of processes
(to rounding), and a resumed run needs only the step number to continue the task stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import _output
from .._adapt import finite_flags
from .._binding import LOCAL, bind
from .._data import Task
from .._output import quoted
from .._share import share
from ..algorithms import Algorithm, NotPositiveDefinite
from ..distributed import CapturedStep, Mesh, MetaDDP, rank
from . import _checkpoint, _sharded_state
from ._config import TrainConfig
from ._evaluate import baseline, evaluate, to
from ._folder import CHECKPOINT, way_back
from ._metrics import MetricsLog, read
from ._plots import training_curves
from ._signals import StopSignals


class NonFiniteError(FloatingPointError):
    """A step's meta-loss or meta-gradient is not finite; the message says the likely cause."""


def device_for(backend: str | None) -> torch.device:
    if backend != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _stop_signals(out: Path, saved: Callable[[], int]) -> StopSignals:
    """Stop requests noted rather than obeyed at once. Under a launcher (torchrun's, or
    --nproc's), a second Ctrl-C is its to act on: it kills the processes that have not
    stopped in its own time. On one process a second Ctrl-C ends it at once, saying what the
    folder ``out`` keeps (``saved()``: the newest checkpoint's step, 0 for none)."""

    def said() -> None:
        kept = way_back(saved() or None, out)
        print(
            f"\nmetaddp train: interrupted by a second Ctrl-C before the step ended; {kept}",
            file=sys.stderr,
            flush=True,
        )

    return StopSignals(escalate="TORCHELASTIC_RUN_ID" not in os.environ, on_second=said)


class Trainer:
    """One training run on every process of the (already initialised) process group.

    Args:
        cfg: the resolved settings (:meth:`TrainConfig.resolved`).
        out: the output folder (prepared by :func:`prepare_folder` on rank 0).
        resume: continue from ``out/checkpoint.pt``.
        backend: the process group's backend ("gloo", "nccl") or ``None`` for one process.
    """

    def __init__(
        self, cfg: TrainConfig, out: str | Path, *, resume: bool = False, backend: str | None = None
    ) -> None:
        # Set by TrainConfig.resolved() (the family's defaults), which check() enforces.
        assert cfg.shots is not None and cfg.query is not None and cfg.outer_lr is not None
        assert cfg.eval_tasks is not None
        self.cfg, self.out = cfg, Path(out)
        self.device = device_for(backend)
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        self.family = cfg.family()
        torch.manual_seed(cfg.seed)
        algorithm = cfg.build(self.family.model())
        self.algorithm = algorithm.to(device=self.device, dtype=self.dtype)
        self.algorithm.draw_seed = cfg.seed  # dropout masks: keyed by the run's seed and step
        self.optimizer = torch.optim.Adam(self.algorithm.parameters(), lr=cfg.outer_lr)
        self.start = 0
        self.layout_was: str | None = None  # the layout a resumed run ran in, where it changed
        self.changed: list[str] = []  # notes on settings a resume changed that move the run
        self.evaluate_first = False
        self.saved_metrics: torch.Tensor | None = None  # the checkpoint's copy of metrics.csv
        self.log: MetricsLog | None = None
        state: dict[str, Any] | None = None
        self.resumed_from: Path | None = None  # the checkpoint file a resume read
        if resume:
            read_from: list[Path] = []

            def verify(candidate: Path, state: dict[str, Any]) -> None:
                read_from.append(candidate)  # the last one verified is the one resumed from
                _sharded_state.verify(candidate, state)

            # A sharded state's files are checked against their checksums too (on every
            # process, which all fall back alike).
            state = _checkpoint.load_latest(
                self.out / CHECKPOINT,
                cfg.identity(),
                map_location=self.device,
                verify=verify,
            )
            self.resumed_from = read_from[-1] if read_from else self.out / CHECKPOINT
            if "model" in state:  # whole tensors (a replicated run's): cut by MetaDDP if sharded
                self.algorithm.load_state_dict(state["model"])
                if not cfg.shard:
                    self.optimizer.load_state_dict(state["optimizer"])
            self.start = state["step"]
            # The layout is not part of the run's identity (the same steps, to rounding), but a
            # change is said, as one of the process count is.
            before = state["config"].get("layout")
            self.layout_was = before if before not in (None, cfg.layout) else None
            self.changed = _changed_on_resume(state["config"], cfg, self.start)
            # A stop at a step whose evaluation was due skipped it: the resume runs it first.
            self.evaluate_first = bool(state.get("evaluation_due", False))
            self.saved_metrics = state.get("metrics")
            assert cfg.steps is not None  # resolved settings
            if self.start > cfg.steps:
                raise _checkpoint.CheckpointError(
                    f"the checkpoint is at step {self.start}, beyond --steps {cfg.steps}: "
                    "raise --steps"
                )
        self.graphs = cfg.records_graphs(self.device)
        self.learner = MetaDDP(
            self.algorithm,
            Mesh.for_layout(cfg.layout),
            deterministic=cfg.deterministic,
            chunks=cfg.chunks,
            # Overlapped sums start from backward hooks, which a replayed graph does not run.
            overlap=not self.graphs,
            shard=cfg.shard,
        )
        if state is not None and "sharded" in state:
            # A sharded run's state, read as this layout holds it (on every process).
            _sharded_state.load(
                self.out, state["sharded"], self.algorithm, self.optimizer, self.learner
            )
        elif state is not None and cfg.shard:  # Adam's whole state, cut like the weights
            self.optimizer.load_state_dict(
                _sharded_state.cut_optimizer_state(state["optimizer"], self.optimizer, self.learner)
            )
        self.captured = CapturedStep(self.learner, self.family.loss) if self.graphs else None
        self.saved = self.start  # the step of the newest checkpoint (0: none)

    def step(self, step: int, stop_requested: bool = False) -> tuple[float, bool]:
        """Outer step ``step`` (0-based): its meta-batch and one optimizer step.

        Returns the global meta-loss and whether any rank asked to stop (``stop_requested``
        travels in the same SUM as the loss, so every rank decides alike).

        Raises:
            NonFiniteError: the meta-loss or meta-gradient is not finite; the weights are left
                as they were before this step.
        """
        B = self.cfg.meta_batch
        assert B is not None
        tasks = self.learner.shard(
            B, lambda i: to(self.family.task(self.cfg.seed, B * step + i), self.dtype, self.device)
        )
        self.optimizer.zero_grad(set_to_none=True)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.outer_lr_at(step)
        self.algorithm.at_step(step)  # schedules inside the algorithm (MAML++)
        try:
            if self.captured is not None:
                loss = self.captured(tasks)  # meta_loss and its backward, replayed
            else:
                loss = self.learner.meta_loss(tasks, self.family.loss)
                loss.backward()
            grads = [p.grad for p in self.algorithm.parameters() if p.grad is not None]
            # Non-finite local gradients make the SUM non-finite on every rank, so a count
            # of them, summed with the loss and the stop votes, tells every rank alike.
            bad = (~finite_flags(grads)).sum().to(loss) if grads else torch.zeros_like(loss)
            flag = torch.full_like(loss.detach(), float(stop_requested))
            values = torch.stack([loss.detach(), flag, bad.detach()])
            # The step's one host read; a non-finite inner gradient found on this rank is
            # raised here.
            value, stops, nonfinite = self.learner.sync_grads(values)
        except NotPositiveDefinite as e:
            # iMAML's implicit system: the proximal strength, not a learning rate, decides it.
            raise NonFiniteError(
                f"training stopped at step {step + 1}: iMAML's implicit system is not positive "
                f"definite (curvature {e.curvature:.3g} along a search direction): the support "
                "loss curves down more steeply than the proximal term holds it up. Raise --lam "
                f"(now {self.cfg.lam:g}) or lower the inner learning rate (--inner-lr "
                f"{self.cfg.inner_lr:g}). The weights were not updated; {self._kept()}."
            ) from None
        except FloatingPointError as e:
            raise NonFiniteError(self._diagnose(step + 1, tasks, str(e))) from None
        if not math.isfinite(value) or nonfinite:
            raise NonFiniteError(self._diagnose(step + 1, tasks, f"the meta-loss is {value:g}"))
        self.optimizer.step()
        return value, stops > 0

    def _kept(self) -> str:
        """What a stopped run keeps, and how to go on: a resume takes the checkpoint's
        settings, so a changed learning rate is a new run. Its folder is reused (--force) only
        when it holds no checkpoint: the advice never deletes good ones."""
        if self.saved:
            return (
                f"the last checkpoint holds step {self.saved}, under these settings; it and "
                f"the ones before it stay in {quoted(self.out)} (metaddp train --resume "
                f"{quoted(self.out)} continues from it). To try again with the setting changed, "
                "run the same command with another --out: replacing this folder would delete "
                "them"
            )
        return (
            "no checkpoint was written yet; to try again, run the same command with the "
            f"setting changed and --force, which replaces {quoted(self.out)} (or give another "
            "--out to keep it)"
        )

    def _diagnose(self, step: int, tasks: Sequence[Task], what: str) -> str:
        """Why step ``step`` went non-finite: the meta-parameters (the outer learning rate) or
        the adaptation from them (the inner one). Computed on this rank alone."""
        cfg = self.cfg
        kept = self._kept()
        # Sharded: the whole weights on every process (a collective: every rank finds a step
        # non-finite alike, by the SUM of the loss and of the gradients' verdicts).
        with self.learner.gathered():
            if not all(bool(torch.isfinite(p).all()) for p in self.algorithm.parameters()):
                cause = (
                    f"the meta-parameters themselves are no longer finite: lower the outer "
                    f"learning rate (--outer-lr {cfg.outer_lr:g})"
                )
            else:
                with torch.no_grad(), self.learner.local():
                    before = [
                        share(self.family.loss(self.algorithm(t.query.x), t.query.y), t.query)
                        for t in tasks
                    ]
                if all(bool(torch.isfinite(b)) for b in before):
                    cause = (
                        f"the meta-parameters give a finite loss before adaptation but not "
                        f"after it: lower the inner learning rate (--inner-lr {cfg.inner_lr:g}) "
                        f"or the inner steps (--inner-steps {cfg.inner_steps})"
                    )
                else:
                    cause = (
                        f"the meta-parameters give a non-finite loss before any adaptation: "
                        f"lower the outer learning rate (--outer-lr {cfg.outer_lr:g})"
                    )
        return (
            f"training stopped at step {step}: {what.split(';')[0]}. Likely cause: {cause}. "
            f"The weights were not updated; {kept}."
        )

    def evaluate(self) -> dict[str, float]:
        """Meta-test on held-out tasks (mean query loss and accuracy, with 95% intervals)."""
        cfg = self.cfg
        assert cfg.eval_steps is not None and cfg.eval_tasks is not None
        run = lambda whole: evaluate(  # noqa: E731
            self.algorithm,
            self.family,
            self.learner.mesh,
            seed=cfg.seed,
            n_tasks=cfg.eval_tasks,
            steps=cfg.eval_steps,
            dtype=self.dtype,
            device=self.device,
            whole=whole,
        )
        if not cfg.deterministic:
            return run(False)
        # Whole tasks, each on one process alone: the same kernels on the same data at any
        # world size, so the same bits.
        with self.learner.gathered(), self.learner.local():
            return run(True)

    def save(self, step: int, evaluation_due: bool = False) -> None:
        """Write the checkpoint (rank 0), atomically; ``evaluation_due``: a stop skipped
        this step's evaluation. Sharded, every process writes its rows first
        (:mod:`._sharded_state`), and rank 0 then the file that names them."""
        self.saved = step
        common: dict[str, Any] = dict(
            step=step,
            config=self.cfg.to_dict(),
            evaluation_due=evaluation_due,
            world=dist.get_world_size() if dist.is_initialized() else 1,
        )
        if self.cfg.shard:
            record = _sharded_state.save(
                self.out, step, self.algorithm, self.optimizer, self.learner
            )
            if rank() == 0:
                metrics = None if self.log is None else self.log.history()
                _checkpoint.save(self.out / CHECKPOINT, sharded=record, metrics=metrics, **common)
                _sharded_state.collect(self.out, self.out / CHECKPOINT)
            return
        if rank() == 0:
            _checkpoint.save(
                self.out / CHECKPOINT,
                model=self.algorithm.state_dict(),
                optimizer=self.optimizer.state_dict(),
                metrics=None if self.log is None else self.log.history(),
                **common,
            )

    def _evaluation_due(self, done: int) -> bool:
        cfg = self.cfg
        return done == cfg.steps or bool(cfg.eval_every and done % cfg.eval_every == 0)

    def plots(self, summary: dict[str, Any], whole: Algorithm | None = None) -> list[str]:
        """The run's PNG figures (rank 0; none without matplotlib): training curves (with the
        baseline of ``summary``, if any), then the task family's own. ``whole``: a sharded
        run's algorithm with the whole weights (:meth:`_whole_copy`), to draw from."""
        if not _output.available():
            return []
        folder = self.out / "plots"
        paths = [folder / "training.png"]
        training_curves(
            read(self.out / "metrics.csv"),
            paths[0],
            classification=self.family.classification,
            metric=self.family.metric,
            title=f"{self.cfg.algorithm} on {self.cfg.task}"
            + (
                f" (a training run of {self.cfg.inner_steps} steps per outer step)"
                if self.family.run
                else ""
                if TrainConfig.adapts(self.cfg.algorithm)
                else " (no adaptation: scored as trained)"
            ),
            adapts=TrainConfig.adapts(self.cfg.algorithm) and self.cfg.eval_steps != 0,
            run=self.family.run,
            baseline=(
                (summary["test_acc_baseline"], summary["test_acc_baseline_ci"])
                if "test_acc_baseline" in summary
                else None
            ),
        )
        # Whole held-out tasks on this process alone.
        alone = self.learner.local() if whole is None else contextlib.nullcontext()
        with alone:
            paths += self.family.plots(
                self.algorithm if whole is None else whole,
                seed=self.cfg.seed,
                folder=folder,
                dtype=self.dtype,
                device=self.device,
            )
        return [str(p) for p in paths]

    def _whole_copy(self) -> Algorithm:
        """The algorithm outside MetaDDP with the model's whole weights, on this process
        alone (inside ``learner.gathered()``). A sharded run draws its figures on rank 0 from
        it: inside ``gathered()`` the parameters themselves are whole, but graphs of the run's
        steps may still hold them as shards, which a derivative by them would meet."""
        cfg = self.cfg
        with torch.random.fork_rng(devices=[]):  # its initialisation draws from no stream
            copy = cfg.build(self.family.model())
        copy = copy.to(device=self.device, dtype=self.dtype)
        copy.draw_seed = cfg.seed
        copy.load_state_dict(self.algorithm.state_dict())
        bind(copy, LOCAL)  # the identity reductions: every task whole here
        return copy

    def run(self, *, progress: bool = True) -> dict[str, Any]:
        """Train from the start (or checkpoint) step to ``cfg.steps``.

        SIGTERM and SIGINT (a scheduler's preemption, Ctrl-C) end the current step on every
        rank, write a checkpoint and return; a second SIGINT interrupts at once.

        Returns:
            On every rank: ``losses`` (global meta-loss per step trained here), ``final``
            (last evaluation), ``start`` (first step trained here), ``weights`` (the final
            meta-parameters, on the CPU) and ``summary``; after a stop signal, ``stopped``
            (``{"signal": name, "step": checkpoint step}``) and no summary.
        """
        cfg, me = self.cfg, rank()
        if me == 0:
            said = cfg.lines()
            if self.resumed_from is not None:
                said.append(f"resumed from step {self.start} ({self.resumed_from})")
            if self.layout_was is not None:
                cost = (
                    "deterministic: the same bits"
                    if cfg.deterministic
                    else "the same steps, equal only to rounding"
                )
                said.append(
                    f"note: the run ran in the {self.layout_was} layout and continues in the "
                    f"{cfg.layout} layout: {cost}"
                )
            said += [f"note: {line}" for line in self.changed]
            print("\n".join(said), flush=True)
        log = MetricsLog(self.out, self.start, saved=self.saved_metrics) if me == 0 else None
        self.log = log
        bar = progress_bar(cfg, self.start) if me == 0 and progress else None
        losses: list[float] = []
        last_eval: dict[str, float] = {}
        metric = "test acc" if self.family.classification else f"test {self.family.metric}"
        # Elapsed seconds continue from the last row kept when resuming.
        t0 = time.perf_counter() - (log.seconds if log is not None else 0.0)
        stopped: dict[str, Any] | None = None
        try:
            with _stop_signals(self.out, lambda: self.saved) as signals:
                if self.evaluate_first:
                    # The stop that wrote the checkpoint skipped this step's evaluation: run
                    # it on the same weights, and complete the step's metrics row.
                    last_eval = self.evaluate()
                    if log is not None:
                        log.complete(self.start, last_eval)
                assert cfg.steps is not None  # resolved settings
                for step in range(self.start, cfg.steps):
                    value, stop = self.step(step, signals.received is not None)
                    losses.append(value)
                    last_eval = self._record(step + 1, value, t0, log, bar, metric, last_eval, stop)
                    if stop:
                        self.save(step + 1, evaluation_due=self._evaluation_due(step + 1))
                        stopped = {
                            "signal": signals.received or "a signal to another rank",
                            "step": step + 1,
                        }
                        break
            if stopped is None and not last_eval:
                # Resumed at the last step: evaluate what the checkpoint holds.
                last_eval = self.evaluate()
        finally:  # the progress bar and metrics file close even when a step raises
            if bar is not None:
                bar.close()
            if log is not None:
                log.close()
        with self.learner.gathered():  # sharded: the whole weights (on every process)
            weights = {k: v.detach().cpu().clone() for k, v in self.algorithm.state_dict().items()}
        result: dict[str, Any] = {
            "losses": losses,
            "final": last_eval,
            "start": self.start,
            "weights": weights,
        }
        if stopped is not None:
            return dict(result, stopped=stopped, summary=None)
        # Every step is checkpointed: a stop request now lets the summary and plots be
        # written (a few seconds) rather than cut them off.
        with _stop_signals(self.out, lambda: self.saved):
            summary = self._finish(last_eval)
        return dict(result, summary=summary)

    def _record(
        self,
        done: int,
        value: float,
        t0: float,
        log: MetricsLog | None,
        bar: Any,
        metric: str,
        last_eval: dict[str, float],
        stopping: bool,
    ) -> dict[str, float]:
        """After step ``done``: evaluate when due, write the metrics row, checkpoint when due,
        update the bar. Returns the latest evaluation."""
        cfg = self.cfg
        row: dict[str, float] = {
            "step": done,
            "meta_loss": value,
            "seconds": time.perf_counter() - t0,
        }
        if not stopping and self._evaluation_due(done):
            try:
                last_eval = self.evaluate()
            except FloatingPointError as e:
                kept = (
                    f"the last checkpoint holds step {self.saved}"
                    if self.saved
                    else "no checkpoint was written yet"
                )
                raise NonFiniteError(
                    f"evaluation after step {done}: adapting to held-out tasks for "
                    f"{cfg.eval_steps} step(s) is not finite ({e}). Lower --eval-steps or the "
                    f"inner learning rate (--inner-lr {cfg.inner_lr:g}); {kept}"
                ) from None
            row.update(last_eval)
        if log is not None:
            log.write(row)
        assert cfg.checkpoint_every is not None  # resolved settings
        if not stopping and (done == cfg.steps or done % cfg.checkpoint_every == 0):
            self.save(done)
        if bar is not None:
            shown = {"loss": f"{value:.4g}"}
            if last_eval:
                key = "test_acc_after" if self.family.classification else "test_after"
                shown[metric] = f"{last_eval[key]:.4g}"
            bar.set_postfix(shown, refresh=False)
            bar.update(1)
        return last_eval

    def _finish(self, last_eval: dict[str, float]) -> dict[str, Any]:
        """The summary (written and plotted by rank 0, once every rank finished)."""
        cfg = self.cfg
        assert cfg.eval_tasks is not None
        summary: dict[str, Any] = {
            "step": cfg.steps,
            "eval_tasks": cfg.eval_tasks,
            "eval_steps": cfg.eval_steps,
            "metric": self.family.metric,
            **last_eval,
            **baseline(self.family, seed=cfg.seed, n_tasks=cfg.eval_tasks),
        }
        whole = None
        if self.learner.sharding is not None:  # the figures' weights, gathered on every rank
            with self.learner.gathered():
                whole = self._whole_copy() if rank() == 0 else None
        if dist.is_initialized():
            # Every rank has finished its steps. The summary and the plots are rank 0's alone:
            # no rank waits in a collective (bounded by --timeout) while they are drawn.
            dist.barrier()
        if rank() == 0:
            self._write_summary(summary, whole)
        return summary

    def _write_summary(self, summary: dict[str, Any], whole: Algorithm | None) -> None:
        """summary.json and the figures (rank 0). The run is trained and its last checkpoint
        written: a full disk now costs the summary file or the figures, said in one line
        each, not the run."""
        try:
            _checkpoint.atomic_write(
                self.out / "summary.json",
                lambda f: f.write(json.dumps(summary, indent=2).encode()),
            )
        except OSError as e:
            warnings.warn(f"summary.json not written ({e}); the run is trained", stacklevel=1)
        try:
            summary["plots"] = self.plots(summary, whole)
        except OSError as e:
            warnings.warn(
                f"the plots were not written ({e}); the run is trained and checkpointed",
                stacklevel=1,
            )
            summary["plots"] = []


def train(
    cfg: TrainConfig,
    out: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    backend: str | None = None,
) -> dict[str, Any]:
    """Train on every process of the (already initialised) process group (:class:`Trainer`)."""
    return Trainer(cfg, out, resume=resume, backend=backend).run(progress=progress)


def progress_bar(cfg: TrainConfig, start: int) -> Any:
    """A tqdm bar (steps, rate, ETA) when tqdm is installed (the ``train`` extra), else None."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(
        total=cfg.steps,
        initial=start,
        desc=f"{cfg.algorithm} {cfg.task}",
        unit="step",
        dynamic_ncols=True,
    )


def _changed_on_resume(was: dict[str, Any], cfg: TrainConfig, start: int) -> list[str]:
    """What a resume's settings change beyond the steps still to run, where the run's
    identity does not hold them (``was``: the checkpoint's settings): a schedule scaled to
    ``--steps``, and the evaluation, whose numbers then compare with the earlier rows no
    more. One line each, said when the run starts."""
    out: list[str] = []
    steps_was, steps = was.get("steps"), cfg.steps
    assert steps is not None  # resolved settings
    if steps_was is not None and steps_was != steps:
        moved = []
        if cfg.outer_schedule == "cosine":
            then = dataclasses.replace(cfg, steps=steps_was).outer_lr_at(start)
            moved.append(
                f"the cosine outer rate anneals over {cfg.steps} steps (step {start + 1}'s rate "
                f"{cfg.outer_lr_at(start):.3g}, was {then:.3g})"
            )
        if cfg.algorithm == "mamlpp":
            moved.append(
                f"MAML++'s annealing scales to {steps} steps (multi-step loss over "
                f"{steps // 15}, first order for {steps // 3}; were {steps_was // 15} "
                f"and {steps_was // 3})"
            )
        if moved:
            out.append(f"--steps was {steps_was} and is {cfg.steps}: " + "; ".join(moved))
    evaluation = [
        f"--{k.replace('_', '-')} {was[k]} -> {getattr(cfg, k)}"
        for k in ("eval_tasks", "eval_steps")
        if was.get(k) is not None and was[k] != getattr(cfg, k)
    ]
    if evaluation:
        out.append(
            f"the evaluation changed ({', '.join(evaluation)}): test numbers from step "
            f"{start + 1} on do not compare with the earlier rows of metrics.csv"
        )
    return out
