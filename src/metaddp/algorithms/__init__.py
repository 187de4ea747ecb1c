"""Meta-learning algorithms over a ``reduce`` function; none of them knows about ranks."""

from ._anil import ANIL, BodyHead
from ._base import Algorithm
from ._imaml import IMAML, ConvergenceWarning, NotPositiveDefinite, conjugate_gradient
from ._learner import Learner
from ._maml import MAML
from ._metasgd import MetaSGD
from ._reptile import Reptile
from .registry import ALGORITHMS, SUPPORTS, Settings, build, having

__all__ = [
    "ALGORITHMS",
    "ANIL",
    "Algorithm",
    "BodyHead",
    "ConvergenceWarning",
    "NotPositiveDefinite",
    "IMAML",
    "Learner",
    "MAML",
    "MetaSGD",
    "Reptile",
    "SUPPORTS",
    "Settings",
    "build",
    "conjugate_gradient",
    "having",
]
