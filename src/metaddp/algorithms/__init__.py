"""Meta-learning algorithms over a ``reduce`` function; none of them knows about ranks."""

from ._anil import ANIL, BodyHead
from ._base import Algorithm
from ._bilevel import Bilevel, WeightNet
from ._hypergrad import (
    METHODS,
    SAMA,
    T1T2,
    ConvergenceWarning,
    ImplicitCG,
    InnerProblem,
    Method,
    Neumann,
    NotPositiveDefinite,
    Truncated,
    Unrolled,
    conjugate_gradient,
)
from ._imaml import IMAML
from ._learner import Learner
from ._maml import MAML
from ._metasgd import MetaSGD
from ._reptile import Reptile
from .registry import ALGORITHMS, SUPPORTS, Settings, build, having

__all__ = [
    "ALGORITHMS",
    "ANIL",
    "Algorithm",
    "Bilevel",
    "BodyHead",
    "ConvergenceWarning",
    "IMAML",
    "ImplicitCG",
    "InnerProblem",
    "Learner",
    "MAML",
    "METHODS",
    "Method",
    "MetaSGD",
    "Neumann",
    "NotPositiveDefinite",
    "Reptile",
    "SAMA",
    "SUPPORTS",
    "Settings",
    "T1T2",
    "Truncated",
    "Unrolled",
    "WeightNet",
    "build",
    "conjugate_gradient",
    "having",
]
