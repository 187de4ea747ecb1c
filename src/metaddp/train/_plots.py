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
) -> None:
    """Meta-training loss per step (left) and meta-test score with its 95% CI (right).

    ``baseline``: the accuracy (and 95% half-width) of a classifier that learns nothing on the
    same held-out tasks (the raw-pixel nearest-class-mean for images), drawn as a level line.
    """
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    a.plot(steps, [r["meta_loss"] for r in rows], lw=0.8)
    a.set(
        xlabel="outer step",
        ylabel="meta-training loss (query, after adaptation)",
        title="meta-training loss",
    )
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
        b.fill_between(
            x,
            [m - c for m, c in zip(after, ci, strict=True)],
            [m + c for m, c in zip(after, ci, strict=True)],
            alpha=0.3,
            label="95% CI",
        )
    if ev and baseline is not None:
        level, half = baseline
        half = 0.0 if math.isnan(half) else half
        b.axhline(level, color="0.3", ls="--", lw=1, label="pixel nearest-mean baseline")
        b.axhspan(level - half, level + half, color="0.5", alpha=0.15, lw=0)
    if ev:
        b.legend(fontsize="small")
    b.set(
        xlabel="outer step",
        ylabel="query accuracy" if classification else f"query {metric}",
        title="meta-test on held-out " + ("classes" if classification else "tasks"),
    )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
