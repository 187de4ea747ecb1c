"""Hand-written inner loops: fast weights as dicts, the model run on them, and the one
differentiable inner step and K-step loop that metaddp's algorithms use too.

``md.functional.call(model, fast, x)`` runs a module on other weights; ``grad`` is
``torch.autograd.grad`` of a share followed by the SUM over ranks (``learner.grad`` binds the
wrapper's); ``inner_step`` / ``inner_steps`` / ``inner_loop`` take differentiable optimizer
steps (docs/migration.md).
"""

from .._adapt import batch_share, grad, inner_loop, inner_step, inner_steps
from .._functional import buffers_of, call, params_of
from .._types import LossFn, MetaAlgorithm, Params, Reduce, identity_reduce
from ..algorithms import Learner

__all__ = [
    "Learner",
    "LossFn",
    "MetaAlgorithm",
    "Params",
    "Reduce",
    "batch_share",
    "buffers_of",
    "call",
    "grad",
    "identity_reduce",
    "inner_loop",
    "inner_step",
    "inner_steps",
    "params_of",
]
