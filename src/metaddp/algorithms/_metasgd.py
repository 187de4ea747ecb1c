"""Meta-SGD: MAML whose inner learning rate is learned, one rate per parameter entry.

Li, Zhou, Chen & Li, "Meta-SGD: Learning to Learn Quickly for Few-Shot Learning",
arXiv:1707.09835 (2017): ``phi = theta - alpha * grad L_s(theta)`` with ``alpha`` a tensor of
``theta``'s shape, meta-trained with ``theta``. The rates are parameters of the algorithm
module (:attr:`MAML.lr`), so :class:`metaddp.MetaDDP` keeps them in sync across ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from .._remat import Replay
from ..inner import DEFAULT_LOSS_SCALE, LossScale
from ._base import OptimizerFactory
from ._maml import MAML


class MetaSGD(MAML):
    """MAML with learned per-parameter inner learning rates.

    Args:
        model: the network; its parameters are meta-parameters, and so are the rates.
        inner_lr: the initial value of every rate.
        steps: inner steps per task (the paper uses one).
        first_order: drop second-order terms (the rates still get their gradient).
        optimizer: a factory taking the learning rate (default :func:`metaddp.inner.sgd`).
        per: ``"parameter"`` (Meta-SGD), ``"tensor"`` or ``"scalar"``.
        batched, memory: as :class:`MAML`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        inner_lr: float = 0.01,
        steps: int = 1,
        first_order: bool = False,
        optimizer: OptimizerFactory | None = None,
        per: str = "parameter",
        batched: bool | None = None,
        memory: str | Replay = "default",
        autocast: torch.dtype | None = None,
        loss_scale: LossScale | bool | None = DEFAULT_LOSS_SCALE,
    ) -> None:
        super().__init__(
            model,
            inner_lr=inner_lr,
            steps=steps,
            first_order=first_order,
            optimizer=optimizer,
            learn_lr=per,
            memory=memory,
            autocast=autocast,
            batched=batched,
            loss_scale=loss_scale,
        )
