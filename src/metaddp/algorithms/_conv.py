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

:func:`metaddp.algorithms._layers.stacked_layers` routes ``torch.conv1d/2d/3d`` (``nn.Conv*d``
and ``F.conv*d``) to it for the duration of a stacked forward, so any module gets it without
change. Outside, convolutions are PyTorch's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._axes import moved
from ._conv_ways import GROUPED, ConvChoice, Spec, run


def _conv_backward(
    gy: Tensor, x: Tensor, w: Tensor, spec: Spec, bias: bool, mask: Sequence[bool]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    stride, padding, dilation, groups = spec[:4]
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
    def forward(x: Tensor, w: Tensor, b: Tensor | None, spec: Spec, choice: ConvChoice) -> Tensor:
        return run(x, w, b, spec)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x, w, b, spec, _ = inputs
        ctx.save_for_backward(x, w)
        ctx.spec = spec
        ctx.bias = b is not None

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple:
        x, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx, gw, gb = _ConvBackward.apply(gy, x, w, ctx.spec, ctx.bias, (need[0], need[1], need[2]))
        return gx, gw, gb, None, None

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple,
        x: Tensor,
        w: Tensor,
        b: Tensor | None,
        spec: Spec,
        choice: ConvChoice,
    ):
        """Tasks stacked: per-task weights make one convolution of ``tasks * groups`` groups,
        run the way ``choice`` gives; shared weights fold the task axis into the samples."""
        dx, dw, db = in_dims[:3]
        tasks = info.batch_size
        stride, padding, dilation, groups, stacked, way = spec
        if dw is None and db is None:
            # Shared weights: the tasks fold into the samples, beside which they already lie.
            if dx == 1:
                n = x.shape[0]
                y = _Conv.apply(x.reshape(n * tasks, *x.shape[2:]), w, b, spec, choice)
                return y.view(n, tasks, *y.shape[1:]), 1
            x = moved(x, dx, 0)
            y = _Conv.apply(x.reshape(tasks * x.shape[1], *x.shape[2:]), w, b, spec, choice)
            return y.view(tasks, x.shape[1], *y.shape[1:]), 0
        w = moved(w, dw, 0) if dw is not None else w.expand(tasks, *w.shape)
        out = w.shape[1]
        if dx is None:
            x = x.unsqueeze(1).expand(x.shape[0], tasks, *x.shape[1:])
        else:
            x = moved(x, dx, 1)
        n = x.shape[0]
        x = x.reshape(n, tasks * x.shape[2], *x.shape[3:])
        if b is not None:
            b = moved(b, db, 0) if db is not None else b.expand(tasks, *b.shape)
            b = b.reshape(tasks * out)
        w = w.reshape(tasks * out, *w.shape[2:])
        grouped: Spec = (stride, padding, dilation, tasks * groups, tasks * stacked, way)
        grouped = (*grouped[:5], choice.way_for(x, w, b, grouped))
        y = _Conv.apply(x, w, b, grouped, choice)
        return y.view(n, tasks, out, *y.shape[2:]), 1


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
                terms.append(_Conv.apply(ggx, w, None, spec, GROUPED))
            if ggw is not None:
                terms.append(_Conv.apply(x, ggw, None, spec, GROUPED))
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
    choice: ConvChoice = GROUPED,
) -> Tensor:
    """``torch.conv{d}d`` (``d = weight.dim() - 2``, the same arguments) with a grouped
    double backward; stacked under ``torch.vmap``, its forward runs the way ``choice`` gives
    (:mod:`metaddp.algorithms._conv_ways`)."""
    x, w, b = input, weight, bias
    d = w.dim() - 2
    # One task runs a forced way too, so that its kernel does not depend on how many are
    # stacked; "auto" measures stacked shapes only.
    way = "grouped" if choice.way == "auto" else choice.way
    spec: Spec = (
        _spatial(stride, d),
        _spatial(padding, d),
        _spatial(dilation, d),
        int(groups),
        1,
        way,
    )
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # Autocast would cast inside the function, after its inputs are saved: cast first,
        # as autocast does for a convolution, so the backward sees what the forward used.
        dtype = torch.get_autocast_dtype(device)
        x, w = x.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
    return _Conv.apply(x, w, b, spec, choice)
