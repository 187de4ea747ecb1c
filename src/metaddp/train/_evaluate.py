"""Meta-test evaluation: adapt to held-out tasks, score the query sets, mean and 95% CI.

Task ``i`` of the "test" split is the same on every number of processes; its evaluation is
spread over the mesh like a training meta-batch, and the per-task numbers are gathered with
one SUM all-reduce (every rank fills only its own tasks' shares, zeros elsewhere).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._data import Task, shard_range
from .._share import share
from .._types import MetaAlgorithm
from ..distributed import Mesh, Phase, all_reduce_sum, group_rank, group_size
from ..tasks import TaskFamily
from ._metrics import mean_ci95


def to(task: Task, dtype: torch.dtype, device: torch.device) -> Task:
    """A task's floating tensors cast to ``dtype`` and every tensor moved to ``device``."""

    def cast(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    return Task(*(b._replace(x=cast(b.x), y=cast(b.y)) for b in task))


def evaluate(
    algorithm: MetaAlgorithm,
    family: TaskFamily,
    mesh: Mesh,
    *,
    seed: int,
    n_tasks: int,
    steps: int,
    dtype: torch.dtype,
    device: torch.device,
    whole: bool = False,
) -> dict[str, float]:
    """Query loss (and accuracy) on ``n_tasks`` held-out tasks, before and after ``steps``.

    A family whose inner problem is a training run (``family.run``) compares two runs of
    ``steps`` instead: "before" is the run without what was learned (plain training), "after"
    the run with it. Its tasks share their support (the training set), so each run is made once.

    Args:
        algorithm: the algorithm, wrapped in the :class:`metaddp.MetaDDP` of ``mesh`` (its
            ``adapt`` reduces over a task's sample group without being told).
        family: the task family; tasks come from its "test" split.
        mesh: how processes share the tasks.
        seed, n_tasks, steps: which tasks, how many, adaptation steps.
        whole: every task whole on one process (tasks spread over all processes), for
            ``algorithm`` running alone (``MetaDDP.local()``); else split like a meta-batch.

    Returns:
        ``test_before`` / ``test_after`` (mean query loss), ``test_after_ci`` (95% half-width),
        and for classification ``test_acc_before`` / ``test_acc_after`` / ``test_acc_after_ci``.
    """
    per_task = torch.zeros(n_tasks, 4, dtype=torch.float64, device=device)
    index, parts = (mesh.task_index, mesh.tasks)
    if whole:
        index, parts = group_rank(mesh.group), group_size(mesh.group)
    # (steps, the algorithm's own adapt options) of the two columns.
    columns: tuple[tuple[int, dict[str, Any]], ...] = (
        ((steps, {"weighted": False}), (steps, {})) if family.run else ((0, {}), (steps, {}))
    )
    runs: dict[int, dict[str, Tensor]] = {}
    for i in shard_range(n_tasks, index, parts):
        task = family.task(seed, i, "test")
        if not whole:
            task = task.split(mesh.sample_index, mesh.samples)
        task = to(task, dtype, device)
        for col, (k, options) in enumerate(columns):
            if col in runs:
                fast = runs[col]
            else:
                fast = algorithm.adapt(task.support, family.loss, steps=k, **options)
                fast = {name: p.detach() for name, p in fast.items()}
                if family.run:
                    runs[col] = fast
            with torch.no_grad():
                # The algorithm reads its own fast weights; dropout, if the model has any, keyed
                # by the query's samples (Algorithm.predict).
                predict = getattr(algorithm, "predict", None)
                if predict is not None:
                    prediction = predict(task.query, fast)
                else:
                    prediction = algorithm(task.query.x, fast)
                per_task[i, col] = share(
                    family.loss(prediction, task.query.y), task.query.n
                ).double()
                if family.classification:
                    pred = prediction.argmax(-1)
                    per_task[i, 2 + col] = (pred == task.query.y).sum().double() / task.query.n
    per_task = all_reduce_sum([per_task], mesh.group, phase=Phase.VALUES)[0].cpu()
    out: dict[str, float] = {}
    out["test_before"] = float(per_task[:, 0].mean())
    out["test_after"], out["test_after_ci"] = mean_ci95(per_task[:, 1].tolist())
    if family.classification:
        out["test_acc_before"] = float(per_task[:, 2].mean())
        out["test_acc_after"], out["test_acc_after_ci"] = mean_ci95(per_task[:, 3].tolist())
    return out


def baseline(family: TaskFamily, *, seed: int, n_tasks: int) -> dict[str, float]:
    """The family's baseline accuracy on the same ``n_tasks`` held-out tasks as
    :func:`evaluate` (for image tasks the raw-pixel nearest-class-mean classifier), with its 95%
    interval: ``test_acc_baseline`` and ``test_acc_baseline_ci``; empty for a family without
    one. Whole tasks on this process: it needs no network and no collective, and every process
    gets the same numbers.
    """
    score = getattr(family, "baseline", None)
    if score is None or not family.classification:
        return {}
    mean, ci = mean_ci95([score(family.task(seed, i, "test")) for i in range(n_tasks)])
    return {"test_acc_baseline": mean, "test_acc_baseline_ci": ci}
