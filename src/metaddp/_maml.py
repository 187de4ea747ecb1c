"""MAML: adapt fast weights on a task's support set, score them on its query set.

Rank-agnostic by construction. Every gradient of a support loss passes through ``reduce``,
a function that the caller supplies: the identity on one process, or a differentiable SUM
over the ranks that hold the other shards of the same task. The losses are shares
(:func:`metaddp.share`), so reduced gradients are gradients of the global mean.
Finn, Abbeel & Levine, "Model-Agnostic Meta-Learning", ICML 2017, arXiv:1703.03400.

:class:`MAML` is also the base of the other algorithms (Meta-SGD, ANIL, Reptile, iMAML): they
share its inner loop and its meta-batch bookkeeping and override :meth:`MAML.task_loss`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from ._batched import batched_meta_loss, use_batched
from ._batched import batched_meta_loss, use_batched
from ._data import Batch, Task
from ._functional import Params, call, params_of
from ._inner import InnerOptimizer, LearningRate, apply_updates, sgd
from ._learned_lr import LearnedLR
from ._share import share

LossFn = Callable[[Tensor, Tensor], Tensor]
Reduce = Callable[[list[Tensor]], list[Tensor]]
OptimizerFactory = Callable[[LearningRate], InnerOptimizer]


def identity_reduce(tensors: list[Tensor]) -> list[Tensor]:
    """The ``reduce`` of one process: every gradient is already global."""
    return tensors


def batch_share(
    model: nn.Module, params: Mapping[str, Tensor], batch: Batch, loss_fn: LossFn,
    buffers: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """This rank's share of the mean loss of ``params`` over the whole (global) ``batch``."""
    return share(loss_fn(call(model, params, batch.x, buffers=buffers), batch.y), batch.n)


def local_fraction(batch: Batch) -> float:
    """The fraction of ``batch``'s global samples this rank holds.

    Over the ranks that split a batch these fractions add up to one, so a quantity every
    one of them holds in full (a displacement, an implicit gradient) weighted by it becomes
    a share, and the usual SUM of meta-gradients counts it once.
    """
    return batch.x.shape[0] / batch.n


def check_finite(grads: Mapping[str, Tensor], step: int) -> None:
    """Raise :class:`FloatingPointError` naming the first non-finite gradient."""
    for k, g in grads.items():
        if not torch.isfinite(g).all():
            raise FloatingPointError(
                f"inner step {step}: the gradient of {k!r} is not finite (NaN or Inf); lower "
                "the inner learning rate, check the support data, or use adam(eps_root>0) if "
                "a second-order step divides by a zero second moment"
            )


def support_grads(
    model: nn.Module, fast: Params, support: Batch, loss_fn: LossFn, *, create_graph: bool,
    reduce: Reduce, buffers: Mapping[str, Tensor] | None = None,
) -> Params:
    """Gradient of the *global* support loss at ``fast``: local share gradients, reduced."""
    names = list(fast)
    loss = batch_share(model, fast, support, loss_fn, buffers)
    grads = torch.autograd.grad(
        loss, [fast[k] for k in names], create_graph=create_graph,
        allow_unused=True, materialize_grads=True,
    )
    return dict(zip(names, reduce(list(grads))))


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
    extra_grad: Callable[[Params], Params] | None = None,
) -> Params:
    """``steps`` differentiable optimizer steps on the support loss; returns the fast weights.

    Args:
        model: the network, called functionally on the fast weights.
        params: the weights to start from (names missing here keep the model's own).
        support: this rank's shard of the support batch.
        loss_fn: per-sample loss (``reduction='none'``).
        steps: number of inner steps.
        optimizer: a differentiable inner optimizer (:func:`metaddp.sgd`, :func:`metaddp.adam`).
        first_order: treat inner gradients as constants (first-order MAML); otherwise they
            are built with ``create_graph=True`` and the meta-gradient is exact to second order.
        reduce: SUM of gradients over the ranks sharing this task's samples.
        buffers: buffers to run the model with (default: its own).
        extra_grad: a gradient term added after the reduction, a function of the fast
            weights that every rank computes in full (iMAML's proximal term).

    Returns:
        The adapted fast weights.
    """
    fast: Params = dict(params)
    state = optimizer.init(fast)
    with torch.enable_grad():
        for step in range(steps):
            grads = support_grads(model, fast, support, loss_fn, create_graph=not first_order,
                                  reduce=reduce, buffers=buffers)
            if extra_grad is not None:
                extra = extra_grad(fast)
                grads = {k: g + extra[k] for k, g in grads.items()}
            check_finite(grads, step)
            updates, state = optimizer.update(grads, state, fast)
            fast = apply_updates(fast, updates)
    return fast


class MAML(nn.Module):
    """Model-agnostic meta-learning around any ``nn.Module``, which it never mutates.

    Args:
        model: the network; its parameters are the meta-parameters.
        inner_lr: step size of the inner optimizer (its initial value when learned).
        steps: inner steps per task.
        first_order: drop second-order terms (first-order MAML).
        optimizer: a differentiable inner optimizer (``metaddp.sgd(0.1, momentum=0.9)``...)
            replacing SGD; with ``learn_lr``, a factory taking the learning rate instead
            (``metaddp.sgd``, ``functools.partial(metaddp.adam, b1=0.5)``).
        learn_lr: train the inner learning rate in the outer loop: ``"scalar"``,
            ``"tensor"`` (one per parameter tensor) or ``"parameter"`` (one per entry, as
            Meta-SGD). The rates are parameters of this module, kept in :attr:`lr`.
        batched: run a rank's tasks stacked along a task dimension (``True``), one by one
            (``False``), or choose (``None``: by device and model, see ``use_batched``); same result.
    """

    def __init__(
        self, model: nn.Module, inner_lr: float = 0.01, steps: int = 1,
        first_order: bool = False, optimizer: InnerOptimizer | OptimizerFactory | None = None,
        learn_lr: str | None = None, batched: bool | None = None,
    ) -> None:
        super().__init__()
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.model = model
        self.inner_lr, self.steps, self.first_order = inner_lr, steps, first_order
        self.batched = batched
        self.lr: LearnedLR | None = None
        if learn_lr is not None:
            if isinstance(optimizer, InnerOptimizer):
                raise TypeError(
                    "with learn_lr the optimizer must be a factory taking the learning rate "
                    "(e.g. metaddp.sgd or functools.partial(metaddp.adam, b1=0.5)), not a built optimizer"
                )
            self.lr = LearnedLR(params_of(self.adapted_module()), inner_lr, learn_lr)
            self._factory: OptimizerFactory = optimizer or sgd
            self.optimizer = None
        else:
            if optimizer is not None and not isinstance(optimizer, InnerOptimizer):
                optimizer = optimizer(inner_lr)
            self.optimizer = optimizer or sgd(inner_lr)

    def adapted_module(self) -> nn.Module:
        """The module whose parameters the inner loop adapts (the whole model here)."""
        return self.model

    def inner_optimizer(self) -> InnerOptimizer:
        """The inner optimizer, built on the current learned rates when they are learned."""
        if self.lr is not None:
            return self._factory(self.lr.as_dict())
        return self.optimizer

    def fast_weights(self) -> Params:
        """The weights adaptation starts from (the meta-parameters themselves)."""
        return params_of(self.adapted_module())

    def adapt(self, support: Batch, loss_fn: LossFn, *, reduce: Reduce = identity_reduce,
              steps: int | None = None) -> Params:
        """Fast weights after ``steps`` inner steps on ``support``."""
        return inner_loop(
            self.model, self.fast_weights(), support, loss_fn,
            steps=self.steps if steps is None else steps, optimizer=self.inner_optimizer(),
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
                optimizer=self.inner_optimizer(), first_order=self.first_order, reduce=reduce)
        for task in tasks:
            total = total + self.task_loss(task, loss_fn, reduce=reduce)
        return total / n_tasks

    def clone(self, reduce: Reduce = identity_reduce) -> "Learner":
        """A learner holding its own fast weights, in the style of learn2learn's ``clone``.

        ``learner.adapt(loss)`` takes one inner step on a loss computed with ``learner(x)``;
        ``learner(x)`` runs the model on the current fast weights. The wrapped module is
        never modified. ``reduce`` is the SUM of gradients over the ranks that split the
        task's samples (``MetaDDP.reduce``); the loss given to ``adapt`` must then be this
        rank's share (:func:`metaddp.share`).
        """
        from ._learner import Learner

        return Learner(self.model, self.fast_weights(), self.inner_optimizer(),
                       first_order=self.first_order, reduce=reduce)
