"""Convolutions with per-task weights whose derivatives, to any order, are a fixed number of
kernels however many tasks are stacked.

Under ``torch.vmap`` a convolution with per-task weights becomes one grouped convolution
(``groups = tasks * groups``). Its forward and backward are single kernels, but PyTorch's
double backward of a grouped convolution is composite: it slices the tensors and runs one
convolution per group, that is per task. Second-order MAML needs exactly that double
backward, so the stacked meta-step's operation count grew with the number of tasks.

Here the convolution is :class:`_Conv` and its backward is :class:`_ConvBackward`, an
autograd function whose own backward is written with the same two functions. For
``y = conv(x, w) + b`` with upstream adjoint ``gy``, the backward is bilinear,

    gx = conv_input_grad(gy, w),   gw = conv_weight_grad(x, gy),   gb = sum(gy),

so its adjoints for ``(ggx, ggw, ggb)`` are, term by term,

    d gy = conv(ggx, w) + conv(x, ggw) + ggb,
    d x  = conv_input_grad(gy, ggw),
    d w  = conv_weight_grad(ggx, gy):

two grouped convolutions and two grouped convolution backwards, whatever the number of
groups. The values are those of ``aten.convolution`` and ``aten.convolution_backward``, the
kernels autograd itself runs.

:func:`stacked_convolutions` routes ``torch.conv1d/2d/3d`` (``nn.Conv*d`` and
``F.conv*d``) to it for the duration of a stacked forward, so any module gets it without
change. Outside, convolutions are PyTorch's own.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd
from torch.overrides import TorchFunctionMode

# (stride, padding, dilation, groups, tasks), each spatial entry a tuple of ``d`` ints;
# ``groups`` counts the stacked tasks' groups together, ``tasks`` the tasks (1 unstacked).
Spec = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int]

_CONVS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}

# How a stacked forward convolution runs (the backward is always grouped):
# - "grouped": one convolution of ``tasks * groups`` groups (the default);
# - "per_task": one convolution per task;
# - "transposed": the same grouped convolution as a transposed convolution with flipped
#   weights (stride 1 only, else grouped), which cuDNN runs with its input-gradient kernels.
# Measured on an H200 (BENCHMARKS.md): cuDNN's float32 forward of a task-grouped convolution
# took 8.6x the time of one convolution per task, and 8.4x its own input gradient (Conv-4's
# second layer, 32 tasks of 75 images); yet whole meta-steps were faster per task only in
# full float32 replayed from a CUDA graph (1.57x at K = 1, 1.15x at K = 5): eager, the extra
# launches cost as much or more, and with TF32 (PyTorch's default) per task was 1.3x to 1.8x
# slower. "transposed" is one launch; it awaits a GPU measurement (the device check's
# ``stacked_conv`` section measures all three).
FORWARD = "grouped"
FORWARDS = ("grouped", "per_task", "transposed")


def _conv(x: Tensor, w: Tensor, b: Tensor | None, spec: Spec) -> Tensor:
    stride, padding, dilation, groups, tasks = spec
    zeros = [0] * len(stride)
    if tasks > 1 and FORWARD == "per_task":
        return _per_task(x, w, b, spec)
    if FORWARD == "transposed" and set(stride) == {1}:
        # For stride 1, conv(x, w, padding p, dilation d) is the transposed convolution of x
        # with each group's weight transposed (in and out channels) and flipped, padding
        # d (k - 1) - p: the same sums, in another kernel. Also for one task, so that a
        # task's kernel does not depend on how many are stacked.
        k = w.shape[2:]
        q = [di * (ki - 1) - pi for ki, pi, di in zip(k, padding, dilation, strict=True)]
        if min(q) >= 0:
            flipped = w.unflatten(0, (groups, -1)).transpose(1, 2).flatten(0, 1)
            flipped = flipped.flip(list(range(2, w.dim())))
            return torch.ops.aten.convolution(
                x, flipped, b, stride, q, dilation, True, zeros, groups
            )
    return torch.ops.aten.convolution(x, w, b, stride, padding, dilation, False, zeros, groups)


def _per_task(x: Tensor, w: Tensor, b: Tensor | None, spec: Spec) -> Tensor:
    """One convolution per task: the one an unstacked task runs."""
    stride, padding, dilation, groups, tasks = spec
    zeros = [0] * len(stride)
    xs = x.unflatten(1, (tasks, -1)).movedim(1, 0)
    ws = w.unflatten(0, (tasks, -1))
    bs = [None] * tasks if b is None else b.unflatten(0, (tasks, -1))
    per = groups // tasks
    ys = [
        torch.ops.aten.convolution(xt, wt, bt, stride, padding, dilation, False, zeros, per)
        for xt, wt, bt in zip(xs, ws, bs, strict=True)
    ]
    return torch.stack(ys, 1).flatten(1, 2)


def _conv_backward(
    gy: Tensor, x: Tensor, w: Tensor, spec: Spec, bias: bool, mask: Sequence[bool]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    stride, padding, dilation, groups, _ = spec
    zeros = [0] * len(stride)
    return torch.ops.aten.convolution_backward(
        gy,
        x,
        w,
        [w.shape[0]] if bias else None,
        stride,
        padding,
        dilation,
        False,
        zeros,
        groups,
        [mask[0], mask[1], bias and mask[2]],
    )


class _Conv(torch.autograd.Function):
    """``aten.convolution``, differentiable to any order through :class:`_ConvBackward`."""

    @staticmethod
    def forward(x: Tensor, w: Tensor, b: Tensor | None, spec: Spec) -> Tensor:
        return _conv(x, w, b, spec)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x, w, b, spec = inputs
        ctx.save_for_backward(x, w)
        ctx.spec = spec
        ctx.bias = b is not None

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple:
        x, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx, gw, gb = _ConvBackward.apply(gy, x, w, ctx.spec, ctx.bias, (need[0], need[1], need[2]))
        return gx, gw, gb, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, w: Tensor, b: Tensor | None, spec: Spec):
        """Tasks stacked: per-task weights make one convolution of ``tasks * groups`` groups;
        shared weights fold the task axis into the samples."""
        dx, dw, db = in_dims[:3]
        tasks = info.batch_size
        stride, padding, dilation, groups, stacked = spec
        if dw is None and db is None:
            x = x.movedim(dx, 0)
            y = _Conv.apply(x.reshape(tasks * x.shape[1], *x.shape[2:]), w, b, spec)
            return y.reshape(tasks, x.shape[1], *y.shape[1:]), 0
        w = w.movedim(dw, 0) if dw is not None else w.expand(tasks, *w.shape)
        out = w.shape[1]
        if dx is None:
            x = x.unsqueeze(1).expand(x.shape[0], tasks, *x.shape[1:])
        else:
            x = x.movedim(dx, 1)
        n = x.shape[0]
        x = x.reshape(n, tasks * x.shape[2], *x.shape[3:])
        if b is not None:
            b = b.movedim(db, 0) if db is not None else b.expand(tasks, *b.shape)
            b = b.reshape(tasks * out)
        grouped: Spec = (stride, padding, dilation, tasks * groups, tasks * stacked)
        y = _Conv.apply(x, w.reshape(tasks * out, *w.shape[2:]), b, grouped)
        return y.reshape(n, tasks, out, *y.shape[2:]), 1


class _ConvBackward(torch.autograd.Function):
    """``aten.convolution_backward``, with the bilinear adjoint of the module docstring."""

    @staticmethod
    def forward(
        gy: Tensor, x: Tensor, w: Tensor, spec: Spec, bias: bool, mask: tuple[bool, bool, bool]
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        return _conv_backward(gy, x, w, spec, bias, mask)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        gy, x, w, spec, _, _ = inputs
        ctx.save_for_backward(gy, x, w)
        ctx.spec = spec
        # An unused output's adjoint stays None: no convolution of zeros.
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, ggx: Tensor | None, ggw: Tensor | None, ggb: Tensor | None) -> tuple:
        gy, x, w = ctx.saved_tensors
        spec = ctx.spec
        need = ctx.needs_input_grad
        d_gy = d_x = d_w = None
        if need[0]:
            terms = []
            if ggx is not None:
                terms.append(_Conv.apply(ggx, w, None, spec))
            if ggw is not None:
                terms.append(_Conv.apply(x, ggw, None, spec))
            if ggb is not None:
                terms.append(ggb.reshape(1, -1, *([1] * (gy.dim() - 2))).expand_as(gy))
            for t in terms:
                d_gy = t if d_gy is None else d_gy + t
        if need[1] and ggw is not None:
            d_x = _ConvBackward.apply(gy, x, ggw, spec, False, (True, False, False))[0]
        if need[2] and ggx is not None:
            d_w = _ConvBackward.apply(gy, ggx, w, spec, False, (False, True, False))[1]
        return d_gy, d_x, d_w, None, None, None


def _spatial(value: Any, d: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * d
    return tuple(int(v) for v in value)


def convolution(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> Tensor:
    """``torch.conv{d}d`` (``d = weight.dim() - 2``, the same arguments) with a grouped
    double backward."""
    x, w, b = input, weight, bias
    d = w.dim() - 2
    spec: Spec = (_spatial(stride, d), _spatial(padding, d), _spatial(dilation, d), int(groups), 1)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # Autocast would cast inside the function, after its inputs are saved: cast first,
        # as autocast does for a convolution, so the backward sees what the forward used.
        dtype = torch.get_autocast_dtype(device)
        x, w = x.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
    return _Conv.apply(x, w, b, spec)


# torch.conv{d}d's arguments are convolution's: Python binds a routed call to them.
_SIGNATURE = inspect.signature(convolution)


class _StackedConvolutions(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        d = _CONVS.get(func)
        if d is not None:
            try:
                bound = _SIGNATURE.bind(*args, **kwargs).arguments
            except TypeError:  # a wrong call: PyTorch's own error says what is wrong
                bound = None
            # Batched inputs only ([N, C, *spatial]), and padding given as numbers: the
            # string forms ("same") and unbatched inputs keep PyTorch's own convolution.
            if (
                bound is not None
                and bound["input"].dim() == d + 2
                and not isinstance(bound.get("padding", 0), str)
            ):
                return convolution(*args, **kwargs)
        return func(*args, **kwargs)


def has_convolutions(model: nn.Module) -> bool:
    return any(isinstance(m, _ConvNd) for m in model.modules())


def stacked_convolutions(model: nn.Module | None = None) -> contextlib.AbstractContextManager:
    """Inside, convolutions run as :func:`convolution`: under ``torch.vmap`` with per-task
    weights their derivatives cost the same kernels for any number of tasks.

    With ``model``, only if it has convolution layers: the routing sees every torch call in
    Python (measured 20% of a stacked sinusoid MLP's meta-step), so a model without them
    keeps PyTorch's dispatch. A model that calls ``F.conv2d`` itself, without layers, keeps
    PyTorch's convolution: the same values, with a double backward per task.
    """
    if model is not None and not has_convolutions(model):
        return contextlib.nullcontext()
    return _StackedConvolutions()
