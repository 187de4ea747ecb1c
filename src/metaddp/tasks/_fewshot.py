"""N-way K-shot classification over a pool of image classes (Vinyals et al. 2016; Finn et al. 2017).

A task picks ``ways`` classes of its split's pool, gives them labels ``0 .. ways-1`` in a random
order, and draws ``shots`` support and ``query`` query images per class, without replacement;
the samples of each batch are shuffled so that any contiguous shard mixes classes. Every choice
comes from the task's own generator.

Pools may hold ``uint8`` images (0-255, a quarter of the memory of floats); a task's images
are floats in [0, 1] either way.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._data import Batch, Task
from ._family import TaskFamily

NORMS = ("batch", "none")


def rotations(images: Tensor, enabled: bool) -> list[Tensor]:
    """``images`` ``[n, C, H, W]`` turned by 0, 90, 180 and 270 degrees: four classes (or one)."""
    return [torch.rot90(images, k, dims=(2, 3)) for k in range(4 if enabled else 1)]


def as_float(images: Tensor) -> Tensor:
    """Images as floats in [0, 1] (``uint8`` images are divided by 255)."""
    if images.dtype == torch.uint8:
        return images.float() / 255.0
    return images


class ConvNet(nn.Sequential):
    """The four-block network of Finn et al. 2017 (after Vinyals et al. 2016): each block a 3x3
    convolution, BatchNorm (``norm="batch"``), ReLU and 2x2 max-pooling; then a linear layer.

    BatchNorm keeps no running statistics: it always normalises with the statistics of the batch
    it is given (a task's support set while adapting, its query set when scored), as MAML's
    reference code does. Under :class:`metaddp.MetaDDP` those statistics are summed over the
    processes that share a task, so the result does not depend on how a task is split.

    Args:
        size: image side (square images).
        ways: outputs (classes per task).
        hidden: channels of every block.
        blocks: at most this many blocks (fewer when the image becomes 1x1 earlier).
        channels: input channels (1 greyscale, 3 colour).
        norm: "batch" (BatchNorm after each convolution) or "none".
    """

    def __init__(
        self,
        size: int,
        ways: int,
        hidden: int = 32,
        blocks: int = 4,
        channels: int = 1,
        norm: str = "batch",
    ) -> None:
        if norm not in NORMS:
            raise ValueError(f"unknown norm {norm!r}; choose from {', '.join(NORMS)}")
        layers: list[nn.Module] = []
        side = size
        for _ in range(blocks):
            if side < 2:
                break
            layers.append(nn.Conv2d(channels, hidden, 3, padding=1))
            if norm == "batch":
                layers.append(nn.BatchNorm2d(hidden, track_running_stats=False))
            layers += [nn.ReLU(), nn.MaxPool2d(2)]
            channels, side = hidden, side // 2
        super().__init__(*layers, nn.Flatten(), nn.Linear(channels * side * side, ways))


def nearest_mean_accuracy(task: Task) -> float:
    """Accuracy of the raw-pixel nearest-class-mean classifier on a whole task's query set.

    Each class is the mean of its support images (pixels flattened); a query image gets the
    class of the nearest mean in Euclidean distance. No learning at all: the baseline a
    meta-learned network must beat to show that it learned something about the images.
    """
    xs, ys = task.support.x.flatten(1).double(), task.support.y
    xq, yq = task.query.x.flatten(1).double(), task.query.y
    classes = torch.unique(ys)
    means = torch.stack([xs[ys == c].mean(0) for c in classes])
    pred = classes[torch.cdist(xq, means).argmin(1)]
    return float((pred == yq).double().mean())


class FewShotImages(TaskFamily):
    """N-way K-shot classification from class pools ``{"train": [...], "test": [...]}``.

    Args:
        pools: per split, a list of classes, each a tensor ``[n_images, C, H, W]`` (floats in
            [0, 1] or ``uint8``).
        ways: classes per task (N).
        shots: support images per class (K).
        query: query images per class.
        hidden: channels of the convolutional network.
        norm: "batch" (BatchNorm in every block, the default) or "none".
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
        norm="batch",
    )

    def __init__(
        self,
        pools: dict[str, list[Tensor]],
        ways: int = 5,
        shots: int = 1,
        query: int = 15,
        hidden: int = 32,
        norm: str = "batch",
    ) -> None:
        self.ways, self.shots = int(ways), int(shots)
        self.query, self.hidden = int(query), int(hidden)
        if norm not in NORMS:
            raise ValueError(f"unknown norm {norm!r}; choose from {', '.join(NORMS)}")
        self.norm = norm
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
        self.channels = pools["train"][0].shape[1]

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
        x_s, y_s = as_float(torch.cat(xs)), torch.cat(ys)
        x_q, y_q = as_float(torch.cat(xq)), torch.cat(yq)
        ps = torch.randperm(x_s.shape[0], generator=generator)
        pq = torch.randperm(x_q.shape[0], generator=generator)
        return Task(Batch(x_s[ps], y_s[ps], x_s.shape[0]), Batch(x_q[pq], y_q[pq], x_q.shape[0]))

    def model(self) -> nn.Module:
        return ConvNet(self.size, self.ways, self.hidden, channels=self.channels, norm=self.norm)

    def loss(self, prediction: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(prediction, target, reduction="none")

    def baseline(self, task: Task) -> float:
        """The raw-pixel nearest-class-mean accuracy on ``task`` (:func:`nearest_mean_accuracy`)."""
        return nearest_mean_accuracy(task)

    def describe(self) -> dict[str, Any]:
        return {
            "ways": self.ways,
            "shots": self.shots,
            "query": self.query,
            "hidden": self.hidden,
            "norm": self.norm,
            "classes": {s: len(p) for s, p in self.pools.items()},
        }
