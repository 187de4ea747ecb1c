"""Reptile: move the initialisation towards the weights each task's training reaches.

Nichol, Achiam & Schulman, "On First-Order Meta-Learning Algorithms", arXiv:1803.02999 (2018).
The meta-gradient is ``mean_tasks(theta - phi_task)``, ``phi_task`` the weights after the
inner loop (no second-order terms, no query loss). It arrives in ``.grad`` through an ordinary
``backward()``, so any ``torch.optim`` optimizer applies it: plain SGD with learning rate
``eps`` is the paper's update ``theta <- theta + eps * mean(phi - theta)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, cast

from torch import Tensor, nn

from .._data import Task
from .._functional import whole
from .._remat import Replay
from .._types import LossFn, Reduce, Supports
from ..inner import InnerOptimizer
from ._base import Algorithm, OptimizerFactory, local_fraction, own_loss
from ._exact import Adapted


class Reptile(Algorithm):
    """Reptile around any ``nn.Module`` (always first order).

    Args:
        model: the network; its parameters are the meta-parameters.
        inner_lr: step size of the inner optimizer.
        steps: inner steps per task (Reptile needs more than one to differ from joint training).
        optimizer: a differentiable inner optimizer (the paper uses Adam: ``metaddp.inner.adam``).
        learn_lr: not supported (the meta-gradient has no path to the rate); must be None.
        memory: any of :class:`metaddp.MAML`'s modes: the steps are first order, so the
            default loop's memory does not grow with them, and every mode runs it.
        batched: ``None`` or ``False``; ``True`` is refused (the displacement is a loss of
            Reptile's own, and stacked tasks are MAML's).

    :meth:`meta_loss` returns, per task, ``0.5 * ||theta - stop_grad(phi)||^2`` averaged over
    the meta-batch: its value is half the mean squared distance the inner loop moved, and
    its gradient is exactly the Reptile direction ``mean(theta - phi)``.

    In sample-parallel mode the inner gradients are reduced (so ``phi`` is the weights one
    process would reach on the whole support set) and each rank weighs the displacement by
    the fraction of the support samples it holds; these fractions add up to one, so summing
    gradients over ranks counts every task once.
    """

    # memory="low": the steps are first order, so each step's graph is freed as the next
    # begins; the default loop's memory does not grow with them (nothing to rebuild).
    supports: ClassVar[Supports] = Supports(
        sharded=True, deterministic=True, low_memory=True,
        why=(own_loss("Reptile's displacement"),),
    )  # fmt: skip

    def __init__(
        self,
        model: nn.Module,
        *,
        inner_lr: float = 0.01,
        steps: int = 5,
        optimizer: InnerOptimizer | OptimizerFactory | None = None,
        learn_lr: str | None = None,
        memory: str | Replay = "default",
        batched: bool | None = None,
    ) -> None:
        super().__init__(
            model,
            inner_lr=inner_lr,
            steps=steps,
            first_order=True,
            optimizer=optimizer,
            learn_lr=learn_lr,
            memory=memory,
            batched=batched,
        )

    def task_loss(self, task: Task, loss_fn: LossFn, *, reduce: Reduce) -> Tensor:
        theta = self.fast_weights()
        start = {k: p.detach().requires_grad_() for k, p in theta.items()}
        phi = self.inner_loop(task.support, loss_fn, reduce=reduce, start=start)
        # Whole weights where they are sharded: every rank's share of the displacement then
        # reaches every row (the gather's adjoint sums the shares), as it would in a forward.
        theta = dict(whole(self.model, theta))
        phi = dict(whole(self.model, {k: v.detach() for k, v in phi.items()}))
        # theta holds the adapted parameters (never empty), so the sum is a tensor.
        dist2 = cast(Tensor, sum(((theta[k] - phi[k]) ** 2).sum() for k in theta))
        return 0.5 * local_fraction(task.support) * dist2

    def exact_meta_loss(
        self, tasks: Sequence[Task], loss_fn: LossFn, n_tasks: int, sums: Any
    ) -> Tensor:
        """Deterministic mode: the inner loop's sums order-free (the chunks of
        :mod:`metaddp.algorithms._exact`), and the displacement's sum over tasks too."""
        optimizer = self.inner_optimizer()
        adapted = Adapted(self.model, self.fast_weights(), tasks, loss_fn, sums=sums)
        adapted.run(self.steps, True, lambda rates: optimizer)
        return adapted.displacement_loss(n_tasks)
