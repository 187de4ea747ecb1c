"""The ways a stacked forward convolution can run, and the choice among them by measurement.

The backward of a stacked convolution is always grouped; its forward (also the forward
convolutions of the double backward) can run four ways, with the same sums:

- ``"grouped"``: one convolution of ``tasks * groups`` groups;
- ``"per_task"``: one convolution per task, the kernel an unstacked task runs;
- ``"transposed"``: the grouped convolution as a transposed convolution with flipped weights
  (stride 1; grouped otherwise), which cuDNN runs with its input-gradient kernels;
- ``"channels_last"``: the grouped convolution on channels-last copies (2-d only; grouped
  otherwise).

Which is fastest depends on the device, the library and the shapes. Measured on an H200
(BENCHMARKS.md, 2026-11-30): cuDNN's float32 forward of a task-grouped convolution took 8.6x
the time of one convolution per task, yet per task was 1.3x to 1.8x slower per meta-step with
TF32, where its extra launches cost more than it saves. So :class:`ConvChoice` ``"auto"``
times every way on the first call of each shape, remembers the fastest per shape, dtype and
device, and a forced way skips the measurement.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch import Tensor

WAYS = ("grouped", "per_task", "transposed", "channels_last")

# (stride, padding, dilation, groups, tasks, way), each spatial entry a tuple of ``d`` ints;
# ``groups`` counts the stacked tasks' groups together, ``tasks`` the tasks (1 unstacked).
Spec = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int, str]


def _transposed_padding(w: Tensor, spec: Spec) -> list[int] | None:
    """The padding of the transposed form, or ``None`` where there is none (stride > 1, or a
    padding beyond ``d (k - 1)``)."""
    stride, padding, dilation = spec[:3]
    if set(stride) != {1}:
        return None
    k = w.shape[2:]
    q = [di * (ki - 1) - pi for ki, pi, di in zip(k, padding, dilation, strict=True)]
    return q if min(q) >= 0 else None


def applies(way: str, x: Tensor, w: Tensor, spec: Spec) -> bool:
    """Whether ``way`` is its own kernel here (else it runs grouped)."""
    if way == "per_task":
        return spec[4] > 1
    if way == "transposed":
        return _transposed_padding(w, spec) is not None
    if way == "channels_last":
        return x.dim() == 4
    return way == "grouped"


def run(x: Tensor, w: Tensor, b: Tensor | None, spec: Spec) -> Tensor:
    """The forward convolution of ``spec``, its way."""
    stride, padding, dilation, groups, tasks, way = spec
    zeros = [0] * len(stride)
    if way == "per_task" and tasks > 1:
        xs = x.unflatten(1, (tasks, -1)).movedim(1, 0)
        ws = w.unflatten(0, (tasks, -1))
        bs = [None] * tasks if b is None else b.unflatten(0, (tasks, -1))
        per = groups // tasks
        ys = [
            torch.ops.aten.convolution(xt, wt, bt, stride, padding, dilation, False, zeros, per)
            for xt, wt, bt in zip(xs, ws, bs, strict=True)
        ]
        return torch.stack(ys, 1).flatten(1, 2)
    if way == "transposed" and (q := _transposed_padding(w, spec)) is not None:
        # For stride 1, conv(x, w, padding p, dilation d) is the transposed convolution of x
        # with each group's weight transposed (in and out channels) and flipped, padding
        # d (k - 1) - p: the same sums, in another kernel.
        flipped = w.unflatten(0, (groups, -1)).transpose(1, 2).flatten(0, 1)
        flipped = flipped.flip(list(range(2, w.dim())))
        return torch.ops.aten.convolution(x, flipped, b, stride, q, dilation, True, zeros, groups)
    if way == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
        y = torch.ops.aten.convolution(x, w, b, stride, padding, dilation, False, zeros, groups)
        # Back to the layout the other layers are measured in: PyTorch's CPU batch norm of
        # channels-last float32 measured ~10x the rounding error of the contiguous kernel.
        return y.contiguous()
    return torch.ops.aten.convolution(x, w, b, stride, padding, dilation, False, zeros, groups)


class ConvChoice:
    """How a stacked forward convolution runs: one way for all (``way`` in :data:`WAYS`), or
    ``"auto"``: each shape's fastest, timed on its first call and remembered.

    One per algorithm (``MAML(conv=...)``). :attr:`chosen` maps each measured shape to its
    way, :attr:`timings` to every way's seconds. A measurement needs the device's clock: it
    is skipped (the shape runs grouped, unremembered) while a CUDA graph records, and under
    other function transforms than the stacking itself.
    """

    def __init__(self, way: str = "auto", repeats: int = 3) -> None:
        if way != "auto" and way not in WAYS:
            raise ValueError(f"conv must be 'auto' or one of {', '.join(WAYS)}, got {way!r}")
        self.way = way
        self.repeats = repeats
        self.chosen: dict[tuple, str] = {}
        self.timings: dict[tuple, dict[str, float]] = {}

    def __repr__(self) -> str:
        return f"ConvChoice({self.way!r})"

    def way_for(self, x: Tensor, w: Tensor, b: Tensor | None, spec: Spec) -> str:
        """The way to run ``spec``'s convolution of ``x`` by ``w`` (``spec``'s own way is
        ignored)."""
        if self.way != "auto":
            return self.way
        key = (x.device, x.dtype, tuple(x.shape), tuple(w.shape), b is not None, spec[:5])
        if (way := self.chosen.get(key)) is not None:
            return way
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing or any(wrapped(t) for t in (x, w) if t is not None):
            return "grouped"
        ways = [v for v in WAYS if applies(v, x, w, spec)]
        self.timings[key] = seconds = {v: self._seconds(x, w, b, (*spec[:5], v)) for v in ways}
        self.chosen[key] = way = min(ways, key=seconds.__getitem__)
        return way

    def _seconds(self, x: Tensor, w: Tensor, b: Tensor | None, spec: Spec) -> float:
        """The least time of ``repeats`` runs after one warm-up (a host wait on a GPU: the
        first call of a shape only)."""
        x, w = x.detach(), w.detach()
        b = None if b is None else b.detach()
        cuda = x.is_cuda
        best = float("inf")
        with torch.no_grad(), _sync_allowed(cuda):
            run(x, w, b, spec)
            for _ in range(self.repeats):
                if cuda:
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    run(x, w, b, spec)
                    end.record()
                    end.synchronize()
                    best = min(best, start.elapsed_time(end) / 1e3)
                else:
                    t0 = time.perf_counter()
                    run(x, w, b, spec)
                    best = min(best, time.perf_counter() - t0)
        return best


@contextlib.contextmanager
def _sync_allowed(cuda: bool) -> Iterator[None]:
    """Inside, CUDA's sync debug mode is off (the measurement waits on purpose)."""
    if not cuda:
        yield
        return
    was = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(was)


GROUPED = ConvChoice("grouped")  # a fixed way never changes: one shared instance serves
