"""Elementwise steps over a whole parameter set in one kernel.

An inner step of plain gradient descent is ``p - lr * g`` for every parameter tensor: two
kernels per tensor. On a GPU a meta-step of small tasks is bound by such launches
(BENCHMARKS.md, "Dispatched operations"). Here the products are one ``torch._foreach_mul`` and
the sums one ``torch._foreach_add``, computed outside autograd; each result then joins the
graph through its own node, which dispatches nothing forward and passes the gradient through
backward (the sum) or scales it (the product). So every output depends on its own inputs
only, as with per-tensor operations: what a loss reaches, and which gradients stay ``None``,
is unchanged. The values are bit for bit those of the per-tensor operations (the same
products and sums, entry by entry), and every order is differentiable.

Tensors of functorch transforms (an update under ``torch.vmap``) take the per-tensor
operations, which the transforms know.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


class _Held:
    """A result computed outside the graph, handed to the node that joins it in."""

    __slots__ = ("value",)

    def __init__(self, value: Tensor) -> None:
        self.value = value


class _Scaled(torch.autograd.Function):
    """``factor * t``, its value given."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, factor: float, held: _Held) -> Tensor:
        ctx.factor = factor
        return held.value

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        return g * ctx.factor, None, None


class _Summed(torch.autograd.Function):
    """``a + b``, its value given."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, held: _Held) -> Tensor:
        return held.value

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        return g, g, None


def _fusable(tensors: Sequence[Tensor]) -> bool:
    return bool(tensors) and not any(_wrapped(t) for t in tensors)


def scaled(tensors: Sequence[Tensor], factors: Sequence[float]) -> list[Tensor]:
    """``[f * t for t, f in zip(tensors, factors)]``, in one kernel forward."""
    if not _fusable(tensors):
        return [f * t for t, f in zip(tensors, factors, strict=True)]
    factors = [float(f) for f in factors]
    with torch.no_grad():
        values = torch._foreach_mul(list(tensors), factors)
    return [
        _Scaled.apply(t, f, _Held(v)) if t.requires_grad else v
        for t, f, v in zip(tensors, factors, values, strict=True)
    ]


def added(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[Tensor]:
    """``[x + y for x, y in zip(a, b)]``, in one kernel forward and none backward.

    Pairs of different shapes or dtypes (a broadcast, a promotion) take the per-tensor sum,
    whose adjoint knows how to reduce them."""
    if not _fusable([*a, *b]) or any(
        x.shape != y.shape or x.dtype != y.dtype or x.device != y.device
        for x, y in zip(a, b, strict=True)
    ):
        return [x + y for x, y in zip(a, b, strict=True)]
    with torch.no_grad():
        values = torch._foreach_add(list(a), list(b))
    return [
        _Summed.apply(x, y, _Held(v)) if x.requires_grad or y.requires_grad else v
        for x, y, v in zip(a, b, values, strict=True)
    ]
