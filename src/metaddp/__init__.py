"""metaddp: exact meta-gradients on torch.distributed, whatever the number of ranks.

Every rank computes its *share* of each global mean loss; inner-loop gradients pass through a
differentiable SUM all-reduce; meta-gradients are SUM-reduced. The result is the meta-gradient
one process would compute on the whole meta-batch, first or second order.
"""

from ._collectives import (
    CollectiveError,
    CollectiveStats,
    all_reduce_counts,
    all_reduce_sum,
    counting,
    set_strict,
)
from ._data import Batch, ShardSampler, Task, generator_for, seed_for, shard, shard_range
from ._functional import buffers_of, call, params_of
from ._anil import ANIL
from ._batchnorm import sync_batchnorm
from ._imaml import IMAML, ConvergenceWarning, conjugate_gradient
from ._inner import InnerOptimizer, adam, apply_updates, sgd
from ._learned_lr import LearnedLR
from ._learner import Learner
from ._maml import MAML, batch_share, inner_loop
from ._metasgd import MetaSGD
from ._reptile import Reptile
from ._share import global_count, global_value, share
from ._world import Mesh, init, rank, shutdown, world_size
from ._wrapper import MetaDDP

__version__ = "0.1.0"

__all__ = [
    "ANIL", "ConvergenceWarning", "IMAML", "LearnedLR", "Learner", "MetaSGD", "Reptile", "adam",
    "conjugate_gradient", "sync_batchnorm",
    "Batch", "CollectiveError", "CollectiveStats", "InnerOptimizer", "MAML", "Mesh", "MetaDDP",
    "ShardSampler", "Task", "all_reduce_counts", "all_reduce_sum", "apply_updates",
    "batch_share", "buffers_of", "call", "counting", "generator_for", "global_count",
    "global_value", "init", "inner_loop", "params_of", "rank", "seed_for", "set_strict", "sgd",
    "shard", "shard_range", "share", "shutdown", "world_size",
]
