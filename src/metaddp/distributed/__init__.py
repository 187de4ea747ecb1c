"""Everything that knows about ranks: differentiable collectives, the task x sample mesh, the
:class:`MetaDDP` wrapper, overlapped gradient sums, synchronized BatchNorm, check mode and
local launchers. Nothing here knows about meta-learning algorithms."""

from ._allocator import keep_freed_memory
from ._batchnorm import sync_batchnorm
from ._check import OutOfSyncError
from ._check import from_env as check_mode_from_env
from ._collectives import (
    CollectiveError,
    CollectiveStats,
    Phase,
    all_reduce_counts,
    all_reduce_sum,
    counting,
    global_count,
    global_value,
    group_rank,
    group_size,
    set_strict,
)
from ._graphs import CapturedStep
from ._mesh import (
    DEFAULT_TIMEOUT,
    LAYOUTS,
    Mesh,
    default_backend,
    init,
    rank,
    shutdown,
    world_size,
)
from ._sharded import DEFAULT_UNIT_BYTES
from ._wrapper import MetaDDP

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_UNIT_BYTES",
    "Phase",
    "LAYOUTS",
    "CapturedStep",
    "CollectiveError",
    "CollectiveStats",
    "Mesh",
    "MetaDDP",
    "OutOfSyncError",
    "all_reduce_counts",
    "all_reduce_sum",
    "check_mode_from_env",
    "counting",
    "default_backend",
    "global_count",
    "global_value",
    "group_rank",
    "group_size",
    "init",
    "keep_freed_memory",
    "rank",
    "set_strict",
    "shutdown",
    "sync_batchnorm",
    "world_size",
]
