"""Learnable inner learning rates: meta-parameters the outer optimizer trains.

Held as ``nn.Parameter`` s inside an algorithm module, so that :class:`metaddp.MetaDDP`
broadcasts and synchronises them like every other meta-parameter. Li, Zhou, Chen & Li,
"Meta-SGD: Learning to Learn Quickly for Few-Shot Learning", arXiv:1707.09835 (2017), learn
one rate per parameter entry; one rate per tensor or a single scalar are the coarser choices.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

GRANULARITIES = ("scalar", "tensor", "parameter")


class LearnedLR(nn.Module):
    """Inner learning rates for a set of parameters, trained in the outer loop.

    Args:
        params: the parameters the inner loop adapts, by name (only shapes, dtypes and
            devices are read).
        init: the initial learning rate (every entry).
        per: ``"scalar"`` (one rate for all), ``"tensor"`` (one per parameter tensor) or
            ``"parameter"`` (one per entry, the shape of each parameter: Meta-SGD).
    """

    def __init__(self, params: Mapping[str, Tensor], init: float, per: str = "parameter") -> None:
        super().__init__()
        if per not in GRANULARITIES:
            raise ValueError(
                f"unknown learning-rate granularity {per!r}; choose from {', '.join(GRANULARITIES)}"
            )
        if not params:
            raise ValueError("LearnedLR needs at least one parameter to give a learning rate to")
        self.per = per
        self.names = list(params)

        def rate(p: Tensor, shape: tuple[int, ...]) -> nn.Parameter:
            return nn.Parameter(torch.full(shape, float(init), dtype=p.dtype, device=p.device))

        if per == "scalar":
            self.scalar = rate(next(iter(params.values())), ())
        else:
            # nn.ParameterDict keys may not contain '.', so rates are stored by position.
            self.rates = nn.ParameterList(
                rate(p, () if per == "tensor" else tuple(p.shape)) for p in params.values()
            )

    def as_dict(self) -> dict[str, Tensor]:
        """The learning rate of every adapted parameter, by name (tensors on the graph)."""
        if self.per == "scalar":
            return {k: self.scalar for k in self.names}
        return dict(zip(self.names, self.rates, strict=True))

    def extra_repr(self) -> str:
        return f"per={self.per!r}, tensors={len(self.names)}"
