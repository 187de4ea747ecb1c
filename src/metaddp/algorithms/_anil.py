"""ANIL: almost no inner loop. Only the head adapts; the body's features are computed once.

Raghu, Raghu, Bengio & Vinyals, "Rapid Learning or Feature Reuse? Towards Understanding the
Effectiveness of MAML", ICLR 2020, arXiv:1909.09157. The body runs once on the support set and
once on the query set per task; every inner step reuses the support features, so an inner
step costs a pass through the head only. The meta-gradient reaches the body through those
features (to second order unless ``first_order``). Each of the body's passes is a forward of the
task's own, so dropout in the body draws masks keyed by the samples (:mod:`metaddp.forward`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Unpack

from torch import Tensor, nn

from .._data import Batch, Task
from .._functional import call, params_of
from .._types import LossFn, Params, Reduce, Supports
from ..forward import keyed_forward, needs_routes
from ._base import Algorithm, InnerSettings, need_loss, own_loss
from ._exact import Adapted


class BodyHead(nn.Module):
    """``head(body(x))``: the model ANIL meta-trains."""

    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body, self.head = body, head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


class ANIL(Algorithm):
    """Meta-learning that adapts only ``head``, on features of ``body``.

    Args:
        body: the feature extractor (meta-trained, never adapted).
        head: the part adapted in the inner loop (usually the last linear layer).
        settings: the inner loop's (``inner_lr``, ``steps``, ``first_order``, ``optimizer``,
            ``learn_lr``, ``memory``, ``autocast``, ``loss_scale``), as :class:`metaddp.MAML`
            takes them; learned rates cover the head's parameters only.

    Fast weights are the head's, named relative to the head (``"weight"``, ``"bias"``).
    """

    model: BodyHead  # what __init__ builds: ``self.model.body`` / ``.head`` are modules
    supports: ClassVar[Supports] = Supports(
        deterministic=True, low_memory=True, autocast=True, learn_lr=True, sharded=True,
        why=(own_loss("ANIL's (the body once per task, then the head's steps)"),),
    )  # fmt: skip

    def __init__(self, body: nn.Module, head: nn.Module, **settings: Unpack[InnerSettings]) -> None:
        super().__init__(BodyHead(body, head), **settings)

    def adapted_module(self) -> nn.Module:
        return self.model.head

    def features(self, batch: Batch) -> Batch:
        """``batch`` with the body's features in place of its inputs (where its samples start
        stays known): one forward of the current task, its dropout keyed by the samples."""
        with keyed_forward(batch):
            return batch._replace(x=call(self.model.body, {}, batch.x))

    def adapt(
        self,
        support: Batch,
        loss_fn: LossFn | None = None,
        *,
        steps: int | None = None,
        reduce: Reduce | None = None,
    ) -> Params:
        """Head weights (names relative to ``head``) after adapting on ``support``: the
        body's pass on it is the adaptation's first forward."""
        loss_fn = need_loss(loss_fn, type(self).__name__)
        with self.adapting(support, reduce) as c:
            return self.inner_loop(
                self.features(support),
                self.per_sample(loss_fn, c),
                steps=steps,
                reduce=self.fast_reduce(c.reduce),
                extra_grad=self.extra_grad(),
            )

    def forward(self, x: Tensor, fast: Mapping[str, Tensor] | None = None) -> Tensor:
        """``head(body(x))`` with the head on ``fast`` (names relative to the head)."""
        # The body's dropout is keyed where a forward's key is open (metaddp.forward).
        features = call(self.model.body, {}, x)
        return call(self.model.head, fast if fast is not None else self.fast_weights(), features)

    def task_loss(self, task: Task, loss_fn: LossFn, *, reduce: Reduce) -> Tensor:
        support, query = self.features(task.support), self.features(task.query)
        return self.adapted_loss(support, query, loss_fn, reduce=self.fast_reduce(reduce))

    def fast_reduce(self, reduce: Reduce) -> Reduce:
        """Where the body is sharded the reduction tells shards by their names (``by_name``),
        and the head's weights are whole whatever their names: their gradients are summed
        over the sample group as any statistic is (``values``); elsewhere ``reduce``."""
        return getattr(reduce, "values", reduce)

    def sharded_module(self) -> nn.Module:
        """The body: with ``shard=True`` its weights are rows, gathered for each of its
        passes; the head, which the inner loop adapts, stays whole on every rank."""
        return self.model.body

    def deterministic_refusal(self) -> str | None:
        if needs_routes(self.model):
            # The default mode draws the body's dropout once per task, on the support and the
            # query; the chunks here run the body at every step, which would draw others.
            return (
                "deterministic ANIL runs its body on every chunk of every inner step, where "
                "the default mode runs it once per task: with dropout or attention in the "
                "model its draws would differ. Use MAML (which adapts every weight), or "
                "train without deterministic mode"
            )
        return super().deterministic_refusal()

    def exact_meta_loss(
        self, tasks: Sequence[Task], loss_fn: LossFn, n_tasks: int, sums: Any
    ) -> Tensor:
        """Deterministic mode: the whole model runs on every chunk (the body too, whose
        features the default mode computes once per task), the head adapted, the body held
        and summed order-free as the head is (:mod:`metaddp.algorithms._exact`)."""
        if (why := self.deterministic_refusal()) is not None:
            raise ValueError(why)
        named = {k: f"head.{k}" for k in self.fast_weights()}  # rates by the model's names
        rates = None if self.lr is None else {named[k]: r for k, r in self.lr.as_dict().items()}
        adapted = Adapted(
            self.model,
            {named[k]: p for k, p in self.fast_weights().items()},
            tasks,
            loss_fn,
            sums=sums,
            rates=rates,
            held={f"body.{k}": p for k, p in params_of(self.model.body).items()},
        )
        adapted.run(self.steps, self.first_order, self._optimizer_on)
        return adapted.query_loss(n_tasks)
