"""Gradient transformations that compose with the inner optimizers, in optax's manner: a
transformation is an :class:`InnerOptimizer` whose "updates" are new gradients, and
:func:`chain` feeds each one's output to the next.

``chain(clip_by_global_norm(1.0), sgd(0.1))`` clips every inner gradient to norm 1, then
steps. Where processes split a task's samples, the gradients a step sees are the whole task's
(already summed), so the norm is the whole batch's on any number of processes; on stacked tasks
it is each task's own.
"""

from __future__ import annotations

import torch

from ._optimizers import (
    _LEARNED,
    _TRANSFORMS,
    InnerOptimizer,
    Params,
    SlotState,
    State,
    _shapes,
    check_state,
    learned_rates,
)


def clip_by_global_norm(max_norm: float, eps: float = 1e-6) -> InnerOptimizer:
    """Scale the gradients by ``min(1, max_norm / (norm + eps))``, ``norm`` the 2-norm of them
    all together, as ``torch.nn.utils.clip_grad_norm_`` does. Differentiable to any order (the
    norm's derivative at zero gradients is taken as zero, so no NaN).

    Args:
        max_norm: the largest norm the gradients keep.
        eps: added to the norm in the ratio (torch's 1e-6).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")

    def init(params: Params) -> State:
        return SlotState(0, (), _shapes(params))

    def update(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        check_state(state, grads, "clip_by_global_norm")
        new = SlotState(state.count + 1, (), state.shapes)
        if not grads:
            return {}, new
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])
        )
        coef = torch.clamp(max_norm / (norm + eps), max=1.0)
        return {k: g * coef for k, g in grads.items()}, new

    _TRANSFORMS.add(update)
    return InnerOptimizer(init, update)


def chain(*parts: InnerOptimizer) -> InnerOptimizer:
    """The transformations ``parts`` one after the other: each one's updates are the next
    one's gradients, and the last one's are the step. The state is the tuple of theirs."""
    if not parts:
        raise ValueError("chain() needs at least one optimizer or transformation")
    for p in parts:
        if not isinstance(p, InnerOptimizer):
            raise TypeError(
                f"chain() takes built optimizers and transformations (metaddp.inner.sgd(0.1), "
                f"metaddp.inner.clip_by_global_norm(1.0)), got {type(p).__name__}"
            )
    if parts[-1].transforms:
        raise ValueError(
            "chain() ends with a gradient transformation, whose output is a gradient, not a "
            "step: end it with an optimizer, chain(clip_by_global_norm(1.0), sgd(0.1))"
        )

    def init(params: Params) -> State:
        return tuple(p.init(params) for p in parts)

    def update(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        if not isinstance(state, tuple) or len(state) != len(parts):
            raise TypeError("chain: expected the state returned by its init()")
        new = []
        for p, s in zip(parts, state, strict=True):
            grads, s = p.update(grads, s, params)
            new.append(s)
        return grads, tuple(new)

    learned = {id(t): t for p in parts for t in learned_rates(p)}
    if learned:
        _LEARNED[update] = tuple(learned.values())
    return InnerOptimizer(init, update)
