"""Meta-learning algorithms over a ``reduce`` function; none of them knows about ranks."""

from .._types import Supports
from ._anil import ANIL, BodyHead
from ._base import Algorithm
from ._bilevel import Bilevel, Minibatches, WeightNet
from ._boil import BOIL
from ._cavia import CAVIA
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
from ._mamlpp import MAMLPlusPlus
from ._metasgd import MetaSGD
from ._protonet import ProtoMAML, ProtoNet
from ._reptile import Reptile
from .registry import ALGORITHMS, SUPPORTS, Settings, build, having

__all__ = [
    "ALGORITHMS",
    "ANIL",
    "Algorithm",
    "BOIL",
    "CAVIA",
    "Bilevel",
    "BodyHead",
    "ConvergenceWarning",
    "IMAML",
    "ImplicitCG",
    "InnerProblem",
    "Learner",
    "MAML",
    "MAMLPlusPlus",
    "METHODS",
    "Method",
    "MetaSGD",
    "Neumann",
    "NotPositiveDefinite",
    "ProtoMAML",
    "ProtoNet",
    "Reptile",
    "SAMA",
    "SUPPORTS",
    "Settings",
    "Supports",
    "T1T2",
    "Truncated",
    "Unrolled",
    "Minibatches",
    "WeightNet",
    "build",
    "conjugate_gradient",
    "having",
]
