"""Prototypical networks and ProtoMAML: classes scored against their support set's mean
embedding, the prototype, which is exact on any split of the support set.

- Snell, Swersky & Zemel, "Prototypical Networks for Few-shot Learning", NeurIPS 2017,
  arXiv:1703.05175: the logits of a query are minus its squared distances to the prototypes.
- Triantafillou et al., "Meta-Dataset", ICLR 2020, arXiv:1903.03096, sec. 3.2 (ProtoMAML):
  MAML whose linear head starts, per task, at the prototypes' equivalent linear layer
  ``W_k = 2 c_k``, ``b_k = -|c_k|^2``; the gradient reaches the embedding through that start.

A prototype is a class mean over the *whole* support set: where processes split the support,
the per-class sums and counts go through the differentiable SUM (:func:`metaddp.data.class_means`),
so every process scores against the one-process prototypes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Unpack

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._adapt import batch_share, inner_loop
from .._data import Batch, Task, at_least
from .._functional import call, params_of
from .._remat import Replay
from .._share import own_share
from .._statistics import class_means
from .._types import LossFn, Params, Reduce, Supports
from ..forward import keyed_forward
from ._base import Algorithm, InnerSettings, need_loss, own_loss
from ._exact import Adapted

PROTOTYPES = "prototypes"
"""The one "fast weight" of a prototypical network: ``adapt`` returns its prototypes."""


def squared_distances(queries: Tensor, prototypes: Tensor) -> Tensor:
    """``[n, ways]``: ``|q_i - c_k|^2`` over flattened features, differentiable to any order
    (no square root, whose derivative is infinite at a zero distance)."""
    q, c = queries.flatten(1), prototypes.flatten(1)
    return ((q.unsqueeze(1) - c.unsqueeze(0)) ** 2).sum(-1)


def positive_ways(ways: int) -> int:
    at_least(ways, "ways (the number of classes per task)")
    return ways


class ProtoNet(Algorithm):
    """A prototypical network: no inner loop; a query's logits are minus its squared
    distances to the support set's class means in the embedding ``model`` computes.

    Args:
        model: the embedding network (its output, flattened, is the feature).
        ways: classes per task (labels ``0 .. ways - 1``); every class needs a support sample.
        autocast: as :class:`metaddp.MAML`.
        memory: any of :class:`metaddp.MAML`'s modes, all the same here (no inner step).
        batched: ``None`` or ``False``; ``True`` is refused (stacked tasks are MAML's loss).

    ``adapt(support)`` returns ``{"prototypes": [ways, ...]}``, and ``learner(x, fast)``
    the logits against them, so a prototypical network evaluates like any algorithm.
    """

    # memory="low": no inner step, so nothing to rebuild; every memory mode is the same.
    supports: ClassVar[Supports] = Supports(
        deterministic=True, autocast=True, inner_optimizer=False, sharded=True, low_memory=True,
        why=(own_loss("a prototypical network's (class means, no inner step)"),),
    )  # fmt: skip

    def __init__(
        self,
        model: nn.Module,
        *,
        ways: int,
        autocast: torch.dtype | None = None,
        memory: str | Replay = "default",
        batched: bool | None = None,
    ) -> None:
        super().__init__(model, autocast=autocast, memory=memory, batched=batched)
        self.ways = positive_ways(ways)

    def _rematerialized(self) -> bool:
        return False  # no inner step to rebuild, in any memory mode

    def settings(self) -> dict[str, object]:
        return {
            "algorithm": type(self).__name__,
            "ways": self.ways,
            "autocast": None if self.autocast is None else str(self.autocast),
        }

    def prototypes(self, support: Batch, *, reduce: Reduce) -> Tensor:
        """The class means of the support set's embeddings, over the whole set: the task's
        first forward, its dropout keyed by the samples."""
        with keyed_forward(support):
            embedded = self.embed(support.x)
        means, _ = class_means(embedded, support.y, self.ways, reduce=reduce)
        return means

    def embed(self, x: Tensor) -> Tensor:
        """The model on ``x``, through metaddp's forward (its weights gathered where they are
        sharded; its dropout keyed where the caller names the batch)."""
        return call(self.model, params_of(self.model), x)

    def task_loss(self, task: Task, loss_fn: LossFn, *, reduce: Reduce) -> Tensor:
        fast = {PROTOTYPES: self.prototypes(task.support, reduce=reduce)}
        with keyed_forward(task.query):  # the task's second forward
            logits = self.forward(task.query.x, fast)
        return own_share(loss_fn(logits, task.query.y), task.query)

    def exact_meta_loss(
        self, tasks: Sequence[Task], loss_fn: LossFn, n_tasks: int, sums: Any
    ) -> Tensor:
        """Deterministic mode: class sums of every support chunk summed order-free into the
        prototypes, every query chunk scored against them (:mod:`metaddp.algorithms._exact`)."""
        if (why := self.deterministic_refusal()) is not None:
            raise ValueError(why)
        adapted = Adapted(self.model, params_of(self.model), tasks, loss_fn, sums=sums)
        return adapted.prototype_loss(self.ways, n_tasks)

    def adapt(
        self,
        support: Batch,
        loss_fn: LossFn | None = None,
        *,
        steps: int | None = None,
        reduce: Reduce | None = None,
    ) -> Params:
        """``{"prototypes": ...}`` of ``support`` (``loss_fn`` and ``steps`` are not used: a
        prototypical network has no inner steps)."""
        with self.adapting(support, reduce) as c:
            return {PROTOTYPES: self.prototypes(support, reduce=c.reduce)}

    def forward(self, x: Tensor, fast: Mapping[str, Tensor] | None = None) -> Tensor:
        """The logits of ``x`` against ``fast["prototypes"]`` (from :meth:`adapt`)."""
        if fast is None or PROTOTYPES not in fast:
            raise TypeError(
                "a prototypical network classifies against a support set's prototypes: "
                "pass fast=learner.adapt(support) (its embedding alone is learner.model(x))"
            )
        return -squared_distances(self.embed(x), fast[PROTOTYPES])

    def clone(self, *, reduce: Reduce | None = None) -> Any:
        raise TypeError(
            "a prototypical network has no inner steps to take with clone()/adapt(loss): use "
            "learner.meta_loss(tasks, loss_fn), or fast = learner.adapt(support)"
        )


class WithHead(nn.Module):
    """``linear(body(x), weight, bias)``, the head's tensors given as fast weights only:
    ProtoMAML's head has no meta-parameters, its start is computed per task."""

    weight: Tensor
    bias: Tensor

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        # Placeholders for functional calls; never trained, never saved.
        self.register_buffer("weight", torch.zeros(0), persistent=False)
        self.register_buffer("bias", torch.zeros(0), persistent=False)

    def forward(self, x: Tensor, *, embed: bool = False) -> Tensor:
        if embed:  # the body's embedding, where the prototypes are made
            return self.body(x)
        if self.weight.numel() == 0:
            raise TypeError(
                "ProtoMAML's head starts at each task's prototypes: pass fast weights from "
                "learner.adapt(support)"
            )
        return F.linear(self.body(x).flatten(1), self.weight, self.bias)


class ProtoMAML(Algorithm):
    """MAML over an embedding ``body`` whose linear head starts at each task's prototypes.

    The inner loop adapts the body and the head together, from ``W_k = 2 c_k``,
    ``b_k = -|c_k|^2`` (so that before any step the logits are the prototypical network's,
    up to a per-query constant). The meta-gradient reaches the body through the inner steps
    and through the prototypes.

    Args:
        body: the embedding network (meta-parameters).
        ways: classes per task (labels ``0 .. ways - 1``).
        settings: the inner loop's, as :class:`metaddp.MAML` takes them (``inner_lr``,
            ``steps``, ``first_order``, ``optimizer``, ``autocast``, ``loss_scale``; a learned
            rate or ``memory="low"`` is refused).

    Fast weights are the body's (named ``"body.<name>"``) and ``"weight"`` / ``"bias"``.
    """

    model: WithHead
    supports: ClassVar[Supports] = Supports(
        deterministic=True, autocast=True, sharded=True,
        why=(
            own_loss("ProtoMAML's (a head started at each task's prototypes)"),
            ("low_memory", "its inner loop starts its head at the support's prototypes, so "
             "its first step's body gradient takes the head's through them (a path from one "
             "fast weight's start to another's); memory='low' rebuilds each step from "
             "independent copies, which have no such path: use memory='default'"),
        ),
    )  # fmt: skip

    def __init__(self, body: nn.Module, *, ways: int, **settings: Unpack[InnerSettings]) -> None:
        super().__init__(WithHead(body), **settings)
        self.ways = positive_ways(ways)

    def settings(self) -> dict[str, object]:
        return dict(super().settings(), ways=self.ways)

    def start(self, support: Batch, *, reduce: Reduce) -> Params:
        """The body's meta-parameters and the head at the support set's prototypes (the
        task's first forward, its dropout keyed by the samples)."""
        with keyed_forward(support):
            features = call(self.model, params_of(self.model), support.x, embed=True)
        means, _ = class_means(features, support.y, self.ways, reduce=reduce)
        c = means.flatten(1)
        return {**params_of(self.model), "weight": 2 * c, "bias": -(c * c).sum(1)}

    def _adapted(self, support: Batch, loss_fn: LossFn, reduce: Reduce, steps: int) -> Params:
        return inner_loop(
            self.model,
            self.start(support, reduce=reduce),
            support,
            loss_fn,
            steps=steps,
            optimizer=self.inner_optimizer(),
            first_order=self.first_order,
            reduce=reduce,
            loss_scale=self.loss_scale,
        )

    def exact_meta_loss(
        self, tasks: Sequence[Task], loss_fn: LossFn, n_tasks: int, sums: Any
    ) -> Tensor:
        """Deterministic mode: the head's start from prototypes summed order-free over the
        support's chunks, then MAML's chunked inner loop (:mod:`metaddp.algorithms._exact`)."""
        if (why := self.deterministic_refusal()) is not None:
            raise ValueError(why)
        adapted = Adapted(
            self.model, params_of(self.model), tasks, loss_fn, sums=sums, extra=("weight", "bias")
        )
        head = None
        if adapted.n_local:
            c = adapted.prototypes(self.ways, embed=True)  # [T, ways, D]
            head = {"weight": 2 * c, "bias": -(c * c).sum(-1)}
        optimizer = self.inner_optimizer()
        adapted.run(self.steps, self.first_order, lambda rates: optimizer, head)
        return adapted.query_loss(n_tasks)

    def task_loss(self, task: Task, loss_fn: LossFn, *, reduce: Reduce) -> Tensor:
        fast = self._adapted(task.support, loss_fn, reduce, self.steps)
        return batch_share(self.model, fast, task.query, loss_fn)

    def adapt(
        self,
        support: Batch,
        loss_fn: LossFn | None = None,
        *,
        steps: int | None = None,
        reduce: Reduce | None = None,
    ) -> Params:
        """Body and head weights after ``steps`` (default: the algorithm's) inner steps from
        the prototypes' head."""
        loss_fn = need_loss(loss_fn, type(self).__name__)
        with self.adapting(support, reduce) as c:
            steps = self.steps if steps is None else steps
            return self._adapted(support, self.per_sample(loss_fn, c), c.reduce, steps)

    def forward(self, x: Tensor, fast: Mapping[str, Tensor] | None = None) -> Tensor:
        """The adapted network on ``x``; ``fast`` from :meth:`adapt` (the head has no
        meta-parameters to fall back on)."""
        if fast is None or "weight" not in fast:
            raise TypeError(
                "ProtoMAML's head starts at each task's prototypes: pass "
                "fast=learner.adapt(support, loss_fn)"
            )
        return call(self.model, fast, x)

    def clone(self, *, reduce: Reduce | None = None) -> Any:
        raise TypeError(
            "ProtoMAML's head starts at the prototypes of a support set, which clone() does "
            "not see: use learner.meta_loss(tasks, loss_fn), or learner.adapt(support, loss_fn)"
        )
