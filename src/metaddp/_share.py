"""The share convention: every rank holds its share of each global mean.

A rank's share of a global mean loss is the sum of its own samples' losses divided by the
global sample count. Shares add up to the global mean on any split of the data, uneven or
empty shards included, so every cross-rank reduction is a plain SUM, never a mean over ranks
(which would weight a rank holding 3 samples like one holding 5).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from torch import Tensor

from ._data import Batch, Shard, whole

_TAG = "metaddp.share"
"""The key of a share's record in its autograd node's ``metadata``."""


@dataclasses.dataclass(frozen=True)
class ShareOf:
    """What a share was made from: ``held`` of ``n`` samples, and ``source``: ``"shard"`` (a
    batch known to be a rank's part), ``"batch"`` (a batch not known as one: whole, or built
    by hand) or ``"count"`` (an integer the caller counted)."""

    held: int
    n: int
    source: str


def _metadata(node: Any) -> dict[str, Any]:
    # An autograd node's dict for its users' records (``torch.autograd.graph.Node.metadata``,
    # a property that torch's stubs type as a method).
    return cast(dict[str, Any], node.metadata)


def share_of(loss: Tensor) -> ShareOf | None:
    """How ``loss`` was made, if :func:`share` made it; ``None`` for any other tensor (a plain
    mean, a sum of shares, a share scaled again)."""
    node = loss.grad_fn
    return None if node is None else _metadata(node).get(_TAG)


def share(per_sample: Tensor, n_global: int | Batch) -> Tensor:
    """This rank's share of the mean over ``n_global`` samples.

    ``per_sample`` holds one loss per local sample along dimension 0 (``reduction='none'``);
    any further dimensions are averaged per sample first, so that for ``mse_loss`` the shares
    add up to ``mse_loss(..., reduction='mean')`` on the whole batch. ``n_global`` is the
    global sample count, or the :class:`metaddp.Batch` the losses come from (its own global
    size, so no count is written by hand; the losses must then be one per sample it holds).
    """
    if isinstance(n_global, Batch):
        check_per_sample(per_sample, n_global.x.shape[0])
        source = "shard" if isinstance(n_global, Shard) else "batch"
        n_global = n_global.n
    else:
        source = "count"
    n_global = whole(n_global, "the global sample count")
    if per_sample.dim() == 0:
        raise ValueError(
            "expected one loss per sample (shape [n, ...]), got a scalar: compute the loss "
            "with reduction='none' so that metaddp can weigh this rank's samples globally"
        )
    if n_global <= 0:
        raise ValueError(f"the global sample count must be positive, got {n_global}")
    n_local = per_sample.shape[0]
    if n_local > n_global:
        raise ValueError(f"{n_local} local samples cannot be a share of {n_global} global ones")
    out = one_per_sample(per_sample).sum() / n_global
    if out.grad_fn is not None:
        # Where ranks split a batch, what adapts on this share checks what it was made from.
        _metadata(out.grad_fn)[_TAG] = ShareOf(n_local, n_global, source)
    return out


def check_per_sample(losses: Tensor, n_local: int) -> None:
    """Raise unless ``losses`` holds one loss per sample of a shard of ``n_local`` samples.

    A loss reduced over the batch but kept as a dimension (``mean(0)``: shape ``[1]``) would
    otherwise count as one sample, and weigh differently on every number of processes.
    """
    if losses.dim() == 0 or losses.shape[0] != n_local:
        raise ValueError(
            f"the loss function returned shape {tuple(losses.shape)} for {n_local} samples: "
            f"expected one loss per sample (shape [{n_local}, ...]). Compute it with "
            "reduction='none' and without averaging over the batch, so that metaddp can "
            "weigh this rank's samples globally"
        )


def one_per_sample(losses: Tensor) -> Tensor:
    """``losses [n, ...]`` as one loss per sample ``[n]``: further dimensions averaged (so
    that for ``mse_loss`` a sample's loss is its mean over outputs)."""
    return losses.flatten(1).mean(dim=1) if losses.dim() > 1 else losses
