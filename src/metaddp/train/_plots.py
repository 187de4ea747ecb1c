"""PNG figures of a run: meta-training loss and meta-test score (a task family adds its own).

Needs matplotlib (the ``train`` extra); without it :func:`available` is false and the run
only skips its figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from .._output import pyplot


def training_curves(
    rows: Sequence[dict[str, float]],
    path: Path,
    *,
    classification: bool,
    metric: str,
    title: str,
    baseline: tuple[float, float] | None = None,
    adapts: bool = True,
    run: bool = False,
) -> dict[str, object]:
    """Meta-training loss per step (left) and meta-test score with its 95% CI (right).

    ``baseline``: the accuracy (and 95% half-width) of a classifier that learns nothing on the
    same held-out tasks (the raw-pixel nearest-class-mean for images), drawn as a level line.
    ``adapts``: the algorithm adapts to each task (meta-learning), so the score is drawn before
    and after adaptation; otherwise (reweighting, plain training) the network is scored as
    trained, one curve. ``run``: every outer step is a whole training run (noisy-run): the
    loss is the run's outer loss, and the score is drawn for a plain run and for a run with
    what was learned. One evaluation is drawn as a point with its interval as an error bar.

    Returns:
        The words drawn: ``title`` of the score's panel, its ``ylabel``, the curves'
        ``labels`` and the figure's ``suptitle``.
    """
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    a.plot(steps, [r["meta_loss"] for r in rows], lw=0.8)
    if run:
        a.set(xlabel="outer step", ylabel="outer loss, after the run", title="outer loss")
    else:
        a.set(
            xlabel="outer step",
            ylabel="meta-training loss (query, after adaptation)" if adapts else "training loss",
            title="meta-training loss" if adapts else "training loss",
        )
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    if all(r["meta_loss"] > 0 for r in rows):
        a.set_yscale("log")
    ev = [r for r in rows if not math.isnan(r.get("test_after", math.nan))]
    key = "test_acc" if classification else "test"
    if ev:
        x = [r["step"] for r in ev]
        after = [r[f"{key}_after"] for r in ev]
        ci = [0.0 if math.isnan(r[f"{key}_after_ci"]) else r[f"{key}_after_ci"] for r in ev]
        if adapts or run:
            first = "plain training" if run else "before adaptation"
            b.plot(x, [r[f"{key}_before"] for r in ev], "o-", label=first)
        label = "after adaptation" if adapts else "as trained"
        b.errorbar(
            x,
            after,
            yerr=ci,
            fmt="o-",
            capsize=4,
            label=("with what was learned" if run else label) + " (95% CI)",
        )
        b.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(x) == 1:  # one point: an axis around it in whole steps
            b.set_xlim(x[0] - 1, x[0] + 1)
    if ev and baseline is not None:
        level, half = baseline
        half = 0.0 if math.isnan(half) else half
        b.axhline(level, color="0.3", ls="--", lw=1, label="pixel nearest-mean baseline")
        b.axhspan(level - half, level + half, color="0.5", alpha=0.15, lw=0)
    if ev:
        b.legend(fontsize="small")
    if run:
        panel = "test after a training run"
        ylabel = "test accuracy" if classification else f"test {metric}"
    elif adapts:
        panel = "meta-test on held-out " + ("classes" if classification else "tasks")
        ylabel = "query accuracy" if classification else f"query {metric}"
    else:
        panel = "test on held-out data, as trained"
        ylabel = "test accuracy" if classification else f"test {metric}"
    b.set(xlabel="outer step", ylabel=ylabel, title=panel)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    labels = [t.get_text() for t in b.get_legend().get_texts()] if ev else []
    plt.close(fig)
    return {"title": panel, "ylabel": ylabel, "labels": labels, "suptitle": title}
