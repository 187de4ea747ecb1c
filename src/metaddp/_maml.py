"""MAML: adapt fast weights on a task's support set, score them on its query set.

Rank-agnostic by construction. Every gradient of a support loss passes through ``reduce``,
a function that the caller supplies: the identity on one process, or a differentiable SUM
over the ranks that hold the other shards of the same task. The losses are shares
(:func:`metaddp.share`), so reduced gradients are gradients of the global mean.
Finn, Abbeel & Levine, "Model-Agnostic Meta-Learning", ICML 2017, arXiv:1703.03400.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from ._batched import batched_meta_loss, use_batched
from ._data import Batch, Task
from ._functional import Params, call, params_of
from ._inner import InnerOptimizer, apply_updates, sgd
from ._share import share

LossFn = Callable[[Tensor, Tensor], Tensor]
Reduce = Callable[[list[Tensor]], list[Tensor]]


def identity_reduce(tensors: list[Tensor]) -> list[Tensor]:
    return tensors


def batch_share(
    model: nn.Module, params: Mapping[str, Tensor], batch: Batch, loss_fn: LossFn,
    buffers: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """This rank's share of the mean loss of ``params`` over the whole (global) ``batch``."""
    return share(loss_fn(call(model, params, batch.x, buffers=buffers), batch.y), batch.n)


def inner_loop(
    model: nn.Module,
    params: Mapping[str, Tensor],
    support: Batch,
    loss_fn: LossFn,
    *,
    steps: int,
    optimizer: InnerOptimizer,
    first_order: bool = False,
    reduce: Reduce = identity_reduce,
    buffers: Mapping[str, Tensor] | None = None,
) -> Params:
    """``steps`` differentiable optimizer steps on the support loss; returns the fast weights.

    With ``first_order`` the inner gradients are constants (first-order MAML); otherwise
    they are built with ``create_graph=True`` and the meta-gradient is exact to second order.
    """
    names = list(params)
    fast: Params = dict(params)
    state = optimizer.init(fast)
    with torch.enable_grad():
        for step in range(steps):
            loss = batch_share(model, fast, support, loss_fn, buffers)
            grads = torch.autograd.grad(
                loss, [fast[k] for k in names], create_graph=not first_order,
                allow_unused=True, materialize_grads=True,
            )
            grads = reduce(list(grads))
            for k, g in zip(names, grads):
                if not torch.isfinite(g).all():
                    raise FloatingPointError(
                        f"inner step {step}: the gradient of {k!r} is not finite; lower the "
                        "inner learning rate or check the support data"
                    )
            updates, state = optimizer.update(dict(zip(names, grads)), state, fast)
            fast = apply_updates(fast, updates)
    return fast


class MAML(nn.Module):
    """Model-agnostic meta-learning around any ``nn.Module``, which it never mutates.

    Args:
        model: the network; its parameters are the meta-parameters.
        inner_lr: step size of the default inner optimizer (SGD).
        steps: inner steps per task.
        first_order: drop second-order terms (first-order MAML).
        optimizer: a differentiable inner optimizer (``metaddp.sgd`` ...) replacing SGD.
        batched: run a rank's tasks stacked along a task dimension (``True``), one by one
            (``False``), or choose (``None``: by device and model, see ``use_batched``); same result.
    """

    def __init__(
        self, model: nn.Module, inner_lr: float = 0.01, steps: int = 1,
        first_order: bool = False, optimizer: InnerOptimizer | None = None,
        batched: bool | None = None,
    ) -> None:
        super().__init__()
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.model = model
        self.inner_lr, self.steps, self.first_order = inner_lr, steps, first_order
        self.optimizer = optimizer or sgd(inner_lr)
        self.batched = batched

    def fast_weights(self) -> Params:
        """The weights adaptation starts from (the meta-parameters themselves)."""
        return params_of(self.model)

    def adapt(self, support: Batch, loss_fn: LossFn, *, reduce: Reduce = identity_reduce,
              steps: int | None = None) -> Params:
        """Fast weights after ``steps`` inner steps on ``support``."""
        return inner_loop(
            self.model, self.fast_weights(), support, loss_fn,
            steps=self.steps if steps is None else steps, optimizer=self.optimizer,
            first_order=self.first_order, reduce=reduce,
        )

    def forward(self, x: Tensor, params: Mapping[str, Tensor] | None = None) -> Tensor:
        return call(self.model, params if params is not None else self.fast_weights(), x)

    def task_loss(self, task: Task, loss_fn: LossFn, *, reduce: Reduce = identity_reduce) -> Tensor:
        """This rank's share of one task's query loss after adaptation."""
        fast = self.adapt(task.support, loss_fn, reduce=reduce)
        return batch_share(self.model, fast, task.query, loss_fn)

    def meta_loss(self, tasks: Sequence[Task], loss_fn: LossFn, n_tasks: int, *,
                  reduce: Reduce = identity_reduce) -> Tensor:
        """This rank's share of the meta-batch loss: its tasks' query shares over ``n_tasks``.

        ``tasks`` are the tasks this rank works on (possibly none); ``n_tasks`` is the number
        of tasks in the global meta-batch.
        """
        if n_tasks <= 0:
            raise ValueError(f"a meta-batch needs at least one task, got n_tasks={n_tasks}")
        # Start from an exact zero that touches every meta-parameter: a rank holding no task
        # then still gives every parameter a (zero) gradient, and the gradient sum over ranks
        # sees the same tensors everywhere.
        total = sum(p.sum() * 0.0 for p in self.parameters())
        # Stacking reproduces MAML's own adapt + task_loss; a subclass overriding them loops.
        own = type(self).task_loss is MAML.task_loss and type(self).adapt is MAML.adapt
        if (own or self.batched) and use_batched(self.batched, tasks, self.model):
            if not own:
                raise ValueError(f"batched=True runs MAML's own task loss, which "
                                 f"{type(self).__name__} overrides: use batched=None or False")
            return total + batched_meta_loss(
                self.model, self.fast_weights(), tasks, loss_fn, n_tasks, steps=self.steps,
                optimizer=self.optimizer, first_order=self.first_order, reduce=reduce)
        for task in tasks:
            total = total + self.task_loss(task, loss_fn, reduce=reduce)
        return total / n_tasks
