"""Sinusoid regression, the toy problem of MAML (Finn, Abbeel & Levine, ICML 2017, sec. 5.1).

Each task is ``y = A sin(x - phi)`` with amplitude ``A ~ U[0.1, 5]``, phase ``phi ~ U[0, pi]``
and inputs ``x ~ U[-5, 5]``; ``shots`` support points to adapt on, ``query`` points to score,
mean squared error. The network is the paper's: two hidden layers of 40 ReLU units.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._data import Batch, Task
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
    defaults: ClassVar[dict[str, Any]] = dict(
        shots=10, query=10, inner_lr=0.01, outer_lr=0.001, meta_batch=25, inner_steps=1,
        eval_steps=10, hidden=40,
    )

    def __init__(self, shots: int = 10, query: int = 10, hidden: int = 40) -> None:
        if shots < 1 or query < 1:
            raise ValueError(f"a sinusoid task needs at least one support and one query point, "
                             f"got shots={shots}, query={query}")
        self.shots, self.query, self.hidden = int(shots), int(query), int(hidden)

    def curve(self, generator: torch.Generator) -> tuple[float, float]:
        """Draw (amplitude, phase): the first two numbers of a task's generator."""
        amp, phase = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
        return (AMPLITUDE[0] + (AMPLITUDE[1] - AMPLITUDE[0]) * amp,
                PHASE[0] + (PHASE[1] - PHASE[0]) * phase)

    def sample(self, generator: torch.Generator, split: str) -> Task:
        amp, phase = self.curve(generator)
        x = INPUT[0] + (INPUT[1] - INPUT[0]) * torch.rand(
            self.shots + self.query, 1, generator=generator, dtype=torch.float64)
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
        return nn.Sequential(nn.Linear(1, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1))

    def loss(self, prediction: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(prediction, target, reduction="none")

    def describe(self) -> dict[str, Any]:
        return {"shots": self.shots, "query": self.query, "hidden": self.hidden}
