"""Sinusoid regression, the toy problem of MAML (Finn, Abbeel & Levine, ICML 2017, sec. 5.1).

Each task is ``y = A sin(x - phi)`` with amplitude ``A ~ U[0.1, 5]``, phase ``phi ~ U[0, pi]``
and inputs ``x ~ U[-5, 5]``; ``shots`` support points to adapt on, ``query`` points to score,
mean squared error. The network is the paper's: two hidden layers of 40 ReLU units.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._data import Batch, Task
from .._output import pyplot
from .._types import MetaAlgorithm
from ._family import TaskFamily

AMPLITUDE = (0.1, 5.0)
PHASE = (0.0, math.pi)
INPUT = (-5.0, 5.0)


class Sinusoid(TaskFamily):
    """K-shot sinusoid regression.

    Args:
        shots: support points per task (K).
        query: query points per task.
        hidden: width of the two hidden layers.
    """

    name: ClassVar[str] = "sinusoid"
    classification: ClassVar[bool] = False
    metric: ClassVar[str] = "MSE"
    defaults: ClassVar[dict[str, Any]] = dict(
        shots=10,
        query=10,
        inner_lr=0.01,
        outer_lr=0.001,
        meta_batch=25,
        inner_steps=1,
        eval_steps=10,
        hidden=40,
    )

    def __init__(self, shots: int = 10, query: int = 10, hidden: int = 40) -> None:
        if shots < 1 or query < 1:
            raise ValueError(
                f"a sinusoid task needs at least one support and one query point, "
                f"got shots={shots}, query={query}"
            )
        self.shots, self.query, self.hidden = int(shots), int(query), int(hidden)

    def curve(self, generator: torch.Generator) -> tuple[float, float]:
        """Draw (amplitude, phase): the first two numbers of a task's generator."""
        amp, phase = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
        return (
            AMPLITUDE[0] + (AMPLITUDE[1] - AMPLITUDE[0]) * amp,
            PHASE[0] + (PHASE[1] - PHASE[0]) * phase,
        )

    def sample(self, generator: torch.Generator, split: str) -> Task:
        amp, phase = self.curve(generator)
        x = INPUT[0] + (INPUT[1] - INPUT[0]) * torch.rand(
            self.shots + self.query, 1, generator=generator, dtype=torch.float64
        )
        y = amp * torch.sin(x - phase)
        x, y = x.float(), y.float()
        k = self.shots
        return Task(Batch(x[:k], y[:k], k), Batch(x[k:], y[k:], self.query))

    def truth(self, seed: int, index: int, split: str, x: Tensor) -> Tensor:
        """The true curve of task ``index`` evaluated at ``x`` (for plots)."""
        from .._data import generator_for
        from ._family import SPLITS

        amp, phase = self.curve(generator_for(seed, SPLITS.index(split), index))
        return amp * torch.sin(x - phase)

    def model(self) -> nn.Module:
        h = self.hidden
        return nn.Sequential(
            nn.Linear(1, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1)
        )

    def loss(self, prediction: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(prediction, target, reduction="none")

    def describe(self) -> dict[str, Any]:
        return {"shots": self.shots, "query": self.query, "hidden": self.hidden}

    def plots(
        self,
        algorithm: MetaAlgorithm,
        *,
        seed: int,
        folder: Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> list[Path]:
        """Finn et al. 2017, fig. 2, on held-out task 0 (``adaptation.png``)."""
        path = Path(folder) / "adaptation.png"
        adaptation_figure(
            algorithm,
            self,
            seed=seed,
            index=0,
            steps=(1, 10),
            path=path,
            dtype=dtype,
            device=torch.device("cpu") if device is None else device,
        )
        return [path]


def adaptation_figure(
    algorithm: MetaAlgorithm,
    family: Sinusoid,
    *,
    seed: int,
    index: int,
    steps: Sequence[int],
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Finn et al. 2017, fig. 2: the true curve, the K support points, and the prediction of
    the meta-learned initialisation before and after a few inner steps on those points
    (taken by ``algorithm.adapt``, so with the run's own inner optimizer). The support batch
    is whole here, so one process draws it (``MetaDDP.local()`` around the call)."""
    plt = pyplot()
    task: Task = family.task(seed, index, "test")
    support = type(task.support)(
        task.support.x.to(device, dtype), task.support.y.to(device, dtype), task.support.n
    )
    grid = torch.linspace(-5, 5, 200, dtype=dtype, device=device).unsqueeze(1)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    grid_cpu = grid.squeeze(1).cpu()
    ax.plot(
        grid_cpu, family.truth(seed, index, "test", grid_cpu), "k-", lw=2, label="true function"
    )
    ax.plot(
        support.x.squeeze(1).cpu(),
        support.y.squeeze(1).cpu(),
        "^",
        color="purple",
        ms=8,
        label=f"{support.n} support points",
    )
    for k in (0, *steps):
        label = "meta-learned init." if k == 0 else f"after {k} grad step{'s' if k > 1 else ''}"
        try:
            fast = algorithm.adapt(support, family.loss, steps=k)
        except FloatingPointError:  # a diverging adaptation: said in the legend, not drawn
            ax.plot([], [], " ", label=f"{label}: diverged")
            continue
        with torch.no_grad():
            pred = algorithm(grid, {n: p.detach() for n, p in fast.items()})
        ax.plot(grid_cpu, pred.squeeze(1).cpu(), "--" if k == 0 else "-", label=label)
    ax.set(xlabel="x", ylabel="y", title="sinusoid: adaptation to a held-out task")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
