"""Bilevel problems' hypergradient methods and helpers, for :class:`metaddp.Bilevel`.

``md.Bilevel(net, outer=..., method=md.bilevel.Neumann(...))``: every method is its
one-process value on any number of processes (docs/bilevel.md).
"""

from ..algorithms import (
    SAMA,
    T1T2,
    ConvergenceWarning,
    ImplicitCG,
    InnerProblem,
    Method,
    Minibatches,
    Neumann,
    NotPositiveDefinite,
    Truncated,
    Unrolled,
    WeightNet,
    conjugate_gradient,
)

__all__ = [
    "SAMA",
    "T1T2",
    "ConvergenceWarning",
    "ImplicitCG",
    "InnerProblem",
    "Method",
    "Minibatches",
    "Neumann",
    "NotPositiveDefinite",
    "Truncated",
    "Unrolled",
    "WeightNet",
    "conjugate_gradient",
]
