"""What a task family is: a pure function from (seed, split, global index) to a task.

A family never draws from global random state: task ``i`` of split ``s`` is built from a
generator seeded by ``(seed, s, i)`` alone, so the stream of tasks is the same for any number
of processes, and a run resumed at step ``t`` needs nothing but ``t`` to continue the stream.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .._data import Task, generator_for
from .._types import MetaAlgorithm

SPLITS = ("train", "test")


class TaskFamily(abc.ABC):
    """A distribution over tasks, the network that suits them and their per-sample loss.

    Subclasses set :attr:`name`, :attr:`classification`, :attr:`defaults` (training options
    that suit the family: learning rates, shots, ...) and implement :meth:`sample`.
    """

    name: ClassVar[str]
    classification: ClassVar[bool]
    defaults: ClassVar[Mapping[str, Any]] = {}
    needs_data: ClassVar[bool] = False
    """Whether the family reads a dataset folder (``--data``)."""
    data_option: ClassVar[bool] = False
    """Whether the family takes a folder (``--data``) that it can also do without."""
    test_tasks: ClassVar[int | None] = None
    """How many held-out tasks the family has (``None``: as many as asked)."""
    metric: ClassVar[str] = "loss"
    """What :meth:`loss` measures, as the run's metrics and plots name it ("MSE", "loss")."""
    run: ClassVar[bool] = False
    """Whether the family's inner problem is a whole training run on minibatches of ``shots``
    (noisy-run): the run's network is never stepped, and evaluation compares the run with and
    without what was learned."""

    @classmethod
    def refuse_unread_data(cls, data: str | None) -> None:
        """Raise ``ValueError`` if a dataset folder is given to a family that reads none."""
        if data is not None and not (cls.needs_data or cls.data_option):
            raise ValueError(f"the {cls.name} task reads no dataset: drop --data ({data})")

    @classmethod
    def check_data(cls, data: str | None) -> None:
        """Raise ``ValueError`` naming the fix if ``data`` cannot serve this family (checked
        before a run creates anything); a family without a dataset accepts anything."""
        return None

    @classmethod
    def font_set(cls, spec: str | None) -> str | None:
        """The identity of the fonts ``spec`` names, for a family drawn from fonts (a run
        records it and checks it on resume); ``None`` for the others, which take no fonts."""
        if spec is not None:
            raise ValueError(f"fonts is a setting of the glyphs task, not of {cls.name}")
        return None

    def task(self, seed: int, index: int, split: str = "train") -> Task:
        """Task number ``index`` of ``split`` ("train" or "test") for ``seed``: whole, unsplit.

        Args:
            seed: the run's seed.
            index: the task's global index in the stream (step * meta_batch + position).
            split: "train" (meta-training tasks) or "test" (held-out tasks or classes).

        Returns:
            A :class:`metaddp.Task` holding the global support and query batches.
        """
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
        if index < 0:
            raise ValueError(f"task indices start at 0, got {index}")
        return self.sample(generator_for(seed, SPLITS.index(split), index), split)

    @abc.abstractmethod
    def sample(self, generator, split: str) -> Task:
        """Build one task drawing every random number from ``generator``."""

    @abc.abstractmethod
    def model(self) -> nn.Module:
        """A freshly initialised network for this family (uses torch's global RNG)."""

    @abc.abstractmethod
    def loss(self, prediction: Tensor, target: Tensor) -> Tensor:
        """One loss per sample (``reduction='none'``), as :func:`metaddp.share` expects."""

    def describe(self) -> dict[str, Any]:
        """The options that define the task stream (checked when a run is resumed)."""
        return {}

    def plots(
        self,
        algorithm: MetaAlgorithm,
        *,
        seed: int,
        folder: Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> list[Path]:
        """Figures of this family that a run draws after training (none by default).

        Args:
            algorithm: the trained algorithm (``adapt`` and ``forward(x, fast)``), run on one
                process with whole tasks.
            seed: the run's seed (held-out tasks are ``task(seed, i, "test")``).
            folder: where to write PNG files.
            dtype, device: the algorithm's (``device=None`` is the CPU).

        Returns:
            The paths written.
        """
        return []


def check_sizes(family: str, what: str, shots: int, query: int, hidden: int) -> None:
    """Refuse a family of transformers (4 heads) whose tasks have no support or no query
    ``what`` (a chunk, a sequence), or whose width the heads do not divide."""
    if shots < 1 or query < 1:
        raise ValueError(
            f"a {family} task needs at least one support and one query {what}, "
            f"got shots={shots}, query={query}"
        )
    if hidden < 4 or hidden % 4:
        raise ValueError(f"hidden must be a positive multiple of 4 (heads), got {hidden}")
