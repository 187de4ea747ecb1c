"""Everything that knows about ranks: differentiable collectives, the task x sample mesh, the
:class:`MetaDDP` wrapper, overlapped gradient sums, synchronized BatchNorm, check mode and
local launchers. Nothing here knows about meta-learning algorithms."""

from ._batchnorm import sync_batchnorm
from ._check import OutOfSyncError
from ._collectives import (
    CollectiveError,
    CollectiveStats,
    Phase,
    all_reduce_counts,
    all_reduce_sum,
    counting,
    global_count,
    global_value,
    set_strict,
)
from ._mesh import LAYOUTS, Mesh, init, rank, shutdown, world_size
from ._wrapper import MetaDDP

__all__ = [
    "Phase",
    "LAYOUTS",
    "CollectiveError",
    "CollectiveStats",
    "Mesh",
    "MetaDDP",
    "OutOfSyncError",
    "all_reduce_counts",
    "all_reduce_sum",
    "counting",
    "global_count",
    "global_value",
    "init",
    "rank",
    "set_strict",
    "shutdown",
    "sync_batchnorm",
    "world_size",
]
