"""Statistics that are sums over a batch (class means, a variance's moments), exact on any
split of the batch.

Where processes split a batch, each holds part of every sum. A statistic computed from a
rank's own samples alone (its own class means) is a different number on every number of
processes, and nothing downstream can tell. These helpers sum the parts through the same
differentiable SUM the inner gradients take (``reduce``, whose adjoint is a SUM again), so
the statistic, and every derivative through it, is the whole batch's. On one process the
SUM is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import _host
from ._adapt import _local_only
from ._data import at_least
from ._types import Reduce


def global_sums(tensors: Sequence[Tensor], *, reduce: Reduce | None = None) -> list[Tensor]:
    """Each tensor summed over the processes that split the batch, differentiably.

    Args:
        tensors: this process's part of each sum (a sum over its own samples: of features,
            of squares, of counts...). Every process passes the same shapes.
        reduce: the SUM over the processes that split the batch: ``learner.reduce`` of a
            :class:`metaddp.MetaDDP`, or the ``reduce`` an algorithm's ``task_loss`` receives.
            Required on several processes; the identity on one.

    Returns:
        The whole batch's sums, the same on every process that split it.

    A mean is then ``sum / count`` with both summed; a variance ``E[x^2] - E[x]^2`` from the
    sums of ``x`` and ``x^2`` and the count.
    """
    if reduce is None:
        reduce = _local_only("metaddp.data.global_sums")
    # Sums of statistics, never a shard's gradient: where the weights are sharded too.
    return getattr(reduce, "values", reduce)(list(tensors))


def class_means(
    features: Tensor, labels: Tensor, ways: int, *, reduce: Reduce | None = None
) -> tuple[Tensor, Tensor]:
    """Each class's mean feature over the whole batch (a prototype), and its sample count.

    Args:
        features: ``[n_local, ...]``, this process's samples' features.
        labels: ``[n_local]`` integer classes in ``0 .. ways - 1``.
        ways: the number of classes.
        reduce: as :func:`global_sums`.

    Returns:
        ``(means [ways, ...], counts [ways])``: the same on every process that split the
        batch, and differentiable in ``features`` to any order.

    Raises (at the step's end, on every process alike, as the step's other checks): a class
    with no sample in the whole batch, or a label outside ``0 .. ways - 1``.
    """
    at_least(ways, "ways")
    if labels.dim() != 1 or labels.shape[0] != features.shape[0]:
        raise ValueError(
            f"expected one label per sample: features have {features.shape[0]} samples, "
            f"labels shape {tuple(labels.shape)}"
        )
    if labels.is_floating_point():
        raise TypeError(f"labels must be integer classes, got {labels.dtype}")
    flat = features.flatten(1)
    # Counts in at least float32, so that they stay exact under half-precision features.
    count_dtype = torch.promote_types(flat.dtype, torch.float32)
    onehot = labels.unsqueeze(1) == torch.arange(ways, device=labels.device)
    sums = onehot.to(flat.dtype).T @ flat
    counts = onehot.sum(0).to(count_dtype)
    # The labels outside 0 .. ways-1 are counted too, and summed, so every process sees them.
    outside = (labels.shape[0] - counts.sum()).reshape(1)
    sums, tally = global_sums([sums, torch.cat([counts, outside])], reduce=reduce)
    counts = tally[:ways]

    def verdict(values: list[float]) -> Exception | None:
        *per_class, stray = values
        if stray:
            return ValueError(
                f"{int(stray)} labels are outside 0 .. {ways - 1} (ways={ways}): give the "
                "number of classes the tasks have, and labels numbered from 0"
            )
        empty = [k for k, c in enumerate(per_class) if c == 0]
        if empty:
            return ValueError(
                f"classes {empty[:5]} have no sample in the batch, so no mean: every one of "
                f"the {ways} classes needs at least one support sample"
            )
        return None

    _host.check(tally.detach(), verdict)
    means = sums / counts.clamp(min=1).to(sums.dtype).unsqueeze(1)
    return means.reshape(ways, *features.shape[1:]), counts
