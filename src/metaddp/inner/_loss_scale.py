"""Dynamic loss scaling of the inner steps, for float16 forward passes.

Under ``torch.autocast(dtype=torch.float16)`` the backward of a forward pass runs in float16,
whose smallest normal number is about 6e-5 (subnormals reach 6e-8): small gradients of the
activations round to zero. Each inner step then differentiates ``scale * loss`` instead and
divides the gradients by ``scale`` on the graph, so the second-order terms are exact through
it; ``scale`` is a power of two, so both steps are exact in binary floating point (only the
exponent changes) and where nothing under- or overflows the step is the unscaled one, bit
for bit.

A step whose reduced gradient overflowed is skipped (:class:`LossScale`), decided on the
device (:func:`metaddp.functional.inner_step`'s ``scale=``). Its discarded gradient holds Inf
or NaN, and the outer backward still passes zeros through the graph that made them: ``0 *
inf`` is NaN, which would reach the meta-gradient. So the tensors a scaled step's forward
reads are *watched* (:meth:`TaskScale.watch`): an identity whose backward gives zeros,
through ``torch.where``, where the step was skipped. A skipped step then contributes exactly
nothing to the meta-gradient, which is that of the inner loop without the step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def _power_of_two(value: float, name: str) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0 and math.frexp(value)[0] == 0.5):
        raise ValueError(
            f"{name} must be a positive power of two (it then scales the gradients exactly), "
            f"got {value!r}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling of every inner step, for ``autocast=torch.float16``.

    ``MAML(model, autocast=torch.float16)`` uses ``LossScale()``; ``loss_scale=None`` (or
    ``False``) turns it off, and a ``LossScale`` given without float16 is harmless (the
    gradients are the same to rounding). Each inner step differentiates ``scale * loss`` and
    divides the gradients by ``scale`` (a power of two: exact). A step whose reduced gradient
    is not finite (the float16 backward overflowed) is skipped: the fast weights and the
    optimizer's slots stay as they were, and the scale is multiplied by ``backoff`` for the
    task's next inner step. The meta-gradient is then that of the inner loop without the
    skipped step.

    The scale starts at ``init`` for every task and never grows within one: a scale carried
    from task to task would depend on which tasks a rank ran before, so the meta-gradient
    would change with the number of processes. So ``init`` must be small enough that the
    first step rarely overflows, and large enough to lift the smallest gradients out of
    float16's underflow: the default, ``2**10``, is below ``torch.amp.GradScaler``'s
    ``2**16``, which overflowed the first inner step of every task of the sinusoid MLP
    (gradients of order 1 to 10; its largest safe scale there was ``2**15``), while ``2**10``
    still brings the error of a loss of order ``1e-6`` from 8e-2 to 5e-4
    (``benchmarks/fp16_error.py``).

    The outer backward, ``meta_loss(...).backward()``, is not scaled here: scale it as any
    float16 training does (``torch.amp.GradScaler``), by at least ``init``, for the
    second-order terms, which pass through the inner steps' float16 graphs divided by the
    inner scale.

    An optimizer's step count (a Python number, which Adam's bias correction reads) still
    advances on a skipped step: with plain SGD, and SGD with momentum without dampening, the
    result is exactly the loop without the step; with Adam-like optimizers the later bias
    corrections count it.

    Args:
        init: the first inner step's scale, a power of two.
        backoff: what an overflow multiplies the scale by, a power of two below 1.
    """

    init: float = 2.0**10
    backoff: float = 0.5

    def __post_init__(self) -> None:
        init = _power_of_two(self.init, "LossScale(init=)")
        if not 2.0**-126 <= init <= 2.0**127:
            raise ValueError(f"LossScale(init=) must lie in [2**-126, 2**127], got {init!r}")
        backoff = _power_of_two(self.backoff, "LossScale(backoff=)")
        if backoff >= 1:
            raise ValueError(f"LossScale(backoff=) must be below 1, got {backoff!r}")
        object.__setattr__(self, "init", init)
        object.__setattr__(self, "backoff", backoff)

    def start(self, like: Tensor) -> TaskScale:
        """The running scale of one task's inner loop, at :attr:`init`, on ``like``'s device
        (float32, or ``like``'s dtype if wider: a float16 scale of ``2**16`` would be Inf)."""
        dtype = torch.promote_types(like.dtype, torch.float32)
        return TaskScale(torch.full((), self.init, dtype=dtype, device=like.device), self.backoff)


def resolve_loss_scale(value: object, autocast: torch.dtype | None) -> LossScale | None:
    """The loss scale an algorithm uses: ``LossScale()`` by default under float16 autocast,
    none by default otherwise; ``None`` or ``False`` turns it off."""
    if value is True or value is DEFAULT:
        return LossScale() if autocast == torch.float16 or value is True else None
    if value is None or value is False:
        return None
    if isinstance(value, LossScale):
        return value
    raise TypeError(
        "loss_scale must be a metaddp.inner.LossScale, None or False (off), got "
        f"{type(value).__name__}: e.g. loss_scale=metaddp.inner.LossScale(init=2.0**10)"
    )


class _Default:
    def __repr__(self) -> str:
        return "LossScale() under autocast=torch.float16, else None"


DEFAULT: Any = _Default()
"""``loss_scale``'s default: on under float16 autocast, off otherwise."""


class _Verdict:
    """Whether one scaled step was kept: a bool tensor set once the step's gradient is known
    (``None`` before, when nothing is gated)."""

    __slots__ = ("kept",)

    def __init__(self) -> None:
        self.kept: Tensor | None = None


class _Gate(torch.autograd.Function):
    """The identity on the tensors a scaled step's forward reads; its backward zeros their
    gradients where the step was skipped (module docstring)."""

    @staticmethod
    def forward(ctx: Any, verdict: _Verdict, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.verdict = verdict
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        kept = ctx.verdict.kept
        if kept is None:
            return (None, *grads)
        return (None, *(torch.where(kept, g, g.new_zeros(())) for g in grads))


class TaskScale:
    """The running scale of one task's inner loop (:meth:`LossScale.start`).

    A scaled step reads its forward's inputs through :meth:`watch`;
    :func:`metaddp.functional.inner_step` with ``scale=`` differentiates ``value * loss`` by the
    watched fast weights, unscales, skips the step where the gradient is not finite, and calls
    :meth:`settle`.
    """

    def __init__(self, value: Tensor, backoff: float) -> None:
        self.value = value
        """The current scale, a 0-dim tensor on the device (never read on the host here)."""
        self.backoff = backoff
        self._verdict: _Verdict | None = None
        self._watched: dict[int, Tensor] = {}

    def watch(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` as the next step's forward must read them: those that require grad
        pass through an identity that a skipped step closes in the backward. Watch every
        tensor the support loss reads that needs a gradient (the fast weights, other trained
        parameters, inputs computed from parameters); the fast weights must be watched."""
        if self._verdict is None:
            self._verdict = _Verdict()
        names = [k for k, t in tensors.items() if t.requires_grad]
        out = dict(tensors)
        if not names:
            return out
        gated = _Gate.apply(self._verdict, *(tensors[k] for k in names))
        for k, g in zip(names, gated, strict=True):
            self._watched[id(tensors[k])] = g
            out[k] = g
        return out

    def watched(self, fast: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The watched copies of ``fast`` (what the step differentiates by)."""
        missing = [k for k, t in fast.items() if t.requires_grad and id(t) not in self._watched]
        if missing:
            raise ValueError(
                f"a loss-scaled inner step differentiates by the watched fast weights, but "
                f"{', '.join(map(repr, missing[:3]))} were not watched: compute the loss from "
                "scale.watch(fast)"
            )
        return {k: self._watched.get(id(t), t) for k, t in fast.items()}

    def settle(self, finite: Tensor) -> None:
        """End the step: ``finite`` (a 0-dim bool tensor) says whether it was kept; the
        scale is multiplied by :attr:`backoff` where it was not."""
        if self._verdict is not None:
            self._verdict.kept = finite
        self._verdict = None
        self._watched = {}
        with torch.no_grad():
            self.value = torch.where(finite, self.value, self.value * self.backoff)

    def __repr__(self) -> str:
        return f"TaskScale(backoff={self.backoff})"
