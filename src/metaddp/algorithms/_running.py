"""Running statistics of BatchNorm layers under stacked tasks, moved as the per-task loop
moves them.

The loop runs task 0's forwards, then task 1's, ..., and each forward of a layer that tracks
running statistics moves them in place: ``r <- (1 - m) r + m s`` (``s`` the batch's mean, or
its unbiased variance). Stacked tasks run every task's forward at once, under ``torch.vmap``,
which cannot write one shared buffer from many tasks. So every task runs on its own copy
(a row of a ``[T, ...]`` buffer, passed through ``vmap``), all starting at the layer's values
``r0``. After ``C`` forwards, task ``t``'s copy holds

    r_t = (1 - m)^C r0 + d_t,    d_t = sum_f m (1 - m)^(C - 1 - f) s_(t, f),

and the loop's value, folding the tasks in order, is ``r <- (1 - m)^C r + d_t`` from ``r0``:
the same sums, to rounding. ``C`` is each row's count of forwards (``num_batches_tracked``),
kept on the device, so committing reads nothing on the host. A cumulative average
(``momentum=None``) weighs every forward of the whole meta-batch by its position in it: it
is refused here, and runs in the loop.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

STATISTICS = ("running_mean", "running_var")


def tracking(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The BatchNorm layers that update running statistics when called (training mode)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and m.training and m.running_mean is not None
    ]


class TaskStatistics:
    """One copy of every tracked layer's running statistics per stacked task.

    :attr:`copies` are the buffers to run the stacked forwards with (by the model's buffer
    names, each ``[T, ...]``); :meth:`commit` writes the loop's values into the layers.
    """

    def __init__(self, model: nn.Module, n_tasks: int) -> None:
        self.layers = tracking(model)
        cumulative = [name or "the model" for name, m in self.layers if m.momentum is None]
        if cumulative:
            raise ValueError(
                f"BatchNorm layers {', '.join(cumulative[:3])} keep a cumulative average "
                "(momentum=None), whose weights depend on the order of every task's forwards: "
                "use batched=False (or None) for them, or give them a momentum"
            )
        self.copies: dict[str, Tensor] = {}
        for name, m in self.layers:
            for k in (*STATISTICS, "num_batches_tracked"):
                b = getattr(m, k)
                self.copies[f"{name}.{k}" if name else k] = (
                    b.detach().unsqueeze(0).repeat(n_tasks, *[1] * b.dim())
                )

    def commit(self) -> None:
        """Fold the tasks' copies into each layer, in the loop's order of tasks."""
        with torch.no_grad():
            for name, m in self.layers:
                at = f"{name}." if name else ""
                assert m.num_batches_tracked is not None and isinstance(m.momentum, float)
                counts = self.copies[at + "num_batches_tracked"]
                for k in STATISTICS:
                    start: Tensor = getattr(m, k)
                    rows = self.copies[at + k]
                    # (1 - m)^C of each task, on the device (no host read).
                    keep = (1 - m.momentum) ** (counts - m.num_batches_tracked).to(rows.dtype)
                    value = start.clone()
                    for t in range(rows.shape[0]):
                        value = keep[t] * value + (rows[t] - keep[t] * start)
                    start.copy_(value)
                m.num_batches_tracked.add_((counts - m.num_batches_tracked).sum())
