"""Tasks and batches, how they are cut over ranks, and statistics of a whole (global) batch.

``md.Task``, ``md.Batch`` and ``md.MetaBatch`` are at the top level too; here are the rest:
the cut (``shard``, ``shard_range``, ``Shard``, ``Chunks``, ``ShardSampler``), seeds
(``generator_for``, ``seed_for``) and sums over the global batch that a loss may read
(``global_sums``, ``class_means``).
"""

from .._data import (
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
from .._statistics import class_means, global_sums

__all__ = [
    "Batch",
    "Chunks",
    "MetaBatch",
    "Shard",
    "ShardSampler",
    "Task",
    "class_means",
    "generator_for",
    "global_sums",
    "seed_for",
    "shard",
    "shard_range",
]
