"""BOIL: body only in the inner loop. The head is held at its meta-parameters while the body
adapts, the reverse of ANIL.

Oh, Yoo, Kim & Yun, "BOIL: Towards Representation Change for Few-shot Learning", ICLR 2021,
arXiv:2008.08882: with the head's inner learning rate at zero, adaptation must change the
representation rather than reuse it. Everything else is MAML's, stacked tasks and
``memory="low"`` included: the fast weights are the body's only, and the head enters every
forward as the meta-parameter it is.
"""

from __future__ import annotations

from typing import Unpack

from torch import nn

from .._functional import params_of
from .._types import Params
from ._anil import BodyHead
from ._maml import MAML, MAMLSettings


class BOIL(MAML):
    """MAML whose inner loop adapts ``body`` only; ``head`` is meta-trained, never adapted.

    Args:
        body: the feature extractor, adapted in the inner loop.
        head: the classifier (usually the last linear layer), held fixed in it.
        settings: every setting of :class:`metaddp.MAML`; learned rates cover the body's
            parameters only.

    Fast weights are the body's, named as in the model (``"body.<name>"``).
    """

    model: BodyHead

    def __init__(self, body: nn.Module, head: nn.Module, **settings: Unpack[MAMLSettings]) -> None:
        if not params_of(body):
            raise ValueError("BOIL adapts the body, which has no trained parameter")
        super().__init__(BodyHead(body, head), **settings)

    def fast_weights(self) -> Params:
        """The body's meta-parameters, named as in the model; the head keeps its own."""
        return {f"body.{k}": p for k, p in params_of(self.model.body).items()}
