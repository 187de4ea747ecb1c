"""BOIL: body only in the inner loop. The head is held at its meta-parameters while the body
adapts, the reverse of ANIL.

Oh, Yoo, Kim & Yun, "BOIL: Towards Representation Change for Few-shot Learning", ICLR 2021,
arXiv:2008.08882: with the head's inner learning rate at zero, adaptation must change the
representation rather than reuse it. Everything else is MAML's, stacked tasks and
``memory="low"`` included: the fast weights are the body's only, and the head enters every
forward as the meta-parameter it is.
"""

from __future__ import annotations

import torch
from torch import nn

from .._functional import params_of
from .._remat import Replay
from .._types import Params
from ..inner import InnerOptimizer
from ._anil import BodyHead
from ._base import OptimizerFactory
from ._maml import MAML


class BOIL(MAML):
    """MAML whose inner loop adapts ``body`` only; ``head`` is meta-trained, never adapted.

    Args:
        body: the feature extractor, adapted in the inner loop.
        head: the classifier (usually the last linear layer), held fixed in it.
        inner_lr, steps, first_order, optimizer, learn_lr, batched, memory, autocast, conv:
            as :class:`metaddp.MAML`; learned rates cover the body's parameters only.

    Fast weights are the body's, named as in the model (``"body.<name>"``).
    """

    model: BodyHead

    def __init__(
        self,
        body: nn.Module,
        head: nn.Module,
        *,
        inner_lr: float = 0.01,
        steps: int = 1,
        first_order: bool = False,
        optimizer: InnerOptimizer | OptimizerFactory | None = None,
        learn_lr: str | None = None,
        batched: bool | None = None,
        memory: str | Replay = "default",
        autocast: torch.dtype | None = None,
        conv: str = "auto",
    ) -> None:
        if not params_of(body):
            raise ValueError("BOIL adapts the body, which has no trained parameter")
        super().__init__(
            BodyHead(body, head),
            inner_lr=inner_lr,
            steps=steps,
            first_order=first_order,
            optimizer=optimizer,
            learn_lr=learn_lr,
            batched=batched,
            memory=memory,
            autocast=autocast,
            conv=conv,
        )

    def fast_weights(self) -> Params:
        """The body's meta-parameters, named as in the model; the head keeps its own."""
        return {f"body.{k}": p for k, p in params_of(self.model.body).items()}
