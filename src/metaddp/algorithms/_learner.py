"""A stateful learner over the functional core, for code written against learn2learn or higher.

``learner = maml.clone()`` holds fast weights and an optimizer state; ``learner.adapt(loss)``
replaces them with the next ones, differentiably; ``learner(x)`` runs the model on them.
Nothing is written into the module: each call goes through ``torch.func.functional_call``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from .._adapt import inner_step
from .._types import Params, Reduce, identity_reduce
from ..inner import InnerOptimizer


class Learner:
    """Fast weights of one task, stepped by :meth:`adapt`.

    Args:
        run: ``run(fast_weights, *args)`` evaluates the model on the fast weights.
        params: the starting weights (usually the meta-parameters).
        optimizer: the differentiable inner optimizer.
        first_order: treat inner gradients as constants.
        reduce: SUM of gradients over the ranks that split the task's samples.
        extra_grad: what the algorithm adds to every step's gradient (iMAML's proximal term).
        check_share: refuses a loss that is not a share of a known batch (the wrapper's).
    """

    def __init__(
        self,
        run: Callable[..., Any],
        params: Mapping[str, Tensor],
        optimizer: InnerOptimizer,
        *,
        first_order: bool = False,
        reduce: Reduce = identity_reduce,
        extra_grad: Callable[[Params], Params] | None = None,
        check_share: Callable[[Tensor, str], None] = lambda loss, where: None,
    ) -> None:
        self._run = run
        self.params: Params = dict(params)
        self.optimizer = optimizer
        self.state = optimizer.init(self.params)
        self.first_order = first_order
        self.reduce = reduce
        self.steps = 0
        self.extra_grad = extra_grad
        self.check_share = check_share

    def adapt(self, loss: Tensor) -> None:
        """One inner step on ``loss`` (this rank's share of a loss computed with ``self(x)``).

        Where ranks split the task's samples, ``loss`` must be ``metaddp.share(per_sample,
        batch)``: a plain mean, or a share of a count, is refused (each rank would step on its
        own shard's mean)."""
        self.check_share(loss, "learner.adapt(loss)")
        self.params, self.state = inner_step(
            loss,
            self.params,
            self.state,
            self.optimizer,
            step=self.steps,
            reduce=self.reduce,
            first_order=self.first_order,
            extra_grad=self.extra_grad,
        )
        self.steps += 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self.params, *args, **kwargs)

    def parameters(self) -> list[Tensor]:
        """The current fast weights (tensors on the graph of the meta-parameters)."""
        return list(self.params.values())
