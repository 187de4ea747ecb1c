"""MAML++: MAML with the training fixes of Antoniou, Edwards & Storkey, "How to train your
MAML", ICLR 2019, arXiv:1810.09502.

- **LSLR**: a learned inner rate per parameter tensor and per inner step
  (:func:`metaddp.inner.per_step_sgd`), meta-parameters of this module.
- **MSL**: the query loss after *every* inner step, weighted; the weights anneal from equal
  towards the last step over the first ``msl_steps`` meta-steps, then the last step alone
  counts. The schedule is the paper code's (``get_per_step_loss_importance_vector``), in
  meta-steps instead of epochs: the weights multiply the losses.
- **DA**: first-order meta-gradients for the first ``first_order_steps`` meta-steps, then
  second order.
- The cosine outer schedule is the training loop's (``metaddp train --outer-schedule cosine``).

The schedules read the meta-step a training loop gives :meth:`MAMLPlusPlus.at_step`; it is one
of the algorithm's settings, so processes that disagree on it fail at the gradient SUM.
Per-step BatchNorm weights and statistics (BNWB, BNRS) are not here: BatchNorm layers keep
one set, as in MAML.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from .._adapt import batch_share, inner_step
from .._data import Task
from .._types import LossFn, Reduce, Supports
from ..inner import InnerOptimizer, per_step_sgd
from ._maml import MAML

MIN_NON_FINAL = 0.03
"""The paper code's floor of each non-final step's weight, times the number of steps."""


def step_weights(steps: int, meta_step: int, msl_steps: int) -> list[float]:
    """The multi-step loss's weight of each inner step's query loss at ``meta_step``.

    Equal (``1/K``) at the start; each non-final weight falls by ``1/(K msl_steps)`` per
    meta-step to ``0.03/K`` and the final one rises by what they lose, to at most
    ``1 - (K-1) 0.03/K``; from ``msl_steps`` on the final step alone (weight 1).
    """
    if meta_step >= msl_steps:
        return [0.0] * (steps - 1) + [1.0]
    k = steps
    decay = 1.0 / k / msl_steps
    floor = MIN_NON_FINAL / k
    out = [max(1.0 / k - meta_step * decay, floor) for _ in range(k - 1)]
    out.append(min(1.0 / k + meta_step * (k - 1) * decay, 1.0 - (k - 1) * floor))
    return out


class MAMLPlusPlus(MAML):
    """MAML++ around any ``nn.Module`` (see the module's docstring for what it adds).

    Args:
        model: the network; its parameters are meta-parameters.
        inner_lr: every per-step rate's initial value.
        steps: inner steps per task.
        msl_steps: meta-steps over which the multi-step loss anneals (0: the last step's
            loss alone from the start).
        first_order_steps: meta-steps trained first order before second order.
        first_order: first order throughout.
        autocast, conv: as :class:`metaddp.MAML` (tasks run one by one: each inner step
            scores the query set too).

    ``learner.module.at_step(i)`` before meta-step ``i`` drives the schedules;
    ``metaddp train`` calls it.
    """

    supports: ClassVar[Supports] = Supports(autocast=True, inner_optimizer=False, capture=False)

    def __init__(
        self,
        model: nn.Module,
        *,
        inner_lr: float = 0.01,
        steps: int = 5,
        msl_steps: int = 0,
        first_order_steps: int = 0,
        first_order: bool = False,
        autocast: torch.dtype | None = None,
        conv: str = "auto",
    ) -> None:
        for name, v in (("msl_steps", msl_steps), ("first_order_steps", first_order_steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        super().__init__(
            model,
            inner_lr=inner_lr,
            steps=steps,
            first_order=first_order,
            autocast=autocast,
            batched=False,
            conv=conv,
        )
        self.msl_steps, self.first_order_steps = msl_steps, first_order_steps
        self.meta_step = 0
        like = self.fast_weights()
        self.names = list(like)
        # One rate per tensor and per step (nn.ParameterList: names may hold '.').
        self.lslr = nn.ParameterList(
            nn.Parameter(torch.full((steps,), float(inner_lr), dtype=p.dtype, device=p.device))
            for p in like.values()
        )

    def at_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"the meta-step must be an integer >= 0, got {step!r}")
        self.meta_step = step

    def second_order_now(self) -> bool:
        """Whether this meta-step's inner gradients keep their graph."""
        return not self.first_order and self.meta_step >= self.first_order_steps

    def weights_now(self) -> list[float]:
        """This meta-step's multi-step loss weights (:func:`step_weights`)."""
        return step_weights(self.steps, self.meta_step, self.msl_steps)

    def settings(self) -> dict[str, object]:
        return dict(
            super().settings(),
            msl_steps=self.msl_steps,
            first_order_steps=self.first_order_steps,
            meta_step=self.meta_step,
        )

    def inner_optimizer(self) -> InnerOptimizer:
        return per_step_sgd(dict(zip(self.names, self.lslr, strict=True)))

    def task_loss(self, task: Task, loss_fn: LossFn, *, reduce: Reduce) -> Tensor:
        """The weighted sum of the query shares after each inner step."""
        fast = self.fast_weights()
        optimizer = self.inner_optimizer()
        state = optimizer.init(fast)
        first_order = not self.second_order_now()
        total: Tensor | None = None
        with torch.enable_grad():
            for i, w in enumerate(self.weights_now()):
                loss = batch_share(self.model, fast, task.support, loss_fn)
                fast, state = inner_step(
                    loss, fast, state, optimizer, step=i, reduce=reduce, first_order=first_order
                )
                if w:
                    scored = w * batch_share(self.model, fast, task.query, loss_fn)
                    total = scored if total is None else total + scored
        assert total is not None  # the last weight is never 0
        return total
