"""N-way K-shot classification over a pool of image classes (Vinyals et al. 2016; Finn et al. 2017).

A task picks ``ways`` classes of its split's pool, gives them labels ``0 .. ways-1`` in a random
order, and draws ``shots`` support and ``query`` query images per class, without replacement;
the samples of each batch are shuffled so that any contiguous shard mixes classes. Every choice
comes from the task's own generator.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._data import Batch, Task
from ._family import TaskFamily


def rotations(images: Tensor, enabled: bool) -> list[Tensor]:
    """``images`` ``[n, 1, H, W]`` turned by 0, 90, 180 and 270 degrees: four classes (or one)."""
    return [torch.rot90(images, k, dims=(2, 3)) for k in range(4 if enabled else 1)]


class ConvNet(nn.Sequential):
    """Blocks of 3x3 convolution, ReLU and 2x2 max-pooling, then a linear classifier.

    The four-block network of Finn et al. 2017 without batch normalisation: per-rank batch
    statistics would make results depend on how a batch is split over processes.
    """

    def __init__(self, size: int, ways: int, hidden: int = 32, blocks: int = 4) -> None:
        layers: list[nn.Module] = []
        channels, side = 1, size
        for _ in range(blocks):
            if side < 2:
                break
            layers += [nn.Conv2d(channels, hidden, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            channels, side = hidden, side // 2
        super().__init__(*layers, nn.Flatten(), nn.Linear(channels * side * side, ways))


class FewShotImages(TaskFamily):
    """N-way K-shot classification from class pools ``{"train": [...], "test": [...]}``.

    Args:
        pools: per split, a list of classes, each a float tensor ``[n_images, 1, H, W]``.
        ways: classes per task (N).
        shots: support images per class (K).
        query: query images per class.
        hidden: channels of the convolutional network.
    """

    name: ClassVar[str] = "images"
    classification: ClassVar[bool] = True
    defaults: ClassVar[dict[str, Any]] = dict(
        ways=5,
        shots=1,
        query=15,
        inner_lr=0.4,
        outer_lr=0.001,
        meta_batch=32,
        inner_steps=1,
        hidden=32,
    )

    def __init__(
        self,
        pools: dict[str, list[Tensor]],
        ways: int = 5,
        shots: int = 1,
        query: int = 15,
        hidden: int = 32,
    ) -> None:
        self.ways, self.shots, self.query, self.hidden = (
            int(ways),
            int(shots),
            int(query),
            int(hidden),
        )
        if self.ways < 2 or self.shots < 1 or self.query < 1:
            raise ValueError(
                f"need ways >= 2, shots >= 1 and query >= 1, got ways={ways}, "
                f"shots={shots}, query={query}"
            )
        for split, pool in pools.items():
            if len(pool) < self.ways:
                raise ValueError(
                    f"the {split} split has {len(pool)} classes, fewer than ways={self.ways}: "
                    "lower --ways or use a dataset with more classes"
                )
            small = min(c.shape[0] for c in pool)
            if small < self.shots + self.query:
                raise ValueError(
                    f"a class of the {split} split has only {small} images, fewer than "
                    f"shots + query = {self.shots + self.query}: lower --shots or --query"
                )
        self.pools = pools
        self.size = pools["train"][0].shape[-1]

    def sample(self, generator: torch.Generator, split: str) -> Task:
        pool = self.pools[split]
        chosen = torch.randperm(len(pool), generator=generator)[: self.ways].tolist()
        xs, ys, xq, yq = [], [], [], []
        for label, c in enumerate(chosen):
            images = pool[c]
            pick = torch.randperm(images.shape[0], generator=generator)[: self.shots + self.query]
            xs.append(images[pick[: self.shots]])
            xq.append(images[pick[self.shots :]])
            ys.append(torch.full((self.shots,), label, dtype=torch.long))
            yq.append(torch.full((self.query,), label, dtype=torch.long))
        x_s, y_s, x_q, y_q = torch.cat(xs), torch.cat(ys), torch.cat(xq), torch.cat(yq)
        ps = torch.randperm(x_s.shape[0], generator=generator)
        pq = torch.randperm(x_q.shape[0], generator=generator)
        return Task(Batch(x_s[ps], y_s[ps], x_s.shape[0]), Batch(x_q[pq], y_q[pq], x_q.shape[0]))

    def model(self) -> nn.Module:
        return ConvNet(self.size, self.ways, self.hidden)

    def loss(self, prediction: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(prediction, target, reduction="none")

    def describe(self) -> dict[str, Any]:
        return {
            "ways": self.ways,
            "shots": self.shots,
            "query": self.query,
            "hidden": self.hidden,
            "classes": {s: len(p) for s, p in self.pools.items()},
        }
