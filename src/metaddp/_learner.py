"""A stateful learner over the functional core, for code written against learn2learn or higher.

``learner = maml.clone()`` holds fast weights and an optimizer state; ``learner.adapt(loss)``
replaces them with the next ones, differentiably; ``learner(x)`` runs the model on them.
Nothing is written into the module: each call goes through ``torch.func.functional_call``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ._functional import Params, call
from ._inner import InnerOptimizer, apply_updates

Reduce = Callable[[list[Tensor]], list[Tensor]]


class Learner:
    """Fast weights of one task, stepped by :meth:`adapt`.

    Args:
        model: the module to run (never modified).
        params: the starting weights (usually the meta-parameters).
        optimizer: the differentiable inner optimizer.
        first_order: treat inner gradients as constants.
        reduce: SUM of gradients over the ranks that split the task's samples.
    """

    def __init__(self, model: nn.Module, params: Mapping[str, Tensor], optimizer: InnerOptimizer,
                 *, first_order: bool = False, reduce: Reduce | None = None) -> None:
        self.model = model
        self.params: Params = dict(params)
        self.optimizer = optimizer
        self.state = optimizer.init(self.params)
        self.first_order = first_order
        self.reduce = reduce if reduce is not None else (lambda ts: ts)
        self.steps = 0

    def adapt(self, loss: Tensor) -> None:
        """One inner step on ``loss`` (this rank's share of a loss computed with ``self(x)``)."""
        from ._maml import check_finite

        if loss.dim() != 0:
            raise ValueError(
                f"adapt() takes a scalar loss, got shape {tuple(loss.shape)}; on several ranks "
                "pass metaddp.share(per_sample_losses, n_global)"
            )
        names = list(self.params)
        with torch.enable_grad():
            grads = torch.autograd.grad(
                loss, [self.params[k] for k in names], create_graph=not self.first_order,
                allow_unused=True, materialize_grads=True,
            )
        grads_d = dict(zip(names, self.reduce(list(grads))))
        check_finite(grads_d, self.steps)
        updates, self.state = self.optimizer.update(grads_d, self.state, self.params)
        self.params = apply_updates(self.params, updates)
        self.steps += 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call(self.model, self.params, *args, **kwargs)

    def parameters(self) -> list[Tensor]:
        """The current fast weights (tensors on the graph of the meta-parameters)."""
        return list(self.params.values())
