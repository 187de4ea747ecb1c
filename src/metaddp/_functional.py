"""Functional fast weights: run any ``nn.Module`` on weights given as a dict.

Nothing here writes into a module's ``_parameters``: ``torch.func.functional_call``
swaps the tensors in for the duration of one call and restores the originals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

Params = dict[str, Tensor]


def params_of(module: nn.Module) -> Params:
    """The module's trained parameters by qualified name (the leaves the outer optimizer
    trains). Frozen ones (``requires_grad=False``) are left out: :func:`call` reads them from
    the module, so inner loops hold them fixed too."""
    return {k: p for k, p in module.named_parameters() if p.requires_grad}


def buffers_of(module: nn.Module) -> Params:
    """The module's buffers by qualified name (BatchNorm running statistics and the like)."""
    return dict(module.named_buffers())


def call(
    module: nn.Module,
    params: Mapping[str, Tensor],
    *args: Any,
    buffers: Mapping[str, Tensor] | None = None,
    **kwargs: Any,
) -> Any:
    """``module(*args, **kwargs)`` evaluated with ``params`` (and ``buffers``) in place of its own.

    Names missing from ``params`` keep the module's own tensors, so a caller can adapt a
    subset (ANIL adapts only the head).
    """
    weights: dict[str, Tensor] = dict(params)
    if buffers is not None:
        weights.update(buffers)
    return torch.func.functional_call(module, weights, args, kwargs, strict=False)


def random_layers(module: nn.Module) -> list[str]:
    """The layers that draw random numbers when called now: dropout with ``p > 0`` and
    RReLU, in training mode. (A random call inside a ``forward`` is not seen.)"""
    return [
        f"{name or 'the model'} ({type(m).__name__})"
        for name, m in module.named_modules()
        if m.training
        and ((isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0) or isinstance(m, nn.RReLU))
    ]
