"""metaddp: exact meta-gradients on torch.distributed, whatever the number of processes.

Every process computes its *share* of each global mean loss; inner-loop gradients pass through
a differentiable SUM all-reduce; meta-gradients are SUM-reduced. The result is the
meta-gradient one process would compute on the whole meta-batch, first or second order.

The top level holds what a training script names: the wrapper and its mesh, the task and
batch types, ``share`` and the algorithms. The rest lives in sub-namespaces:

- ``metaddp.inner``: differentiable inner optimizers (``sgd``, ``adam``, ...) and
  ``LossScale``;
- ``metaddp.bilevel``: hypergradient methods for :class:`Bilevel` (``Neumann``, ...);
- ``metaddp.functional``: hand-written inner loops (``call``, ``grad``, ``inner_step``, ...);
- ``metaddp.data``: how tasks and batches are cut, seeds, and sums over a global batch;
- ``metaddp.distributed``: collectives, counters and the process helpers.

The layers, bottom up: ``metaddp.inner`` and ``metaddp.forward``; the core (private modules:
``Batch``, ``share``, ``call``, the one inner step and loop); ``metaddp.algorithms`` (MAML
and its family, over a ``reduce`` function) beside ``metaddp.distributed`` (collectives, mesh,
the ``MetaDDP`` wrapper); the namespaces above; ``metaddp.tasks``, ``metaddp.train`` and
``metaddp.cli`` on top.
"""

import importlib
import warnings
from typing import Any

from . import bilevel as bilevel
from . import data as data
from . import distributed as distributed
from . import functional as functional
from . import inner as inner
from ._data import Batch, MetaBatch, Task, generator_for
from ._remat import Replay
from ._share import share
from .algorithms import (
    ANIL,
    BOIL,
    CAVIA,
    IMAML,
    MAML,
    Bilevel,
    MAMLPlusPlus,
    MetaSGD,
    ProtoMAML,
    ProtoNet,
    Reptile,
)
from .distributed import (
    CollectiveError,
    Mesh,
    MetaDDP,
    OutOfSyncError,
    init,
    rank,
    shutdown,
    world_size,
)

__version__ = "0.2.0"

__all__ = [
    "ANIL",
    "BOIL",
    "Batch",
    "Bilevel",
    "CAVIA",
    "CollectiveError",
    "IMAML",
    "MAML",
    "MAMLPlusPlus",
    "Mesh",
    "MetaBatch",
    "MetaDDP",
    "MetaSGD",
    "OutOfSyncError",
    "ProtoMAML",
    "ProtoNet",
    "Replay",
    "Reptile",
    "Task",
    "generator_for",
    "init",
    "rank",
    "share",
    "shutdown",
    "world_size",
]

# Names that were at the top level in 0.2: where they live now. They keep working for one
# release, with a DeprecationWarning that names the new place.
_MOVED = {
    **dict.fromkeys(
        "InnerOptimizer LearnedLR LossScale adagrad adam adamw apply_updates chain "
        "clip_by_global_norm rmsprop sgd".split(),
        "metaddp.inner",
    ),
    **dict.fromkeys(
        "SAMA T1T2 ConvergenceWarning ImplicitCG Neumann Truncated Unrolled WeightNet "
        "conjugate_gradient".split(),
        "metaddp.bilevel",
    ),
    **dict.fromkeys(
        "Learner LossFn MetaAlgorithm Params Reduce batch_share buffers_of call grad "
        "identity_reduce inner_loop inner_step params_of".split(),
        "metaddp.functional",
    ),
    **dict.fromkeys(
        "Chunks Shard ShardSampler class_means global_sums seed_for shard shard_range".split(),
        "metaddp.data",
    ),
    **dict.fromkeys(
        "CapturedStep CollectiveStats all_reduce_counts all_reduce_sum counting global_count "
        "global_value keep_freed_memory set_strict sync_batchnorm".split(),
        "metaddp.distributed",
    ),
    **dict.fromkeys(
        "Supports".split(),
        "metaddp.algorithms",
    ),
}


def __getattr__(name: str) -> Any:
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module 'metaddp' has no attribute {name!r}")
    warnings.warn(
        f"metaddp.{name} is now {where}.{name}; the old name keeps working for one more release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(where), name)


def __dir__() -> list[str]:
    return sorted([*__all__, "bilevel", "data", "distributed", "functional", "inner"])
