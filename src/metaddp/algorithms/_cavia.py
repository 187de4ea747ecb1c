"""CAVIA: fast context adaptation. The inner loop adapts only a few context parameters, which
start at zero for every task; the network's weights are meta-trained, never adapted.

Zintgraf, Shiarlis, Kurin, Hofmann & Whiteson, "Fast Context Adaptation via Meta-Learning",
ICML 2019, arXiv:1810.03642. The network takes the context as a second input,
``model(x, context)`` (concatenated to the input, or feeding FiLM layers: the network's
choice). Everything else is MAML's, stacked tasks and ``memory="low"`` included: the fast
weights are ``{"context": ...}``, and the weights enter every inner step as the meta-parameters
they are, so they get their second-order meta-gradient through the context's steps.
"""

from __future__ import annotations

from typing import Unpack

import torch
from torch import Tensor, nn

from .._data import at_least
from .._functional import params_of
from .._types import Params
from ._hypergrad import held
from ._maml import MAML, MAMLSettings


class WithContext(nn.Module):
    """``model(x, context)`` with the context given as the fast weight ``"context"`` (a
    placeholder here, never trained or saved)."""

    context: Tensor

    def __init__(self, model: nn.Module, size: int) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("context", torch.zeros(size), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x, self.context)


class CAVIA(MAML):
    """MAML whose inner loop adapts a context vector (zero at every task's start) that
    ``model(x, context)`` reads; the model's weights are meta-trained.

    Args:
        model: a network called as ``model(x, context)``, ``context`` of shape ``[context]``.
        context: the number of context parameters.
        settings: every setting of :class:`metaddp.MAML`; ``inner_lr`` is 1.0 unless given
            (the paper's inner rate for the context).

    Fast weights are ``{"context": [context]}``; ``learner(x, fast)`` runs the model on them.
    """

    model: WithContext

    def __init__(self, model: nn.Module, *, context: int, **settings: Unpack[MAMLSettings]) -> None:
        at_least(context, "context (the number of context parameters)")
        if not params_of(model):
            raise ValueError("CAVIA meta-trains the model, which has no trained parameter")
        self.size = context
        settings.setdefault("inner_lr", 1.0)  # the paper's rate for the context
        super().__init__(WithContext(model, context), **settings)

    def settings(self) -> dict[str, object]:
        return dict(super().settings(), context=self.size)

    def fast_weights(self) -> Params:
        """``{"context": zeros}``: a start that needs a gradient for the inner steps and
        passes none back (the context has no meta-parameter)."""
        anchor = next(iter(params_of(self.model).values()))
        zeros = torch.zeros(self.size, dtype=anchor.dtype, device=anchor.device)
        return held({"context": zeros}, anchor)
