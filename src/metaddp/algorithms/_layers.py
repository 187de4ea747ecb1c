"""Which layers a stacked forward runs on metaddp's own kernels, and the routing to them.

Inside :func:`stacked_layers`, a call of ``torch.conv1d/2d/3d`` (``nn.Conv*d``, ``F.conv*d``),
of ``F.batch_norm`` with batch statistics (``nn.BatchNorm*d(track_running_stats=False)``, or
``training=True`` without running buffers) and of ``F.max_pool2d`` runs as
:func:`metaddp.algorithms._conv.convolution`, :func:`metaddp.algorithms._norm.batch_norm` and
:func:`metaddp.algorithms._pool.max_pool2d`. Under ``torch.vmap`` over stacked tasks those keep
the task axis beside the channels, where it folds into one kernel as a view, and have short
double backwards: the operations of a second-order meta-step do not grow with the number of
tasks, and are fewer than vmap's batching rules give (BENCHMARKS.md, "Dispatched operations").
Outside, every layer is PyTorch's own; any other call inside is PyTorch's too.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.overrides import TorchFunctionMode

from . import _conv, _norm, _pool
from ._conv_ways import GROUPED, ConvChoice

_CONVS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}


def _signature(*names: str, **defaults: Any) -> inspect.Signature:
    """Parameters ``names`` without defaults, then ``defaults``, positional or by keyword."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature(
        [inspect.Parameter(n, kind) for n in names]
        + [inspect.Parameter(n, kind, default=d) for n, d in defaults.items()]
    )


# PyTorch's own argument names and defaults: Python binds a routed call to them.
_SIGNATURES = {
    "conv": _signature("input", "weight", bias=None, stride=1, padding=0, dilation=1, groups=1),
    "batch_norm": _signature(
        "input", "running_mean", "running_var",
        weight=None, bias=None, training=False, momentum=0.1, eps=1e-5,
    ),
    "max_pool2d": _signature(
        "input", "kernel_size",
        stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False,
    ),
}  # fmt: skip


def _bind(name: str, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    try:
        bound = _SIGNATURES[name].bind(*args, **kwargs)
    except TypeError:  # a wrong call: PyTorch's own error says what is wrong
        return None
    bound.apply_defaults()
    return bound.arguments


def _routed(func: Any, args: tuple, kwargs: dict, choice: ConvChoice) -> Any:
    """The call on metaddp's kernel, or ``NotImplemented`` where PyTorch's own must run."""
    if (d := _CONVS.get(func)) is not None:
        a = _bind("conv", args, kwargs)
        # Batched inputs only ([N, C, *spatial]), and padding given as numbers: the string
        # forms ("same") and unbatched inputs keep PyTorch's own convolution.
        if a is not None and a["input"].dim() == d + 2 and not isinstance(a["padding"], str):
            return _conv.convolution(**a, choice=choice)
    elif func is F.batch_norm:
        a = _bind("batch_norm", args, kwargs)
        # Batch statistics only (running statistics are refused when stacked, and evaluation
        # uses them); autocast keeps PyTorch's, which chooses the statistics' precision.
        if (
            a is not None
            and a["training"]
            and a["running_mean"] is None
            and a["running_var"] is None
            and a["input"].dim() >= 2
            and not torch.is_autocast_enabled(a["input"].device.type)
        ):
            return _norm.batch_norm(a["input"], a["weight"], a["bias"], float(a["eps"]))
    elif func is F.max_pool2d:
        a = _bind("max_pool2d", args, kwargs)
        if a is not None and not a["return_indices"] and a["input"].dim() == 4:
            return _pool.max_pool2d(
                a["input"],
                a["kernel_size"],
                a["stride"],
                a["padding"],
                a["dilation"],
                a["ceil_mode"],
            )
    return NotImplemented


class _StackedLayers(TorchFunctionMode):
    def __init__(self, choice: ConvChoice) -> None:
        super().__init__()
        self.choice = choice

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in _CONVS or func is F.batch_norm or func is F.max_pool2d:
            out = _routed(func, args, kwargs, self.choice)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


_LAYERS = (_ConvNd, _BatchNorm, nn.MaxPool2d)


def has_stacked_layers(model: nn.Module) -> bool:
    """Whether ``model`` has a layer :func:`stacked_layers` routes."""
    return any(isinstance(m, _LAYERS) for m in model.modules())


def has_convolutions(model: nn.Module) -> bool:
    return any(isinstance(m, _ConvNd) for m in model.modules())


def stacked_layers(
    model: nn.Module | None = None, conv: ConvChoice = GROUPED
) -> contextlib.AbstractContextManager:
    """Inside, convolutions, batch norm with batch statistics and 2-d max pooling run on
    metaddp's kernels (module docstring); stacked forward convolutions the way ``conv``
    gives (:mod:`metaddp.algorithms._conv_ways`).

    With ``model``, only if it has such layers: the routing sees every torch call in Python
    (measured 20% of a stacked sinusoid MLP's meta-step), so a model without them keeps
    PyTorch's dispatch. A model that calls ``F.conv2d`` itself, without layers, keeps
    PyTorch's: the same values, with more operations.
    """
    if model is not None and not has_stacked_layers(model):
        return contextlib.nullcontext()
    return _StackedLayers(conv)
