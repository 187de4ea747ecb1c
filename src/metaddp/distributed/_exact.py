"""The mesh's side of deterministic mode: order-free sums over the task and sample axes.

In this mode every value that the ranks hold alike (fast weights, inner gradients, batch
statistics, the meta-loss, the meta-gradient) is held in full and bit for bit alike on every
rank; what a rank holds alone is one chunk's contribution. Two differentiable operations
connect them, each the other's adjoint (:mod:`metaddp.distributed._fixed`):

* *spread*: copies of a value all ranks hold, one per local chunk (or task);
* *gather*: the fixed-point sum of every chunk's contribution over the ranks that hold them.

So the meta-gradient is complete on every rank when the backward ends: the spread of the
meta-parameters to the tasks sums their gradients in its backward, over the task axis.
Nothing here knows what the chunks compute.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from .._data import Batch, Chunks, MetaBatch, Shard, Task
from ._collectives import Phase, all_reduce_sum, group_rank
from ._fixed import gather, spread
from ._mesh import Mesh

DEFAULT_CHUNKS = 8


class ExactSums:
    """Order-free sums over a :class:`metaddp.Mesh`, for chunks of ``chunks`` at most per batch.

    Args:
        mesh: the ranks' layout.
        chunks: the most chunks a batch is cut into; the same at every world size. A sample
            axis longer than ``chunks`` leaves ranks without chunks (they still take part).
    """

    def __init__(self, mesh: Mesh, chunks: int = DEFAULT_CHUNKS) -> None:
        if chunks < 1:
            raise ValueError(f"chunks must be a positive number, got {chunks}")
        self.mesh, self.chunks = mesh, int(chunks)
        self._units: list[tuple[int, int]] = []
        self.used = False  # set by spread_tasks: the step's gradients are complete

    def cut_meta_batch(self, whole: MetaBatch) -> MetaBatch:
        """A task group's whole tasks, every batch cut to this rank's whole chunks."""
        out = MetaBatch(
            [Task(*(_take(b, self.cut(b.n).samples) for b in t)) for t in whole],
            whole.n,
            whole.indices,
        )
        out.source = whole.source
        return out

    def cut(self, n: int) -> Chunks:
        """The chunks of a batch of ``n`` samples, and this rank's (on the sample axis)."""
        return Chunks.of(n, self.chunks, self.mesh.sample_index, self.mesh.samples)

    def spread_tasks(self, tensors: Sequence[Tensor], n_local: int) -> list[Tensor]:
        """``[*s] -> [n_local, *s]``: a copy per local task of values every rank holds; the
        backward sums the copies' gradients over the task axis (the meta-gradient)."""
        self.used = True
        # Ranks of one sample group hold the same tasks, in full: summing over the ranks with
        # this rank's sample index (one per task group) counts every task once.
        group = self.mesh.task_group
        out = spread([t.unsqueeze(0) for t in tensors], [n_local] * len(tensors), group)
        return [o.squeeze(0) for o in out]

    def spread_units(self, tensors: Sequence[Tensor], width: int) -> list[Tensor]:
        """``[T, *s] -> [T, width, *s]``: a copy per local chunk of each task's value."""
        return spread(tensors, [width] * len(tensors), self.mesh.sample_group)

    def gather_units(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """``[T, m, *s] -> [T, *s]``: each task's sum over its chunks on every rank."""
        return gather(tensors, self.mesh.sample_group)

    def total(self, values: Tensor) -> Tensor:
        """The sum of every rank's ``values`` (1-d), returned as this rank's share of it: the
        whole on the mesh's first rank, zero elsewhere, so that shares add up to it exactly.
        Its backward gives every contribution the whole adjoint."""
        whole = gather([values.reshape(1, -1)], self.mesh.group)[0].reshape(())
        return _FirstRankShare.apply(whole, self.mesh.group)

    def total_tasks(self, values: Tensor) -> Tensor:
        """The sum over the meta-batch of per-task ``values`` (1-d, one per local task) that
        every rank of a sample group holds alike, as this rank's share (:meth:`total`): summed
        over the task axis only, so each task counts once."""
        whole = gather([values.reshape(1, -1)], self.mesh.task_group)[0].reshape(())
        return _FirstRankShare.apply(whole, self.mesh.group)

    @contextlib.contextmanager
    def units(self, tasks: int, width: int) -> Iterator[None]:
        """Inside, :meth:`pool` sums over a vmapped axis of ``tasks * width`` chunks."""
        self._units.append((tasks, width))
        try:
            yield
        finally:
            self._units.pop()

    def pooling(self) -> bool:
        return bool(self._units)

    def pool(self, tensors: list[Tensor]) -> list[Tensor]:
        """Under ``torch.vmap`` over the chunks of :meth:`units`: every chunk gets its task's
        sum over all its chunks (BatchNorm's statistics). Self-adjoint."""
        return list(_Pool.apply(self, *tensors))


class _FirstRankShare(torch.autograd.Function):
    @staticmethod
    def forward(whole, group):
        return whole * (1.0 if group_rank(group) == 0 else 0.0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        # Every rank's contribution needs the adjoint of the whole: the sum of the shares'
        # adjoints, of which only the first rank's is not multiplied by zero (exact).
        w = 1.0 if group_rank(ctx.group) == 0 else 0.0
        return all_reduce_sum([grad * w], ctx.group, phase=Phase.BACKWARD)[0], None


class _Pool(torch.autograd.Function):
    @staticmethod
    def forward(sums, *tensors):
        raise RuntimeError("ExactSums.pool runs under torch.vmap over chunks only")

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("ExactSums.pool runs under torch.vmap over chunks only")

    @staticmethod
    def vmap(info, in_dims, sums, *tensors):
        tasks, width = sums._units[-1]
        units = tasks * width
        phys = []
        for t, d in zip(tensors, in_dims[1:], strict=True):
            t = t.movedim(d, 0) if d is not None else t.unsqueeze(0).expand(units, *t.shape)
            phys.append(t.reshape(tasks, width, *t.shape[1:]))
        whole = sums.spread_units(sums.gather_units(phys), width)
        return tuple(w.reshape(units, *w.shape[2:]) for w in whole), (0,) * len(whole)


def _take(batch: Batch, samples: range) -> Batch:
    return Shard(
        batch.x[samples.start : samples.stop], batch.y[samples.start : samples.stop], batch.n
    )


def deterministic_kernels(module: nn.Module) -> Callable[[], None]:
    """Kernels whose results do not depend on the run or on the batch's shape; returns what
    puts the process's settings back as they were (``MetaDDP.release``). On the CPU: no
    oneDNN (its convolutions change with the number of chunks stacked in one call,
    measured); the CPU kernels metaddp runs have no run-to-run variation. On a GPU also
    PyTorch's deterministic algorithms (no atomic adds) and cuDNN's deterministic choices."""
    cudnn = torch.backends.cudnn
    was = (
        torch.backends.mkldnn.enabled,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
        cudnn.deterministic,
        cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    if any(p.is_cuda for p in module.parameters()):
        # cuBLAS picks its reduction split by workspace unless told a fixed one; read when its
        # handle is made, so a process that already ran matrix products keeps its own.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Filling every new tensor with NaN (on by default with the above) costs a pass over
        # memory per allocation and makes no result more deterministic here: nothing reads
        # memory it did not write.
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
        cudnn.deterministic = True
        cudnn.benchmark = False

    def restore() -> None:
        torch.backends.mkldnn.enabled = was[0]
        torch.use_deterministic_algorithms(was[1], warn_only=was[2])
        torch.utils.deterministic.fill_uninitialized_memory = was[3]  # type: ignore[attr-defined]
        cudnn.deterministic, cudnn.benchmark = was[4], was[5]
        if was[6] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = was[6]

    return restore
