"""Meta-SGD: MAML whose inner learning rate is learned, one rate per parameter entry.

Li, Zhou, Chen & Li, "Meta-SGD: Learning to Learn Quickly for Few-Shot Learning",
arXiv:1707.09835 (2017): ``phi = theta - alpha * grad L_s(theta)`` with ``alpha`` a tensor of
``theta``'s shape, meta-trained with ``theta``. The rates are parameters of the algorithm
module (:attr:`MAML.lr`), so :class:`metaddp.MetaDDP` keeps them in sync across ranks.
"""

from __future__ import annotations

from typing import Unpack

from torch import nn

from ._maml import MAML, MAMLSettings


class MetaSGD(MAML):
    """MAML with learned per-parameter inner learning rates.

    Args:
        model: the network; its parameters are meta-parameters, and so are the rates.
        inner_lr: the initial value of every rate.
        steps: inner steps per task (the paper uses one).
        first_order: drop second-order terms (the rates still get their gradient).
        optimizer: a factory taking the learning rate (default :func:`metaddp.inner.sgd`).
        per: ``"parameter"`` (Meta-SGD), ``"tensor"`` or ``"scalar"``.
        settings: the other settings of :class:`MAML` (``batched``, ``memory``, ...).
    """

    def __init__(
        self, model: nn.Module, *, per: str = "parameter", **settings: Unpack[MAMLSettings]
    ) -> None:
        if "learn_lr" in settings:
            raise TypeError("MetaSGD learns its rates: say how with per=, not learn_lr")
        settings["learn_lr"] = per
        super().__init__(model, **settings)
