"""Differentiable inner optimizers: pure ``init`` / ``update`` functions over parameter dicts.

As in optax, state is explicit and returned, never hidden on an object, and nothing updates
in place, so every step stays on the autograd graph and second-order meta-gradients flow
through the whole inner trajectory (and through learnable hyper-parameters).

A learning rate may be a Python float, a tensor (a scalar, or a tensor with the parameter's
shape), or a mapping from parameter name to one of those. Tensors that require grad (for
example the ``nn.Parameter`` s of :class:`metaddp.inner.LearnedLR`) are trained by the outer
optimizer: the inner updates are differentiable in them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._foreach import added, scaled

Params = dict[str, Tensor]
State = Any
LearningRate = float | Tensor | Mapping[str, Tensor | float]


class InnerOptimizer(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params) -> (updates, state)``."""

    init: Callable[[Params], State]
    update: Callable[[Params, State, Params], tuple[Params, State]]

    @property
    def transforms(self) -> bool:
        """Whether ``update`` returns new gradients rather than a step (a transformation,
        such as :func:`metaddp.inner.clip_by_global_norm`, meant to come first in
        :func:`metaddp.inner.chain`): applied as a step, it would climb the loss."""
        return _known(self.update, _TRANSFORMS)

    @property
    def entrywise(self) -> bool:
        """Whether ``update`` treats every entry on its own, with rates that are numbers or
        one number per tensor (learned or not): on each rank's rows of sharded weights it
        gives the rows of the whole update. True only of this module's own updates."""
        return _known(self.update, _ENTRYWISE, _ROWWISE)

    @property
    def rowwise(self) -> bool:
        """Whether ``update`` treats every entry on its own and reads no tensor but its
        arguments, so that on weights stacked along a leading task dimension it gives every
        task's own update, bit for bit (a stacked meta-batch then applies it without
        ``torch.vmap``). True only of this module's own updates with Python-number rates:
        any other function, a wrapper of one of them included, may look across entries."""
        return _known(self.update, _ROWWISE)


# The update functions known to be rowwise, entrywise (or rowwise) and transformations, as
# InnerOptimizer's properties say; and the tensors that require grad which an update function
# reads as its learning rates. All weakly held: they die with their optimizer.
def _known(update: Callable[..., Any], *sets: weakref.WeakSet[Callable[..., Any]]) -> bool:
    """Whether ``update`` is in one of ``sets`` (a callable that cannot be weakly referenced
    is in none)."""
    try:
        return any(update in known for known in sets)
    except TypeError:
        return False


_ROWWISE: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
_ENTRYWISE: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
_TRANSFORMS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
_LEARNED: weakref.WeakKeyDictionary[Callable[..., Any], tuple[Tensor, ...]] = (
    weakref.WeakKeyDictionary()
)


def _optimizer(
    init: Callable[[Params], State], update: Callable[..., Any], lr: LearningRate
) -> InnerOptimizer:
    """An :class:`InnerOptimizer` whose ``update`` is rowwise when ``lr`` is a Python number
    (or a dict of them); a tensor rate may be learned or per entry."""
    numbers = list(lr.values()) if isinstance(lr, Mapping) else [lr]
    if all(isinstance(v, int | float) for v in numbers):
        _ROWWISE.add(update)
    if all(isinstance(v, int | float) or (isinstance(v, Tensor) and v.dim() == 0) for v in numbers):
        _ENTRYWISE.add(update)
    learned = {id(v): v for v in numbers if isinstance(v, Tensor) and v.requires_grad}
    if learned:
        _LEARNED[update] = tuple(learned.values())
    return InnerOptimizer(init, update)


def learned_rates(optimizer: InnerOptimizer) -> tuple[Tensor, ...]:
    """The learning rates that require grad (trained by the outer loop) which ``optimizer``
    reads: those given to :func:`sgd` or :func:`adam` as tensors. Empty for any other
    optimizer, whose update may read anything."""
    try:
        return _LEARNED.get(optimizer.update, ())
    except TypeError:  # a callable that cannot be weakly referenced is not one of them
        return ()


def hyperparameters(optimizer: InnerOptimizer) -> tuple[Any, ...]:
    """The plain values an optimizer's ``update`` reads: the Python numbers, strings and
    flags its closure holds (rates, betas, eps, weight decay, momentum), by name, through
    the optimizers and functions it closes over (a chain's). Ranks compare them with the
    algorithm's settings, so a rate that differs by rank is an error, not a different
    meta-gradient. Tensors are left out: learned rates are parameters, compared as such."""
    seen: set[int] = set()

    def plain(v: Any) -> Any:
        if v is None or isinstance(v, bool | int | float | str):
            return v
        if isinstance(v, InnerOptimizer):
            return walk(v.update)
        if isinstance(v, Mapping):
            kept = tuple((str(k), plain(x)) for k, x in v.items())
            return tuple((k, x) for k, x in kept if x is not None) or None
        if isinstance(v, tuple | list):
            kept = tuple(plain(x) for x in v)
            return kept if any(x is not None for x in kept) else None
        if callable(v):
            return walk(v)
        return None

    def walk(fn: Any) -> tuple[Any, ...] | None:
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
        if code is None or not cells or id(fn) in seen:
            return None
        seen.add(id(fn))
        found = []
        for name, cell in zip(code.co_freevars, cells, strict=True):
            try:
                value = plain(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                continue
            if value is not None:
                found.append((name, value))
        return tuple(found) or None

    return walk(optimizer.update) or ()


class SlotState(NamedTuple):
    """State of an optimizer with per-parameter slots: a step count and named slot dicts.

    ``shapes`` records the parameter set the state was made for, so that a state handed
    to the wrong parameters is an error rather than a silent broadcast.
    """

    # The field shadows tuple.count on purpose: it is the state's public name.
    count: int  # type: ignore[assignment]
    slots: tuple[Params, ...]
    shapes: tuple[tuple[str, tuple[int, ...]], ...]


def apply_updates(params: Mapping[str, Tensor], updates: Mapping[str, Tensor]) -> Params:
    """``params + updates``, out of place (names without an update are kept as they are).

    One kernel for the whole set (:func:`metaddp.inner._foreach.added`), the same values."""
    names = [k for k in params if k in updates]
    out = dict(params)
    out.update(
        zip(names, added([params[k] for k in names], [updates[k] for k in names]), strict=True)
    )
    return out


def lr_for(lr: LearningRate, name: str, like: Tensor | None = None) -> float | Tensor:
    """The learning rate of parameter ``name``: a scalar, or its entry of a per-parameter dict.

    Args:
        lr: a float, a tensor, or a mapping from parameter name to either.
        name: the parameter's qualified name.
        like: the parameter (or its gradient); a tensor learning rate must be a scalar or
            have exactly this shape (anything else would broadcast into a wrong update).

    Returns:
        The learning rate to multiply ``name``'s update by.
    """
    if isinstance(lr, Mapping):
        if name not in lr:
            raise KeyError(
                f"the learning-rate dict has no entry for parameter {name!r} "
                f"(it has {', '.join(map(repr, list(lr)[:5]))}{', ...' if len(lr) > 5 else ''})"
            )
        lr = lr[name]
    if isinstance(lr, Tensor) and like is not None and lr.dim() > 0 and lr.shape != like.shape:
        raise ValueError(
            f"the learning rate of parameter {name!r} has shape {tuple(lr.shape)}, but the "
            f"parameter has shape {tuple(like.shape)}: use a scalar (one rate per tensor) or a "
            "tensor of the parameter's own shape (one rate per entry)"
        )
    return lr


class Shapes(tuple):
    """``((name, shape), ...)``: one value to tree utilities (``torch.utils._pytree`` treats a
    tuple subclass as a leaf), so flattening a state visits its tensors, not every int of
    every shape. Compares equal to the plain tuple."""

    __slots__ = ()


def _shapes(params: Mapping[str, Tensor]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return Shapes((k, tuple(p.shape)) for k, p in params.items())


def check_state(state: SlotState, grads: Mapping[str, Tensor], who: str) -> None:
    """Raise if ``state`` was initialised for a different parameter set than ``grads``."""
    if not isinstance(state, SlotState):
        raise TypeError(
            f"{who}: expected the state returned by its init(), got {type(state).__name__}"
        )
    got = _shapes(grads)
    if dict(got) != dict(state.shapes):
        mine, theirs = dict(state.shapes), dict(got)
        diff = sorted(set(mine) ^ set(theirs)) + sorted(
            k for k in mine if k in theirs and mine[k] != theirs[k]
        )
        raise ValueError(
            f"{who}: the optimizer state belongs to another parameter set (it was initialised "
            f"for {len(mine)} tensors, the gradients cover {len(theirs)}; first mismatches: "
            f"{', '.join(map(repr, diff[:5]))}). Call init() on the parameters you update."
        )


def decayed(grads: Params, params: Params, weight_decay: float) -> Params:
    """``g + weight_decay * p`` for every gradient (L2 regularisation folded into the
    gradient, as ``torch.optim``'s ``weight_decay``); the gradients themselves when it is 0."""
    if weight_decay == 0:
        return grads
    return {k: g + weight_decay * params[k] for k, g in grads.items()}


def nonnegative(value: float, name: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    nesterov: bool = False,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
) -> InnerOptimizer:
    """Gradient descent, optionally with (Nesterov) momentum, as ``torch.optim.SGD`` defines it.

    With momentum ``mu``: ``b_1 = g_1``, ``b_t = mu * b_{t-1} + (1 - dampening) * g_t``; the
    step is ``-lr * b_t``, or ``-lr * (g_t + mu * b_t)`` with ``nesterov`` (Sutskever et al.,
    ICML 2013, in PyTorch's formulation).

    Args:
        lr: step size; a float, a (learnable) tensor, or a per-parameter mapping.
        momentum: momentum factor ``mu`` (0 for plain gradient descent).
        nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        dampening: dampening of the momentum buffer's new gradient term.
        weight_decay: L2 penalty ``wd``: the gradient becomes ``g + wd * p`` first.

    Returns:
        An :class:`InnerOptimizer`.
    """
    if momentum < 0:
        raise ValueError(f"momentum must be >= 0, got {momentum}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum needs momentum > 0 and dampening == 0")
    weight_decay = nonnegative(weight_decay, "weight_decay")

    if momentum == 0:

        def init_plain(params: Params) -> State:
            return SlotState(0, (), _shapes(params))

        def update_plain(grads: Params, state: State, params: Params) -> tuple[Params, State]:
            check_state(state, grads, "sgd")
            grads = decayed(grads, params, weight_decay)
            rates = [lr_for(lr, k, g) for k, g in grads.items()]
            new = SlotState(state.count + 1, (), state.shapes)
            numbers = [-float(r) for r in rates if isinstance(r, int | float)]
            if len(numbers) == len(rates):  # one kernel for all
                return dict(zip(grads, scaled(list(grads.values()), numbers), strict=True)), new
            return {k: -r * g for (k, g), r in zip(grads.items(), rates, strict=True)}, new

        return _optimizer(init_plain, update_plain, lr)

    def init(params: Params) -> State:
        return SlotState(0, ({k: torch.zeros_like(p) for k, p in params.items()},), _shapes(params))

    def update(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        check_state(state, grads, "sgd")
        grads = decayed(grads, params, weight_decay)
        (bufs,) = state.slots
        new_bufs, out = {}, {}
        for k, g in grads.items():
            b = g if state.count == 0 else momentum * bufs[k] + (1 - dampening) * g
            new_bufs[k] = b
            out[k] = -lr_for(lr, k, g) * (g + momentum * b if nesterov else b)
        return out, SlotState(state.count + 1, (new_bufs,), state.shapes)

    return _optimizer(init, update, lr)


def adam(
    lr: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 1e-16,
    weight_decay: float = 0.0,
    decoupled: bool = False,
) -> InnerOptimizer:
    """Adam (Kingma & Ba, ICLR 2015, arXiv:1412.6980), differentiable to second order.

    ``m_t = b1 m + (1-b1) g``, ``v_t = b2 v + (1-b2) g^2``, and the step is
    ``-lr * m_hat / (sqrt(v_hat + eps_root) + eps)`` with ``m_hat = m_t / (1 - b1^t)``,
    ``v_hat = v_t / (1 - b2^t)``.

    Epsilon placement: ``eps`` outside the square root as ``torch.optim.Adam`` does, and
    ``eps_root`` *inside* it, as optax's ``eps_root``. The derivative of ``sqrt(v)`` is
    infinite at ``v = 0``, so with ``eps_root = 0`` an entry whose gradient is exactly zero
    (a dead ReLU, an unused input) makes the second-order meta-gradient NaN (``inf * 0``).
    Any ``eps_root > 0`` keeps it finite; the default ``1e-16`` changes the first-order step
    by a relative ``~eps_root / v_hat``, invisible unless gradients are below ~1e-6. Set
    ``eps_root=0`` to reproduce ``torch.optim.Adam`` bit for bit in the first order.

    Args:
        lr: step size; a float, a (learnable) tensor, or a per-parameter mapping.
        b1, b2: decay rates of the first and second moments.
        eps: added to the denominator, outside the square root.
        eps_root: added to ``v_hat`` inside the square root (see above).
        weight_decay: ``wd``. Coupled (``torch.optim.Adam``): the gradient becomes
            ``g + wd * p`` before the moments. Decoupled (:func:`adamw`): the step gains
            ``-lr * wd * p``, outside the moments.
        decoupled: decouple the weight decay from the gradient (AdamW).

    Returns:
        An :class:`InnerOptimizer`.
    """
    weight_decay = nonnegative(weight_decay, "weight_decay")
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"Adam needs 0 <= b1, b2 < 1, got b1={b1}, b2={b2}")
    if eps < 0 or eps_root < 0:
        raise ValueError(f"eps and eps_root must be >= 0, got {eps} and {eps_root}")

    def init(params: Params) -> State:
        zeros = {k: torch.zeros_like(p) for k, p in params.items()}
        return SlotState(0, (zeros, dict(zeros)), _shapes(params))

    def update(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        check_state(state, grads, "adamw" if decoupled else "adam")
        if not decoupled:
            grads = decayed(grads, params, weight_decay)
        mu, nu = state.slots
        t = state.count + 1
        c1, c2 = 1 - b1**t, 1 - b2**t
        new_mu, new_nu, out = {}, {}, {}
        for k, g in grads.items():
            m = b1 * mu[k] + (1 - b1) * g
            v = b2 * nu[k] + (1 - b2) * g * g
            new_mu[k], new_nu[k] = m, v
            step = (m / c1) / (torch.sqrt(v / c2 + eps_root) + eps)
            if decoupled and weight_decay:
                step = step + weight_decay * params[k]
            out[k] = -lr_for(lr, k, g) * step
        return out, SlotState(t, (new_mu, new_nu), state.shapes)

    return _optimizer(init, update, lr)


def adamw(
    lr: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 1e-16,
    weight_decay: float = 0.01,
) -> InnerOptimizer:
    """AdamW (Loshchilov & Hutter, ICLR 2019, arXiv:1711.05101): :func:`adam` with the weight
    decay decoupled from the gradient, as ``torch.optim.AdamW``: the step is
    ``-lr * (m_hat / (sqrt(v_hat + eps_root) + eps) + weight_decay * p)``. Same arguments as
    :func:`adam`; ``weight_decay`` defaults to torch's 0.01."""
    return adam(lr, b1, b2, eps, eps_root, weight_decay=weight_decay, decoupled=True)


def per_step_sgd(rates: Mapping[str, Tensor]) -> InnerOptimizer:
    """Gradient descent whose rate differs at every inner step: ``rates[name][t]`` at step
    ``t`` (a tensor ``[steps]``, one rate per step, or ``[steps, *shape]``, one per entry).
    MAML++'s per-layer, per-step learned rates (Antoniou et al. 2019, "LSLR"): pass
    ``nn.Parameter`` s and they are trained. A step beyond the last uses the last rates.
    """
    rates = dict(rates)
    if not rates or any(not isinstance(r, Tensor) or r.dim() < 1 for r in rates.values()):
        raise ValueError("per_step_sgd needs a tensor of per-step rates [steps, ...] per name")
    steps = {r.shape[0] for r in rates.values()}
    if len(steps) != 1:
        raise ValueError(f"every parameter needs the same number of per-step rates, got {steps}")
    (last,) = steps

    def init(params: Params) -> State:
        missing = [k for k in params if k not in rates]
        if missing:
            raise KeyError(f"per_step_sgd has no rates for {', '.join(map(repr, missing[:5]))}")
        return SlotState(0, (), _shapes(params))

    def update(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        check_state(state, grads, "per_step_sgd")
        t = min(state.count, last - 1)
        out = {k: -lr_for(rates[k][t], k, g) * g for k, g in grads.items()}
        return out, SlotState(state.count + 1, (), state.shapes)

    learned = tuple(r for r in rates.values() if r.requires_grad)
    if learned:
        _LEARNED[update] = learned
    if all(r.dim() == 1 for r in rates.values()):  # one rate per tensor at each step
        _ENTRYWISE.add(update)
    return InnerOptimizer(init, update)
