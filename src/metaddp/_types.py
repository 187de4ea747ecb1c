"""The vocabulary every layer shares: weights by name, per-sample losses, reductions, and the
interface every meta-learning algorithm offers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from ._data import Batch, Task

Params = dict[str, Tensor]
"""Weights by qualified parameter name (``"net.0.weight"``), as ``named_parameters`` gives them."""

LossFn = Callable[[Tensor, Tensor], Tensor]
"""``loss_fn(prediction, target)``: one loss per sample (``reduction='none'``)."""

Reduce = Callable[[list[Tensor]], list[Tensor]]
"""A differentiable SUM of each tensor over the processes that split one task's samples."""


def identity_reduce(tensors: list[Tensor]) -> list[Tensor]:
    """The ``reduce`` of one process: every gradient is already global."""
    return tensors


@dataclasses.dataclass(frozen=True)
class Supports:
    """What a meta-learning algorithm offers, declared once on its class (``supports``): its
    constructor's refusals, ``MetaDDP``, the registry and the training settings read it.

    Attributes:
        deterministic: a form whose bits do not depend on the world size
            (``MetaDDP(..., deterministic=True)``).
        low_memory: ``memory="low"``, second order rebuilt one inner step at a time.
        autocast: forward passes under ``torch.autocast``.
        learn_lr: inner learning rates trained in the outer loop (``learn_lr=``).
        inner_optimizer: an inner optimizer other than plain SGD (``optimizer=``).
        capture: a meta-step that reads nothing on the host, so a CUDA graph records it.
        sharded: meta-parameters sharded over the sample axis (``MetaDDP(..., shard=True)``):
            every inner step elementwise on the shards, every forward through
            :func:`metaddp.functional.call`.
        stacked: a rank's tasks stacked along a task dimension (``batched=True``).
        why: ``(capability, reason)`` pairs: why the class lacks a capability, the limit the
            refusal names (docs/algorithms.md lists them).
    """

    deterministic: bool = False
    low_memory: bool = False
    autocast: bool = False
    learn_lr: bool = False
    inner_optimizer: bool = True
    capture: bool = True
    sharded: bool = False
    stacked: bool = False
    why: tuple[tuple[str, str], ...] = ()

    def refuse(self, algorithm: str, said: Mapping[str, str] | None = None, **asked: bool) -> None:
        """Raise for the first capability in ``asked`` (``name=True``) not offered, with the
        class's reason where it declares one; ``said`` names an option as it was given
        (``memory=Replay(...)``)."""
        for name, wanted in asked.items():
            if wanted and not getattr(self, name):
                option = {
                    "low_memory": 'memory="low"',
                    "deterministic": "deterministic=True",
                    "sharded": "sharded layout (MetaDDP(..., shard=True))",
                    "stacked": "stacked tasks (batched=True)",
                    **(said or {}),
                }
                reason = dict(self.why).get(
                    name, "the algorithms that have it are listed in docs/algorithms.md"
                )
                raise ValueError(f"{algorithm} has no {option.get(name, name)}: {reason}")


@runtime_checkable
class MetaAlgorithm(Protocol):
    """What a meta-learning algorithm offers (MAML, Meta-SGD, ANIL, Reptile, iMAML...).

    ``reduce`` is optional everywhere: by default an algorithm uses the reduction of the
    :class:`metaddp.MetaDDP` that wraps it (the identity on one process).
    """

    def meta_loss(
        self, tasks: Sequence[Task], loss_fn: LossFn | None = ..., *, reduce: Reduce | None = None
    ) -> Tensor:
        """This process's share of the meta-batch's mean query loss after adaptation."""
        ...

    def adapt(
        self,
        support: Batch,
        loss_fn: LossFn | None = ...,
        *,
        steps: int | None = None,
        reduce: Reduce | None = None,
    ) -> Params:
        """The fast weights after adapting to ``support``."""
        ...

    def forward(self, x: Tensor, fast: Mapping[str, Tensor] | None = None) -> Tensor:
        """The model on ``x`` with the fast weights ``fast`` (default: the meta-parameters)."""
        ...

    def __call__(self, x: Tensor, fast: Mapping[str, Tensor] | None = None) -> Tensor:
        """Same as :meth:`forward` (algorithms are ``nn.Module`` s)."""
        ...
