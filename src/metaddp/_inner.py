"""Differentiable inner optimizers: pure ``init`` / ``update`` functions over parameter dicts.

As in optax, state is explicit and returned, never hidden on an object, and nothing updates
in place, so every step stays on the autograd graph and second-order meta-gradients flow
through the whole inner trajectory (and through learnable hyper-parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from torch import Tensor

Params = dict[str, Tensor]
State = Any
LearningRate = float | Tensor | Mapping[str, Tensor | float]


class InnerOptimizer(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params) -> (updates, state)``."""

    init: Callable[[Params], State]
    update: Callable[[Params, State, Params], tuple[Params, State]]


def apply_updates(params: Mapping[str, Tensor], updates: Mapping[str, Tensor]) -> Params:
    """``params + updates``, out of place (names without an update are kept as they are)."""
    return {k: (p + updates[k] if k in updates else p) for k, p in params.items()}


def lr_for(lr: LearningRate, name: str) -> float | Tensor:
    """The learning rate of parameter ``name``: a scalar, or its entry of a per-parameter dict."""
    if isinstance(lr, Mapping):
        if name not in lr:
            raise KeyError(f"the learning-rate dict has no entry for parameter {name!r}")
        return lr[name]
    return lr


def sgd(lr: LearningRate) -> InnerOptimizer:
    """Plain gradient descent, ``p <- p - lr * g``; ``lr`` may be a learnable tensor or a dict."""

    def init(params: Params) -> State:
        return ()

    def update(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        return {k: -lr_for(lr, k) * g for k, g in grads.items()}, state

    return InnerOptimizer(init, update)
