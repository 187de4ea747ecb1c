"""metaddp: exact meta-gradients on torch.distributed, whatever the number of processes.

Every process computes its *share* of each global mean loss; inner-loop gradients pass through
a differentiable SUM all-reduce; meta-gradients are SUM-reduced. The result is the
meta-gradient one process would compute on the whole meta-batch, first or second order.

The layers, bottom up: the core (``Batch``, ``share``, ``call``, the inner step) and
``metaddp.inner`` (differentiable inner optimizers); ``metaddp.algorithms`` (MAML and its
family, over a ``reduce`` function) beside ``metaddp.distributed`` (collectives, mesh, the
``MetaDDP`` wrapper); ``metaddp.tasks``, ``metaddp.train`` and ``metaddp.cli`` on top.
"""

from ._adapt import batch_share, grad, inner_loop, inner_step
from ._data import (
    Batch,
    Chunks,
    MetaBatch,
    Shard,
    ShardSampler,
    Task,
    generator_for,
    seed_for,
    shard,
    shard_range,
)
from ._functional import buffers_of, call, params_of
from ._share import share
from ._types import LossFn, MetaAlgorithm, Params, Reduce, Supports, identity_reduce
from .algorithms import (
    ANIL,
    IMAML,
    MAML,
    SAMA,
    T1T2,
    Bilevel,
    ConvergenceWarning,
    ImplicitCG,
    Learner,
    MetaSGD,
    Neumann,
    Reptile,
    Truncated,
    Unrolled,
    WeightNet,
    conjugate_gradient,
)
from .distributed import (
    CapturedStep,
    CollectiveError,
    CollectiveStats,
    Mesh,
    MetaDDP,
    OutOfSyncError,
    all_reduce_counts,
    all_reduce_sum,
    counting,
    global_count,
    global_value,
    init,
    keep_freed_memory,
    rank,
    set_strict,
    shutdown,
    sync_batchnorm,
    world_size,
)
from .inner import InnerOptimizer, LearnedLR, adam, apply_updates, sgd

__version__ = "0.2.0"

__all__ = [
    "ANIL",
    "Batch",
    "Bilevel",
    "CapturedStep",
    "Chunks",
    "CollectiveError",
    "CollectiveStats",
    "ConvergenceWarning",
    "IMAML",
    "ImplicitCG",
    "InnerOptimizer",
    "LearnedLR",
    "Learner",
    "LossFn",
    "MAML",
    "Mesh",
    "MetaAlgorithm",
    "MetaBatch",
    "MetaDDP",
    "MetaSGD",
    "Neumann",
    "OutOfSyncError",
    "Params",
    "Reduce",
    "Reptile",
    "SAMA",
    "Shard",
    "ShardSampler",
    "Supports",
    "T1T2",
    "Task",
    "Truncated",
    "Unrolled",
    "WeightNet",
    "adam",
    "all_reduce_counts",
    "all_reduce_sum",
    "apply_updates",
    "batch_share",
    "buffers_of",
    "call",
    "conjugate_gradient",
    "counting",
    "generator_for",
    "global_count",
    "global_value",
    "grad",
    "identity_reduce",
    "init",
    "inner_loop",
    "inner_step",
    "keep_freed_memory",
    "params_of",
    "rank",
    "seed_for",
    "set_strict",
    "sgd",
    "shard",
    "shard_range",
    "share",
    "shutdown",
    "sync_batchnorm",
    "world_size",
]
