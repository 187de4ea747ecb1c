"""PNG figures of a run: meta-training loss, meta-test score, and (sinusoid) adaptation.

Needs matplotlib (the ``train`` extra); without it :func:`available` is false and the run
only skips its figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def training_curves(rows: Sequence[dict[str, float]], path: Path, *, classification: bool,
                    title: str) -> None:
    """Meta-training loss per step (left) and meta-test score with its 95% CI (right)."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    a.plot(steps, [r["meta_loss"] for r in rows], lw=0.8)
    a.set(xlabel="outer step", ylabel="meta-training loss (query, after adaptation)",
          title="meta-training loss")
    if all(r["meta_loss"] > 0 for r in rows):
        a.set_yscale("log")
    ev = [r for r in rows if not math.isnan(r.get("test_after", math.nan))]
    key = "test_acc" if classification else "test"
    if ev:
        x = [r["step"] for r in ev]
        after = [r[f"{key}_after"] for r in ev]
        ci = [0.0 if math.isnan(r[f"{key}_after_ci"]) else r[f"{key}_after_ci"] for r in ev]
        b.plot(x, [r[f"{key}_before"] for r in ev], "o-", label="before adaptation")
        b.plot(x, after, "o-", label="after adaptation")
        b.fill_between(x, [m - c for m, c in zip(after, ci)], [m + c for m, c in zip(after, ci)],
                       alpha=0.3, label="95% CI")
        b.legend()
    b.set(xlabel="outer step", ylabel="query accuracy" if classification else "query MSE",
          title="meta-test on held-out " + ("classes" if classification else "tasks"))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sinusoid_adaptation(algorithm: nn.Module, family, *, seed: int, index: int,
                        steps: Sequence[int], path: Path) -> None:
    """Finn et al. 2017, fig. 2: the true curve, the K support points, and the prediction of
    the meta-learned initialisation before and after a few inner steps on those points
    (taken by ``algorithm.adapt``, so with the run's own inner optimizer)."""
    from ._data import Task

    plt = _pyplot()
    dtype, device = next(algorithm.parameters()).dtype, next(algorithm.parameters()).device
    task: Task = family.task(seed, index, "test")
    support = type(task.support)(task.support.x.to(device, dtype), task.support.y.to(device, dtype),
                                 task.support.n)
    grid = torch.linspace(-5, 5, 200, dtype=dtype, device=device).unsqueeze(1)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    grid_cpu = grid.squeeze(1).cpu()
    ax.plot(grid_cpu, family.truth(seed, index, "test", grid_cpu), "k-", lw=2,
            label="true function")
    ax.plot(support.x.squeeze(1).cpu(), support.y.squeeze(1).cpu(), "^", color="purple", ms=8,
            label=f"{support.n} support points")
    for k in (0, *steps):
        fast = {n: p.detach() for n, p in algorithm.adapt(support, family.loss, steps=k).items()}
        with torch.no_grad():
            pred = algorithm(grid, fast)
        ax.plot(grid_cpu, pred.squeeze(1).cpu(), "--" if k == 0 else "-",
                label="meta-learned init." if k == 0 else f"after {k} grad step{'s' if k > 1 else ''}")
    ax.set(xlabel="x", ylabel="y", title="sinusoid: adaptation to a held-out task")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
