"""Inner optimizers that divide each entry's step by its gradients' running magnitude:
RMSprop and Adagrad, as ``torch.optim`` defines them, differentiable to any order.
"""

from __future__ import annotations

import torch

from ._optimizers import (
    InnerOptimizer,
    LearningRate,
    Params,
    SlotState,
    State,
    _optimizer,
    _shapes,
    check_state,
    decayed,
    lr_for,
    nonnegative,
)


def rmsprop(
    lr: LearningRate,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    eps_root: float = 1e-16,
) -> InnerOptimizer:
    """RMSprop (Tieleman & Hinton 2012), in ``torch.optim.RMSprop``'s form.

    ``s_t = alpha s + (1 - alpha) g^2``; the denominator is ``sqrt(s_t + eps_root) + eps``, or
    with ``centered`` ``sqrt(s_t - a_t^2 + eps_root) + eps`` where
    ``a_t = alpha a + (1 - alpha) g``. The step is ``-lr * g / denominator``; with
    ``momentum`` ``mu`` it is ``-lr * b_t``, ``b_t = mu b + g / denominator``.

    Args:
        lr: step size; a float, a (learnable) tensor, or a per-parameter mapping.
        alpha: decay of the squared-gradient average.
        eps: added to the denominator, outside the square root.
        weight_decay: L2 penalty: the gradient becomes ``g + weight_decay * p`` first.
        momentum: momentum factor (0: none).
        centered: divide by the gradients' estimated variance instead of their second moment.
        eps_root: added inside the square root, as :func:`metaddp.inner.adam`'s (``0``:
            ``torch.optim`` bit for bit in the first order).
    """
    if not 0 <= alpha < 1:
        raise ValueError(f"RMSprop needs 0 <= alpha < 1, got {alpha}")
    eps, eps_root = nonnegative(eps, "eps"), nonnegative(eps_root, "eps_root")
    weight_decay = nonnegative(weight_decay, "weight_decay")
    momentum = nonnegative(momentum, "momentum")

    def init(params: Params) -> State:
        zeros = {k: torch.zeros_like(p) for k, p in params.items()}
        slots = [zeros]  # the squared-gradient average; then the mean and momentum if used
        if centered:
            slots.append(dict(zeros))
        if momentum:
            slots.append(dict(zeros))
        return SlotState(0, tuple(slots), _shapes(params))

    def update(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        check_state(state, grads, "rmsprop")
        grads = decayed(grads, params, weight_decay)
        slots = list(state.slots)
        sq = slots.pop(0)
        avg = slots.pop(0) if centered else None
        buf = slots.pop(0) if momentum else None
        new_sq, new_avg, new_buf, out = {}, {}, {}, {}
        for k, g in grads.items():
            s = alpha * sq[k] + (1 - alpha) * g * g
            new_sq[k] = s
            if avg is not None:
                a = alpha * avg[k] + (1 - alpha) * g
                new_avg[k] = a
                s = s - a * a
            step = g / (torch.sqrt(s + eps_root) + eps)
            if buf is not None:
                step = momentum * buf[k] + step
                new_buf[k] = step
            out[k] = -lr_for(lr, k, g) * step
        kept = [new_sq] + ([new_avg] if centered else []) + ([new_buf] if momentum else [])
        return out, SlotState(state.count + 1, tuple(kept), state.shapes)

    return _optimizer(init, update, lr)


def adagrad(
    lr: LearningRate,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    eps_root: float = 1e-16,
) -> InnerOptimizer:
    """Adagrad (Duchi, Hazan & Singer, JMLR 2011), in ``torch.optim.Adagrad``'s form.

    ``s_t = s + g^2`` (from ``initial_accumulator_value``); the step is
    ``-lr_t * g / (sqrt(s_t + eps_root) + eps)`` with ``lr_t = lr / (1 + (t - 1) lr_decay)``.

    Args:
        lr: step size; a float, a (learnable) tensor, or a per-parameter mapping.
        lr_decay: the step size's decay per step.
        weight_decay: L2 penalty: the gradient becomes ``g + weight_decay * p`` first.
        initial_accumulator_value: the squared-gradient sum's starting value.
        eps: added to the denominator, outside the square root.
        eps_root: added inside the square root, as :func:`metaddp.inner.adam`'s (``0``:
            ``torch.optim`` bit for bit in the first order).
    """
    lr_decay, eps = nonnegative(lr_decay, "lr_decay"), nonnegative(eps, "eps")
    weight_decay = nonnegative(weight_decay, "weight_decay")
    start = nonnegative(initial_accumulator_value, "initial_accumulator_value")
    eps_root = nonnegative(eps_root, "eps_root")

    def init(params: Params) -> State:
        return SlotState(
            0, ({k: torch.full_like(p, start) for k, p in params.items()},), _shapes(params)
        )

    def update(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        check_state(state, grads, "adagrad")
        grads = decayed(grads, params, weight_decay)
        (acc,) = state.slots
        t = state.count + 1
        decay = 1 + (t - 1) * lr_decay
        new_acc, out = {}, {}
        for k, g in grads.items():
            s = acc[k] + g * g
            new_acc[k] = s
            out[k] = -(lr_for(lr, k, g) / decay) * g / (torch.sqrt(s + eps_root) + eps)
        return out, SlotState(t, (new_acc,), state.shapes)

    return _optimizer(init, update, lr)
