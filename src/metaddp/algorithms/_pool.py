"""Max pooling of stacked tasks without moving the task axis.

Under ``torch.vmap`` PyTorch's pooling moves the task axis to the front and copies the
activations to fold it into the samples. Pooling acts on each channel alone, so activations of
``T`` stacked tasks laid out ``[n, T, C, *spatial]`` (as the stacked convolution gives them)
fold into the channels, ``[n, T*C, *spatial]``, as a view. The kernels are PyTorch's own,
forward and backward, so the values are too; the backward's own derivative is
``aten.max_pool2d_with_indices_backward``'s (a gather by the saved indices).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._axes import moved

# (kernel, stride, padding, dilation, ceil_mode), each spatial entry a pair.
Spec = tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int], bool]


class _MaxPool2d(torch.autograd.Function):
    """``aten.max_pool2d_with_indices``: ``(y, indices)``."""

    @staticmethod
    def forward(x: Tensor, spec: Spec) -> tuple[Tensor, Tensor]:
        return torch.ops.aten.max_pool2d_with_indices(x, *spec)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, spec = inputs
        _, indices = output
        ctx.save_for_backward(x, indices)
        ctx.spec = spec
        ctx.mark_non_differentiable(indices)
        ctx.set_materialize_grads(False)  # no zeros for the indices' adjoint

    @staticmethod
    def backward(ctx: Any, gy: Tensor | None, _indices: Any) -> tuple:
        if gy is None:
            return None, None
        x, indices = ctx.saved_tensors
        return torch.ops.aten.max_pool2d_with_indices_backward(gy, x, *ctx.spec, indices), None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, spec: Spec):
        """Tasks stacked: fold them into the channels (module docstring)."""
        x = moved(x, in_dims[0], 1)
        n, tasks, c, *spatial = x.shape
        y, indices = _MaxPool2d.apply(x.reshape(n, tasks * c, *spatial), spec)
        # The indices leave unbatched, folded: :func:`max_pool2d` drops them.
        return (y.view(n, tasks, c, *y.shape[2:]), indices), (1, None)


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    a, b = (int(v) for v in value)
    return (a, b)


def max_pool2d(
    x: Tensor,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
) -> Tensor:
    """``F.max_pool2d`` on ``[N, C, H, W]`` (``return_indices=False``), stacked as a view."""
    kernel = _pair(kernel_size)
    steps = (
        kernel if stride is None or (not isinstance(stride, int) and not stride) else _pair(stride)
    )
    spec: Spec = (kernel, steps, _pair(padding), _pair(dilation), bool(ceil_mode))
    return _MaxPool2d.apply(x, spec)[0]
