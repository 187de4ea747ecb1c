"""Few-shot regression on sequences, learned by a small transformer with dropout.

Each task reads a sequence of ``length`` steps of two features, ``x_t ~ N(0, I)``, and
predicts ``y = A * mean_t sin(<x_t, u> + phi)`` with its own amplitude ``A ~ U[0.5, 2]``,
direction ``u = (cos theta, sin theta)``, ``theta ~ U[0, 2 pi]``, and phase
``phi ~ U[0, pi]``: a sinusoid regression whose input is a set of steps, so the network
must pool over positions. The network is an input projection, one
``nn.TransformerEncoderLayer`` (dropout 0.1, samples first) and a linear read-out of the
mean over positions. Dropout stays on during meta-training: its masks are keyed by the
samples (:mod:`metaddp.forward`), the same on any number of processes.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._data import Batch, Task
from ._family import TaskFamily, check_sizes


class SequenceRegressor(nn.Module):
    """Input projection, a transformer encoder layer, mean over positions, linear read-out."""

    def __init__(self, features: int = 2, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.encoder = nn.TransformerEncoderLayer(
            width, heads, 2 * width, dropout=0.1, batch_first=True
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1)).squeeze(-1)


class Sequences(TaskFamily):
    """K-shot sequence regression (module docstring).

    Args:
        shots: support sequences per task.
        query: query sequences per task.
        hidden: the transformer's width (a multiple of its 4 heads).
        length: steps per sequence.
    """

    name: ClassVar[str] = "sequences"
    classification: ClassVar[bool] = False
    metric: ClassVar[str] = "MSE"
    defaults: ClassVar[dict[str, Any]] = dict(
        shots=10,
        query=10,
        inner_lr=0.05,
        outer_lr=0.001,
        meta_batch=8,
        inner_steps=1,
        eval_steps=5,
        hidden=32,
    )

    def __init__(self, shots: int = 10, query: int = 10, hidden: int = 32, length: int = 8):
        check_sizes("sequence", "sequence", shots, query, hidden)
        self.shots, self.query, self.hidden, self.length = int(shots), int(query), hidden, length

    def sample(self, generator: torch.Generator, split: str) -> Task:
        amp, theta, phase = torch.rand(3, generator=generator, dtype=torch.float64).tolist()
        amp, theta, phase = 0.5 + 1.5 * amp, 2 * math.pi * theta, math.pi * phase
        n = self.shots + self.query
        x = torch.randn(n, self.length, 2, generator=generator, dtype=torch.float64)
        u = torch.tensor([math.cos(theta), math.sin(theta)], dtype=torch.float64)
        y = amp * torch.sin(x @ u + phase).mean(dim=1)
        x, y = x.float(), y.float()
        k = self.shots
        return Task(Batch(x[:k], y[:k], k), Batch(x[k:], y[k:], self.query))

    def model(self) -> nn.Module:
        return SequenceRegressor(width=self.hidden)

    def loss(self, prediction: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(prediction, target, reduction="none")

    def describe(self) -> dict[str, Any]:
        return {"shots": self.shots, "query": self.query, "hidden": self.hidden}
