"""The first inner step's objective and gradient, kept for a caller that needs them again.

``Bilevel(start="current", train_inner=True)`` trains the model on the gradient of the inner
objective at its current weights, the point its inner steps start from. The first inner step
computes that gradient already, at held copies of the same values by the same operations, so
to the same bits; a forward and a backward more would compute it again. :class:`FirstStep`
keeps it from the step itself.
"""

from __future__ import annotations

from torch import Tensor

from .._adapt import StepLoss
from .._types import Params, Reduce


class FirstStep:
    """This rank's gradient of the inner objective at ``start``, before the SUM over the ranks
    that split the batch, and the objective (this rank's share), as the inner step taken at
    ``start`` (the first) computed them.

    Args:
        weights: the model's own weights, which ``start`` holds copies of.
        start: the inner steps' start (the problem's ``start``, the very dict).
    """

    def __init__(self, weights: Params, start: Params) -> None:
        self.weights, self.start = weights, start
        self.objective: Tensor | None = None
        self.grads: list[Tensor] | None = None

    def watch(self, inner: StepLoss, reduce: Reduce) -> tuple[StepLoss, Reduce]:
        """``inner`` and ``reduce`` for the inner steps (:func:`metaddp._adapt.descend`); at
        ``start`` they keep the step's objective and the gradient the SUM is given (in
        ``start``'s order). A reduce that sums sharded weights by name is left as it is."""
        if hasattr(reduce, "by_name"):
            return inner, reduce
        at_start = False

        def objective(fast: Params, k: int) -> Tensor:
            nonlocal at_start
            loss = inner(fast, k)
            at_start = fast is self.start and self.grads is None
            if at_start:
                self.objective = loss
            return loss

        def keeping(grads: list[Tensor]) -> list[Tensor]:
            nonlocal at_start
            if at_start:
                self.grads, at_start = list(grads), False
            return reduce(grads)

        return objective, keeping
