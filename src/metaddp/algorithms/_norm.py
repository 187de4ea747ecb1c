"""Batch normalisation of stacked tasks in one kernel per layer, with a short double backward.

Under ``torch.vmap`` PyTorch's batch norm with per-task weights normalises without them, then
scales and shifts in separate operations, moving the task axis back and forth; and the double
backward of ``aten.native_batch_norm_backward`` (what second-order MAML differentiates) is a
composite of about 80 operations. Here both are short.

**Stacked.** Activations of ``T`` stacked tasks arrive as ``[n, T, C, *spatial]`` (the layout
the stacked convolution gives). Folding the tasks into the channels, ``[n, T*C, *spatial]``, is
a view, and batch statistics per (task, channel) are exactly batch statistics per folded
channel: one ``native_batch_norm`` with the per-task weights flattened to ``[T*C]``.

**Double backward.** Per channel over its ``M`` values, with ``<.>`` the mean,
``r = (var + eps)^-1/2``, ``xh = (x - mean) r`` and ``P(v) = v - <v> - xh <xh v>`` (symmetric
for ``sum(u P(v))``), the backward is

    gx = w r P(gy),   gw = sum(gy xh),   gb = sum(gy),

and ``d xh = r P(dx)``, ``d r = -r^2 <xh dx>``. So its adjoints for ``(ggx, ggw, ggb)`` are

    d gy = w r P(ggx) + ggw xh + ggb,
    d w  = sum(ggx r P(gy)),
    d x  = ggw r P(gy) - (w r / M) (xh d w + sum(gy xh) r P(ggx) + sum(ggx xh) r P(gy)),

where ``r P(v)`` (with ``sum(v xh)`` and ``sum(v)``) is one ``native_batch_norm_backward``
without a weight: three of those kernels and a dozen elementwise ones, against PyTorch's
composite. Each is this module's own function again, so every order is differentiable.

:func:`batch_norm` is ``F.batch_norm`` in training mode without running statistics (MAML's
batch statistics); :mod:`metaddp.algorithms._layers` routes it there during stacked forwards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._axes import moved


def _channel(t: Tensor, like: Tensor) -> Tensor:
    """A per-channel vector ``[C]`` shaped to broadcast over ``like``'s ``[N, C, *spatial]``."""
    return t.view(1, -1, *([1] * (like.dim() - 2)))


class _BatchNorm(torch.autograd.Function):
    """``aten.native_batch_norm`` with batch statistics: ``(y, mean, invstd)``."""

    @staticmethod
    def forward(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> tuple:
        return torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.0, eps)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, w, _, eps = inputs
        _, mean, invstd = output
        ctx.save_for_backward(x, w, mean, invstd)
        ctx.eps = eps
        ctx.mark_non_differentiable(mean, invstd)
        ctx.set_materialize_grads(False)  # no zeros for the statistics' adjoints

    @staticmethod
    def backward(ctx: Any, gy: Tensor | None, _mean: Any, _invstd: Any) -> tuple:
        if gy is None:
            return None, None, None, None
        x, w, mean, invstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx, gw, gb = _BatchNormBackward.apply(gy, x, w, mean, invstd, ctx.eps)
        return (
            gx if need[0] else None,
            gw if need[1] else None,
            gb if need[2] else None,
            None,
        )

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, w: Tensor | None, b: Tensor | None, eps: float):
        """Tasks stacked: fold them into the channels (module docstring)."""
        dx, dw, db = in_dims[:3]
        tasks = info.batch_size
        x = moved(x, dx, 1) if dx is not None else x.unsqueeze(1).expand(-1, tasks, *x.shape[1:])
        n, _, c, *spatial = x.shape

        def folded(v: Tensor | None, dim: int | None) -> Tensor | None:
            if v is None:
                return None
            v = moved(v, dim, 0) if dim is not None else v.expand(tasks, *v.shape)
            return v.reshape(tasks * c)

        y, mean, invstd = _BatchNorm.apply(
            x.reshape(n, tasks * c, *spatial), folded(w, dw), folded(b, db), eps
        )
        # The statistics leave unbatched, folded ``[T*C]``: :func:`batch_norm` drops them, and
        # a view to ``[T, C]`` would be two more operations per call.
        return (y.view(n, tasks, c, *spatial), mean, invstd), (1, None, None)


class _BatchNormBackward(torch.autograd.Function):
    """``aten.native_batch_norm_backward`` in training mode, with the adjoint of the module
    docstring. ``w=None`` is a weight of ones; ``gw`` is always returned (``sum(gy xh)``)."""

    @staticmethod
    def forward(
        gy: Tensor, x: Tensor, w: Tensor | None, mean: Tensor, invstd: Tensor, eps: float
    ) -> tuple:
        return torch.ops.aten.native_batch_norm_backward(
            gy, x, w, None, None, mean, invstd, True, eps, [True, True, True]
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        gy, x, w, mean, invstd, eps = inputs
        ctx.save_for_backward(gy, x, w, mean, invstd)
        ctx.eps = eps
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, ggx: Tensor | None, ggw: Tensor | None, ggb: Tensor | None) -> tuple:
        gy, x, w, mean, invstd = ctx.saved_tensors
        need_gy, need_x, need_w = ctx.needs_input_grad[:3]
        eps = ctx.eps
        if torch.is_grad_enabled():
            # A derivative of this one will be taken: the statistics, functions of x, must
            # carry theirs (the kernels below are functions of x alone, given the values).
            var, mu = torch.var_mean(x, [0, *range(2, x.dim())], correction=0)
            r = torch.rsqrt(var + eps)
        else:
            mu, r = mean, invstd
        m = x.numel() // max(x.shape[1], 1)

        held: list[Tensor] = []

        def normalised() -> Tensor:
            if not held:
                held.append((x - _channel(mu, x)) * _channel(r, x))
            return held[0]

        def rp(v: Tensor) -> tuple[Tensor, Tensor]:
            """``r P(v)`` and ``sum(v xh)``."""
            out, s, _ = _BatchNormBackward.apply(v, x, None, mean, invstd, eps)
            return out, s

        d_gy: list[Tensor] = []
        d_x: list[Tensor] = []
        d_w = None
        if ggx is not None and (need_x or need_w):
            rp_gy, s_gy = rp(gy)
        elif ggw is not None and need_x:
            rp_gy, _ = rp(gy)
        if ggx is not None:
            if need_gy or need_x:
                rp_ggx, s_ggx = rp(ggx)
            if need_gy:
                d_gy.append(rp_ggx if w is None else rp_ggx * _channel(w, x))
            if need_x or need_w:
                dw = (ggx * rp_gy).sum([0, *range(2, x.dim())])
                d_w = dw if need_w else None
            if need_x:
                scale = _channel(r if w is None else w * r, x) / -m
                d_x.append(
                    (
                        normalised() * _channel(dw, x)
                        + rp_ggx * _channel(s_gy, x)
                        + rp_gy * _channel(s_ggx, x)
                    )
                    * scale
                )
        if ggw is not None:
            if need_gy:
                d_gy.append(normalised() * _channel(ggw, x))
            if need_x:
                d_x.append(rp_gy * _channel(ggw, x))
        if ggb is not None and need_gy:
            d_gy.append(_channel(ggb, x).expand_as(gy))
        return _total(d_gy), _total(d_x), d_w, None, None, None


def _total(terms: list[Tensor]) -> Tensor | None:
    out = None
    for t in terms:
        out = t if out is None else out + t
    return out


def batch_norm(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    """``F.batch_norm(x, None, None, w, b, training=True, eps=eps)``, stacked in one kernel
    under ``torch.vmap`` and with the double backward of the module docstring."""
    return _BatchNorm.apply(x, w, b, eps)[0]
