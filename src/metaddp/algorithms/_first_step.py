"""The first inner step's objective and gradient, kept for a caller that needs them again.

``Bilevel(start="current", train_inner=True)`` trains the model on the gradient of the inner
objective at its current weights, the point its inner steps start from. The first inner step
computes that gradient already, at held copies of the same values by the same operations, so
to the same bits; a forward and a backward more would compute it again. :class:`FirstStep`
keeps it from the step itself.
"""

from __future__ import annotations

from torch import Tensor

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

    def reduce(self, loss: Tensor, fast: Params, reduce: Reduce) -> Reduce:
        """The SUM to give the inner step on ``loss`` at ``fast``: ``reduce``, which at the
        start also keeps the gradient it is given (the step's own, in ``fast``'s order) and
        ``loss``. A reduce that sums sharded weights by name is left as it is."""
        if fast is not self.start or self.grads is not None or hasattr(reduce, "by_name"):
            return reduce

        def keeping(grads: list[Tensor]) -> list[Tensor]:
            self.objective, self.grads = loss, list(grads)
            return reduce(grads)

        return keeping
