"""ANIL: almost no inner loop. Only the head adapts; the body's features are computed once.

Raghu, Raghu, Bengio & Vinyals, "Rapid Learning or Feature Reuse? Towards Understanding the
Effectiveness of MAML", ICLR 2020, arXiv:1909.09157. The body runs once on the support set and
once on the query set per task; every inner step reuses the support features, so an inner
step costs a pass through the head only. The meta-gradient reaches the body through those
features (to second order unless ``first_order``).
"""

from __future__ import annotations

from torch import Tensor, nn

from ._data import Batch, Task
from ._functional import Params, call, params_of
from ._inner import InnerOptimizer
from ._maml import MAML, LossFn, OptimizerFactory, Reduce, batch_share, identity_reduce, inner_loop


class BodyHead(nn.Module):
    """``head(body(x))``: the model ANIL meta-trains."""

    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body, self.head = body, head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


class ANIL(MAML):
    """MAML that adapts only ``head`` on features of ``body``.

    Args:
        body: the feature extractor (meta-trained, never adapted).
        head: the part adapted in the inner loop (usually the last linear layer).
        inner_lr, steps, first_order, optimizer, learn_lr: as :class:`metaddp.MAML`; learned
            rates cover the head's parameters only.
    """

    def __init__(
        self, body: nn.Module, head: nn.Module, inner_lr: float = 0.01, steps: int = 1,
        first_order: bool = False, optimizer: InnerOptimizer | OptimizerFactory | None = None,
        learn_lr: str | None = None,
    ) -> None:
        super().__init__(BodyHead(body, head), inner_lr, steps, first_order, optimizer, learn_lr)

    def adapted_module(self) -> nn.Module:
        return self.model.head

    def adapt_features(self, features: Batch, loss_fn: LossFn, *,
                       reduce: Reduce = identity_reduce, steps: int | None = None) -> Params:
        """Head weights after the inner loop on precomputed support ``features``."""
        return inner_loop(
            self.model.head, params_of(self.model.head), features, loss_fn,
            steps=self.steps if steps is None else steps,
            optimizer=self.inner_optimizer(), first_order=self.first_order, reduce=reduce,
        )

    def adapt(self, support: Batch, loss_fn: LossFn, *, reduce: Reduce = identity_reduce,
              steps: int | None = None) -> Params:
        """Head weights (names relative to ``head``) after adapting on ``support``."""
        feats = Batch(self.model.body(support.x), support.y, support.n)
        return self.adapt_features(feats, loss_fn, reduce=reduce, steps=steps)

    def forward(self, x: Tensor, params: Params | None = None) -> Tensor:
        """``head(body(x))`` with the head on ``params`` (names relative to the head)."""
        head = self.model.head
        return call(head, params if params is not None else params_of(head), self.model.body(x))

    def task_loss(self, task: Task, loss_fn: LossFn, *, reduce: Reduce = identity_reduce) -> Tensor:
        body = self.model.body
        head_fast = self.adapt(task.support, loss_fn, reduce=reduce)
        query = Batch(body(task.query.x), task.query.y, task.query.n)
        return batch_share(self.model.head, head_fast, query, loss_fn)

    def clone(self, reduce: Reduce = identity_reduce):
        raise TypeError(
            "ANIL has no clone(): adapt the head with `ANIL.adapt_features` on features "
            "`anil.model.body(x)`, or use MAML(...).clone() on the head module"
        )
