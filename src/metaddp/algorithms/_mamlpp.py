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
- **BNWB, BNRS**: every BatchNorm layer's weight and bias, and its running statistics when it
  keeps them, one set per inner step (``per_step_bn``). They are meta-parameters (and buffers)
  of this module, ``[steps, C]`` each; inner step ``i``'s forwards, on the support and then on
  the query, read row ``i``. As in the authors' code they are not adapted in the inner loop.
  The model's own BatchNorm weights are then not used (:meth:`MAMLPlusPlus.not_reached`).
- The cosine outer schedule is the training loop's (``metaddp train --outer-schedule cosine``).

The schedules read the meta-step a training loop gives :meth:`MAMLPlusPlus.at_step`; it is one
of the algorithm's settings, so processes that disagree on it fail at the gradient SUM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._adapt import batch_share, inner_loop, inner_steps
from .._data import Batch, Task, at_least
from .._remat import Replay
from .._types import LossFn, Params, Reduce, Supports
from ..inner import InnerOptimizer, per_step_sgd
from ._base import need_loss
from ._exact import Adapted
from ._learner import Learner
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
        per_step_bn: BatchNorm weights, biases and running statistics per inner step (BNWB,
            BNRS); ``False``: the model's own, adapted like any weight, as in MAML.
        autocast, conv: as :class:`metaddp.MAML`.
        memory: ``"default"`` only (any other is refused, with the reason).
        batched: ``True`` stacks the tasks (every inner step's query loss too), as MAML's
            ``batched``; per-step BatchNorm is not stacked, so it is refused there. ``False``
            (the default) runs them one by one, ``None`` lets MAML's rule choose.

    ``learner.module.at_step(i)`` before meta-step ``i`` drives the schedules;
    ``metaddp train`` calls it.
    """

    supports: ClassVar[Supports] = Supports(
        deterministic=True, autocast=True, inner_optimizer=False, capture=False, sharded=True,
        stacked=True,
        why=(
            ("low_memory", "its multi-step loss scores the query at every inner step's "
             "weights, and memory='low''s rebuilt loop returns the last step's only: use "
             "memory='default'"),
        ),
    )  # fmt: skip
    # Stacked tasks take MAML++'s multi-step loss (task_losses); per-step BatchNorm, which
    # they do not, is refused when batched=True is set.
    stackable: ClassVar[bool] = True

    learns_rates = True  # a rate per tensor and per step, from inner_lr

    def __init__(
        self,
        model: nn.Module,
        *,
        inner_lr: float = 0.01,
        steps: int = 5,
        msl_steps: int = 0,
        first_order_steps: int = 0,
        first_order: bool = False,
        per_step_bn: bool = True,
        autocast: torch.dtype | None = None,
        batched: bool | None = False,
        conv: str = "auto",
        memory: str | Replay = "default",
    ) -> None:
        at_least(msl_steps, "msl_steps", least=0)
        at_least(first_order_steps, "first_order_steps", least=0)
        super().__init__(
            model,
            inner_lr=inner_lr,
            steps=steps,
            first_order=first_order,
            autocast=autocast,
            batched=batched,
            conv=conv,
            memory=memory,
        )
        self.msl_steps, self.first_order_steps = msl_steps, first_order_steps
        self.meta_step = 0
        self.told = False  # whether at_step() was ever called (schedules need it)
        norms = [(n, m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
        if not per_step_bn:
            norms = []
        # BNWB: the trained affine tensors of every BatchNorm layer, a row per inner step.
        self.bn_keys = [
            f"{n}.{k}"
            for n, m in norms
            for k in ("weight", "bias")
            if m.affine and getattr(m, k).requires_grad
        ]
        own = dict(model.named_parameters())
        self.bn_steps = nn.ParameterList(
            nn.Parameter(own[k].detach().unsqueeze(0).repeat(steps, 1)) for k in self.bn_keys
        )
        # BNRS: the running statistics, a row per inner step (buffers: saved and broadcast).
        self.stat_layers = [n for n, m in norms if m.track_running_stats]
        for j, n in enumerate(self.stat_layers):
            m = dict(norms)[n]
            assert m.running_mean is not None and m.running_var is not None
            self.register_buffer(f"step_mean_{j}", m.running_mean.unsqueeze(0).repeat(steps, 1))
            self.register_buffer(f"step_var_{j}", m.running_var.unsqueeze(0).repeat(steps, 1))
        self.batched = batched  # checked again, now that the per-step BatchNorm is known
        like = self.fast_weights()
        self.names = list(like)
        # One rate per tensor and per step (nn.ParameterList: names may hold '.').
        self.lslr = nn.ParameterList(
            nn.Parameter(torch.full((steps,), float(inner_lr), dtype=p.dtype, device=p.device))
            for p in like.values()
        )

    def fast_weights(self) -> Params:
        """The weights the inner loop adapts: the model's, but per-step BatchNorm's."""
        held = set(getattr(self, "bn_keys", ()))
        return {k: p for k, p in super().fast_weights().items() if k not in held}

    def not_reached(self) -> set[str]:
        """The model's own BatchNorm weights, replaced by the per-step ones: the gradient SUM
        does not require theirs."""
        return {f"model.{k}" for k in self.bn_keys}

    def norms_at(self, step: int) -> tuple[Params, Params | None]:
        """Inner step ``step``'s BatchNorm weights (by the model's names) and running
        statistics (views of this module's rows, which the layers update in place), or
        ``None`` for the model's own. A step past the last reads the last row."""
        i = min(step, self.steps - 1)
        weights = {k: p[i] for k, p in zip(self.bn_keys, self.bn_steps, strict=True)}
        stats: Params = {}
        for j, n in enumerate(self.stat_layers):
            stats[f"{n}.running_mean"] = getattr(self, f"step_mean_{j}")[i]
            stats[f"{n}.running_var"] = getattr(self, f"step_var_{j}")[i]
        return weights, stats or None

    def at_step(self, step: int) -> None:
        at_least(step, "the meta-step", least=0)
        super().at_step(step)
        self.meta_step, self.told = step, True

    def second_order_now(self) -> bool:
        """Whether this meta-step's inner gradients keep their graph."""
        return not self.first_order and self.meta_step >= self.first_order_steps

    def weights_now(self) -> list[float]:
        """This meta-step's multi-step loss weights (:func:`step_weights`)."""
        return step_weights(self.steps, self.meta_step, self.msl_steps)

    def settings(self) -> dict[str, object]:
        return dict(
            super().settings(),
            per_step_bn=self.bn_keys + self.stat_layers,
            msl_steps=self.msl_steps,
            first_order_steps=self.first_order_steps,
            meta_step=self.meta_step,
        )

    def sharded_refusal(self) -> str | None:
        if self.bn_keys or self.stat_layers:
            return (
                "MAML++'s per-step BatchNorm weights and statistics (per_step_bn) stand in "
                "for whole BatchNorm tensors: build it with per_step_bn=False to shard it"
            )
        return super().sharded_refusal()

    def inner_optimizer(self) -> InnerOptimizer:
        return per_step_sgd(dict(zip(self.names, self.lslr, strict=True)))

    @property
    def batched(self) -> bool | None:
        """As :attr:`metaddp.MAML.batched`; ``True`` is refused with per-step BatchNorm."""
        return self._batched

    @batched.setter
    def batched(self, value: bool | None) -> None:
        if value and (getattr(self, "bn_keys", None) or getattr(self, "stat_layers", None)):
            raise ValueError(
                "MAML++'s per-step BatchNorm weights and statistics (per_step_bn) are not "
                "stacked: build it with per_step_bn=False to stack its tasks, or leave "
                "batched=False"
            )
        MAML.batched.fset(self, value)  # type: ignore[attr-defined]

    def task_losses(self, tasks: Sequence[Task], loss_fn: LossFn, reduce: Reduce) -> Tensor:
        """Stacked where MAML would stack (``batched``) and no per-step BatchNorm: every
        inner step's query shares, weighted; else :meth:`task_loss` one task at a time."""
        if self.bn_keys or self.stat_layers:
            return super(MAML, self).task_losses(tasks, loss_fn, reduce)
        return super().task_losses(tasks, loss_fn, reduce)

    def stacked_options(self) -> dict[str, Any]:
        self._require_told()
        return dict(first_order=not self.second_order_now(), step_weights=self.weights_now())

    def deterministic_refusal(self) -> str | None:
        if self.bn_keys or self.stat_layers:
            return (
                "MAML++'s per-step BatchNorm weights and statistics (per_step_bn) have no "
                "deterministic form: build it with per_step_bn=False for deterministic=True "
                "(metaddp train: --norm none)"
            )
        if self.batched:
            return (
                "deterministic mode cuts every batch into chunks and stacks them itself "
                "(MetaDDP(..., chunks=)), so batched=True would not apply: leave batched=False"
            )
        return super(MAML, self).deterministic_refusal()

    def _require_told(self) -> None:
        if (self.msl_steps or self.first_order_steps) and not self.told:
            raise RuntimeError(
                "MAML++'s schedules (msl_steps, first_order_steps) follow the meta-step, which "
                "it was never told: call learner.module.at_step(i) before meta-step i (metaddp "
                "train does), or build it with msl_steps=0 and first_order_steps=0"
            )

    def exact_meta_loss(
        self, tasks: Sequence[Task], loss_fn: LossFn, n_tasks: int, sums: Any
    ) -> Tensor:
        """Deterministic mode: MAML's chunked inner loop (:mod:`metaddp.algorithms._exact`)
        with the per-step rates, each step's query loss weighted as :meth:`task_loss`'s."""
        if (why := self.deterministic_refusal()) is not None:
            raise ValueError(why)
        self._require_told()
        rates = dict(zip(self.names, self.lslr, strict=True))
        adapted = Adapted(self.model, self.fast_weights(), tasks, loss_fn, sums=sums, rates=rates)
        steps = adapted.stepping(self.steps, not self.second_order_now(), _per_step)
        total: Tensor | None = None
        for fast, w in zip(steps, self.weights_now(), strict=True):
            if w:
                query = adapted.query_loss(n_tasks, fast)
                total = w * query if total is None else total + w * query
        assert total is not None  # the last weight is never 0
        return total

    def task_loss(self, task: Task, loss_fn: LossFn, *, reduce: Reduce) -> Tensor:
        """The weighted sum of the query shares after each inner step."""
        self._require_told()
        total: Tensor | None = None
        steps = inner_steps(
            self.model, self.fast_weights(), task.support, loss_fn, steps=self.steps,
            optimizer=self.inner_optimizer(), first_order=not self.second_order_now(),
            reduce=reduce, loss_scale=self.loss_scale, at=self.norms_at,
        )  # fmt: skip
        with torch.enable_grad():
            for i, (fast, w) in enumerate(zip(steps, self.weights_now(), strict=True)):
                if w:
                    norms, stats = self.norms_at(i)
                    query = batch_share(self.model, {**fast, **norms}, task.query, loss_fn, stats)
                    total = w * query if total is None else total + w * query
        assert total is not None  # the last weight is never 0
        return total

    def adapt(
        self,
        support: Batch,
        loss_fn: LossFn | None = None,
        *,
        steps: int | None = None,
        reduce: Reduce | None = None,
    ) -> Params:
        """The adapted weights after ``steps`` (default: the algorithm's) inner steps, with
        the BatchNorm weights and statistics of the last step taken, ready for
        ``learner(x, fast)``."""
        loss_fn = need_loss(loss_fn, type(self).__name__)
        steps = self.steps if steps is None else steps
        with self.adapting(support, reduce) as c:
            fast = inner_loop(
                self.model, self.fast_weights(), support, self.per_sample(loss_fn, c), steps=steps,
                optimizer=self.inner_optimizer(), first_order=self.first_order, reduce=c.reduce,
                loss_scale=self.loss_scale, at=self.norms_at,
            )  # fmt: skip
        norms, stats = self.norms_at(max(steps - 1, 0))
        return {**fast, **norms, **(stats or {})}

    def clone(self, *, reduce: Reduce | None = None) -> Learner:
        if self.bn_keys or self.stat_layers:
            raise TypeError(
                "MAML++'s per-step BatchNorm changes the network at every inner step, which "
                "clone()'s adapt(loss) does not know: use learner.meta_loss(tasks, loss_fn) "
                "and learner.adapt(support, loss_fn), or build it with per_step_bn=False"
            )
        return super().clone(reduce=reduce)


def _per_step(rates: Params | None) -> InnerOptimizer:
    assert rates is not None  # MAML++'s rates are always learned
    return per_step_sgd(rates)
