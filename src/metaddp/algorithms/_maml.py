"""MAML: adapt fast weights on a task's support set, score them on its query set.

Finn, Abbeel & Levine, "Model-Agnostic Meta-Learning", ICML 2017, arXiv:1703.03400.
A rank's tasks run stacked along a task dimension (:mod:`metaddp.algorithms._stacked`) or one
by one, with the same meta-gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Unpack

import torch
from torch import Tensor, nn

from .. import forward as _draws
from .._data import Task
from .._functional import params_of
from .._types import LossFn, Reduce, Supports
from ._base import Algorithm, InnerSettings
from ._conv_ways import ConvChoice
from ._exact import exact_meta_loss
from ._stacked import stacked_task_losses, use_batched


class MAMLSettings(InnerSettings, total=False):
    """:class:`MAML`'s settings, which the algorithms built on it take as ``**settings``."""

    conv: str


class MAML(Algorithm):
    """Model-agnostic meta-learning around any ``nn.Module``, which it never mutates.

    Args:
        model: the network; its parameters are the meta-parameters.
        inner_lr: step size of the inner optimizer (its initial value when learned); 0.01.
        steps: inner steps per task; 1.
        first_order: drop second-order terms (first-order MAML); ``False``.
        optimizer: a differentiable inner optimizer (``metaddp.inner.sgd(0.1, momentum=0.9)``...)
            replacing SGD; with ``learn_lr``, a factory taking the learning rate instead
            (``metaddp.inner.sgd``, ``functools.partial(metaddp.inner.adam, b1=0.5)``).
        learn_lr: train the inner learning rate in the outer loop: ``"scalar"``,
            ``"tensor"`` (one per parameter tensor) or ``"parameter"`` (one per entry, as
            Meta-SGD). The rates are parameters of this module, kept in :attr:`lr`.
        memory: ``"default"`` keeps every inner step's graph for the outer backward;
            ``"low"`` rebuilds one step's graph at a time (:mod:`metaddp._remat`), in
            ``meta_loss`` itself: the same meta-gradient, with memory that does not grow
            with ``steps`` and one more collective per inner step but the last on several
            ranks. Stacked tasks rebuild one stacked step at a time; tasks one by one keep
            only gradients the size of their weights until the backward. ``"low"`` keeps
            the weights (and optimizer state) before every step; ``"replay"`` or
            :class:`metaddp.Replay` keeps a tree of O(k log_k K) of them and replays the
            rest, for loops of thousands of steps (the same meta-gradient).
        autocast: run the forward passes (inner and query) under ``torch.autocast`` in this
            dtype (``torch.bfloat16`` or ``torch.float16``); the meta-parameters, gradients and
            reductions keep the parameters' dtype. Faster matrix work on a GPU, at the
            precision measured in BENCHMARKS.md.
        loss_scale: the inner steps' dynamic loss scaling under float16
            (:class:`metaddp.inner.LossScale`; the default scales float16 autocast and
            nothing else), or ``None``/``False``: none.
        batched: run a rank's tasks stacked along a task dimension (``True``), one by one
            (``False``), or choose (``None``: by device and model, see ``use_batched``); same
            result.
        conv: how stacked forward convolutions run: ``"auto"`` (each shape's fastest way,
            timed at its first call and remembered in :attr:`conv`), or one of
            ``"grouped"``, ``"per_task"``, ``"transposed"``, ``"channels_last"``; the same
            sums to rounding (``metaddp.algorithms._conv_ways``).
    """

    supports: ClassVar[Supports] = Supports(
        deterministic=True, low_memory=True, autocast=True, learn_lr=True, sharded=True,
        stacked=True,
    )  # fmt: skip

    stackable: ClassVar[bool] = True
    """Whether :meth:`task_losses` may run the stacked executor, which computes MAML's own
    adapt-then-query loss. A subclass that defines its own ``task_loss``, ``adapt`` or
    ``forward`` is not stackable unless it says so (``stackable = True``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "stackable" not in cls.__dict__ and any(
            name in cls.__dict__
            for name in ("task_loss", "adapted_loss", "inner_loop", "adapt", "forward")
        ):
            cls.stackable = False

    def __init__(
        self,
        model: nn.Module,
        *,
        conv: str = "auto",
        **settings: Unpack[InnerSettings],
    ) -> None:
        super().__init__(model, **settings)  # batched= among them: the property below
        self.conv = ConvChoice(conv)

    @property
    def batched(self) -> bool | None:
        """Stacked tasks: ``True``, ``False`` or ``None`` (chosen); see the class docstring.
        Checked when set: ``True`` needs MAML's own task loss (:attr:`stackable`) and no
        float16 loss scaling, which stacked steps do not take."""
        return self._batched

    @batched.setter
    def batched(self, value: bool | None) -> None:
        if value not in (True, False, None):
            raise TypeError(f"batched must be True, False or None, got {value!r}")
        if value and not self.stackable:
            raise ValueError(
                f"batched=True runs MAML's own task loss, which {type(self).__name__} "
                "overrides: use batched=None or False (or set stackable = True on the class "
                "if the override keeps MAML's loss)"
            )
        self._batched = value
        if value:
            self.unscaled("batched=True (stacked tasks)")

    def task_loss(self, task: Task, loss_fn: LossFn, *, reduce: Reduce) -> Tensor:
        """This rank's share of one task's query loss after adaptation."""
        return self.adapted_loss(task.support, task.query, loss_fn, reduce=reduce)

    def deterministic_refusal(self) -> str | None:
        name = type(self).__name__
        if not self.stackable:
            return (
                f"deterministic mode runs MAML's own task loss, which {name} overrides: build "
                "MetaDDP without deterministic=True to train it (exact to rounding)"
            )
        if (why := super().deterministic_refusal()) is not None:
            return why
        if self.batched is not None:
            return (
                f"deterministic mode cuts every batch into chunks and stacks them itself "
                f"(MetaDDP(..., chunks=)), so batched={self.batched} would not apply: leave "
                "batched=None"
            )
        return None

    def exact_meta_loss(
        self, tasks: Sequence[Task], loss_fn: LossFn, n_tasks: int, sums: Any
    ) -> Tensor:
        if (why := self.deterministic_refusal()) is not None:
            raise ValueError(why)
        fast = self.fast_weights()
        return exact_meta_loss(
            self.model,
            fast,
            tasks,
            loss_fn,
            n_tasks=n_tasks,
            steps=self.steps,
            first_order=self.first_order,
            build=self._optimizer_on,
            rates=None if self.lr is None else self.lr.as_dict(),
            sums=sums,
            held={k: p for k, p in params_of(self.model).items() if k not in fast},
        )

    def task_losses(self, tasks: Sequence[Task], loss_fn: LossFn, reduce: Reduce) -> Tensor:
        # batched=True is checked when set (and the loss scale when it is set).
        scaled = self.loss_scale is not None and self.autocast == torch.float16
        stack = self.stackable and not scaled
        if stack and use_batched(self.batched, tasks, self.model):
            self.low_float16()  # autocast may have been set after memory
            with _draws.stacked_tasks(len(tasks)):
                return stacked_task_losses(
                    self.model,
                    self.fast_weights(),
                    tasks,
                    loss_fn,
                    steps=self.steps,
                    optimizer=self.inner_optimizer,
                    reduce=reduce,
                    conv=self.conv,
                    **self.stacked_options(),
                )
        return super().task_losses(tasks, loss_fn, reduce)

    def stacked_options(self) -> dict[str, Any]:
        """What the stacked executor takes from this algorithm beyond its weights, tasks and
        optimizer (:func:`metaddp.algorithms._stacked.stacked_task_losses`)."""
        return dict(
            first_order=self.first_order,
            rematerialize=self._rematerialize(),
            replay=self._replay(),
            extras=self._needing_grad(),
        )
