"""Functional fast weights: run any ``nn.Module`` on weights given as a dict.

Nothing here writes into a module's ``_parameters``: ``torch.func.functional_call``
swaps the tensors in for the duration of one call and restores the originals.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import os
import random
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ._binding import sharding_of
from ._data import KEYED
from .forward import needs_routes, routes

Params = dict[str, Tensor]


def params_of(module: nn.Module) -> Params:
    """The module's trained parameters by qualified name (the leaves the outer optimizer
    trains). Frozen ones (``requires_grad=False``) are left out: :func:`call` reads them from
    the module, so inner loops hold them fixed too."""
    params: Params = {k: p for k, p in module.named_parameters() if p.requires_grad}
    sharded = sharding_of(module)
    if sharded is not None and sharded.adopted:  # FSDP2's DTensors: their rows, differentiably
        return sharded.rows_of(params)
    return params


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
    subset (ANIL adapts only the head). A name in both ``params`` and ``buffers`` (a buffer
    that stands in for a fast weight, as CAVIA's context) takes the fast weight.
    """
    weights: dict[str, Tensor] = dict(buffers) if buffers is not None else {}
    weights.update(params)
    full = sharding_of(module)
    if full is not None:  # sharded meta-parameters: gathered for this forward
        weights = full(module, weights)
    walked = _walk(module)
    with routes(module, walked.routes):
        return torch.func.functional_call(
            module, weights, args, kwargs, tie_weights=walked.ties, strict=False
        )


@dataclasses.dataclass(frozen=True)
class _Walked:
    """What a forward learns from a walk of ``module``'s tree: whether the routing may be
    needed (:func:`metaddp.forward.needs_routes`) and whether ``functional_call`` must look
    for tied weights (``ties``: everywhere but where a walk found none)."""

    module: nn.Module  # held, so that no other module takes its id while it is remembered
    routes: bool
    ties: bool


_WALKED: contextvars.ContextVar[dict[int, _Walked] | None] = contextvars.ContextVar(
    "metaddp_walked", default=None
)


@contextlib.contextmanager
def walked_once() -> Iterator[None]:
    """Inside (one meta-loss, one adaptation), each module's tree is walked at its first
    forward only (:class:`_Walked`): its modules and parameters do not change while the
    block runs, and each forward would otherwise walk it three times (the routing's check
    and ``functional_call``'s search for tied weights). A forward outside walks as ever.
    Nested blocks share the outermost's."""
    if _WALKED.get() is not None:
        yield
        return
    token = _WALKED.set({})
    try:
        yield
    finally:
        _WALKED.reset(token)


def _walk(module: nn.Module) -> _Walked:
    walked = _WALKED.get()
    if walked is None:
        return _Walked(module, needs_routes(module), True)
    seen = walked.get(id(module))
    if seen is None or seen.module is not module:
        seen = walked[id(module)] = _Walked(module, needs_routes(module), ties_weights(module))
    return seen


def ties_weights(module: nn.Module) -> bool:
    """Whether ``module`` holds one tensor under two names (tied weights: an embedding and
    the output layer that shares it), which ``torch.func.functional_call(...,
    tie_weights=True)`` then replaces together. Without any, ``tie_weights=False`` makes the
    same call without its walks of the module."""
    seen: set[int] = set()
    for _, t in itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    ):
        if id(t) in seen:
            return True
        seen.add(id(t))
    return False


def whole(module: nn.Module, params: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """``params`` (the module's weights, or fast weights made from them) as whole tensors:
    where the module's meta-parameters are sharded, each rank's rows gathered, by a gather
    whose adjoint sums over the ranks that hold them; elsewhere ``params`` as they are. For
    an algorithm that reads its weights outside a forward (Reptile's displacement)."""
    sharding = sharding_of(module)
    return params if sharding is None else sharding.whole(params)


def rows_like(
    module: nn.Module,
    tensors: Mapping[str, Tensor],
    weights: Callable[[], Mapping[str, Tensor]],
) -> dict[str, Tensor]:
    """``tensors`` (by weight name, read entry by entry with the weights: learned rates) as
    ``weights()`` hold them: where the module's meta-parameters are sharded and the weights
    are a rank's rows, each whole-shaped tensor cut to the same rows; elsewhere as they are
    (and ``weights`` is not called)."""
    sharding = sharding_of(module)
    if sharding is None:
        return dict(tensors)
    held = weights()
    return {k: sharding.as_rows(t, held[k]) if k in held else t for k, t in tensors.items()}


def draws_when_called(m: nn.Module) -> bool:
    """Whether the layer ``m`` itself draws random numbers when called now: dropout with
    ``p > 0`` or RReLU, in training mode."""
    return m.training and (
        (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0) or isinstance(m, nn.RReLU)
    )


def random_layers(module: nn.Module) -> list[str]:
    """The layers that draw random numbers when called now (:func:`draws_when_called`). (A
    random call inside a ``forward`` is not seen.)"""
    return [
        f"{name or 'the model'} ({type(m).__name__})"
        for name, m in module.named_modules()
        if draws_when_called(m)
    ]


def generator_states() -> list[bytes]:
    """The states of the default generators a forward draws from: the CPU's and, once CUDA
    is in use, the current device's. Host copies of a few kilobytes, compared as bytes: no
    device wait, no dispatched operation."""
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_initialized():  # a process that has used CUDA (so has it): no query
        states.append(torch.cuda.get_rng_state())
    return [state.numpy().tobytes() for state in states]


@contextlib.contextmanager
def refusing_draws(split: bool) -> Iterator[None]:
    """Where the work is ``split`` over processes, raise if the block drew random numbers
    from the default generators (``torch.randn`` in a forward, a loss that samples): each
    process draws from its own, so the numbers, and the meta-gradient, would change with the
    number of processes and the split. Dropout in metaddp's own forwards draws no number from
    them (:mod:`metaddp.forward`); layers whose draws cannot be keyed are refused before they
    run (:func:`metaddp.forward.unkeyable_layers`); this sees the rest of torch's default
    generators' draws (:class:`OtherDraws` sees others, on checked steps)."""
    if not split:
        yield
        return
    before = generator_states()
    yield
    if before != generator_states():
        raise ValueError(
            "the model or the loss function drew random numbers (torch.randn in a forward, a "
            "sampling loss, dropout in a forward metaddp does not run) from each process's own "
            "generator: under MetaDDP the numbers, and so the meta-gradient, would change "
            "with the number of processes and the split of the samples. metaddp keys dropout "
            "in the forwards of meta_loss and adapt (docs/guarantees.md); remove other draws, "
            "or call model.eval(); learner.local() runs such a model on one process"
        )


OTHER_DRAWS = (
    "the model or the loss function drew random numbers from a generator of its own "
    "(torch.randn(..., generator=g) in a forward), numpy's (np.random.randn) or Python's "
    "(random.gauss): every process draws its own, so the numbers, and the meta-gradient, "
    "would change with the number of processes and the split of the samples. metaddp keys "
    "dropout in the forwards of meta_loss and adapt (docs/guarantees.md); draw other noise "
    "with the tasks (in make_task: then it is split with the samples), or remove it; "
    "learner.local() runs such a model on one process"
)


def _host_states() -> list[Any]:
    """numpy's global generator's state and Python's, compared by value."""
    _, keys, *rest = cast(tuple[str, np.ndarray, Any, Any, Any], np.random.get_state())
    return [keys.tobytes(), tuple(rest), random.getstate()]


class OtherDraws(TorchFunctionMode):
    """After the block, ``drew`` says whether it drew what :func:`refusing_draws` does not
    see: a torch call given a generator (``generator=g``) other than one keyed by global
    indices (:func:`metaddp.generator_for`: a bilevel minibatch's), or a draw from numpy's
    global generator or Python's, whose states are compared. It sees every torch call made in
    Python, and reads numpy's state in a fraction of a millisecond: a cost kept to the
    steps that are checked."""

    def __enter__(self) -> OtherDraws:
        self.drew, self._host = False, _host_states()
        return cast(OtherDraws, super().__enter__())

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.drew = self.drew or self._host != _host_states()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        g = kwargs.get("generator")
        if g is not None and g not in KEYED:
            self.drew = True
        return func(*args, **kwargs)


def drawn_at(error: BaseException) -> str:
    """What drew, for ``torch.vmap``'s refusal of a random operation (which names none): the
    line of the innermost frame outside torch and metaddp (the model's or the loss
    function's code), else the draws it may be."""
    ours = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not frame.filename.startswith(ours) and frame.line:
            return f"{frame.line}, {os.path.basename(frame.filename)}:{frame.lineno}"
    return "dropout, torch.rand*, ..."


def refuse_data_parallel(model: nn.Module) -> None:
    """Refuse a model with ``DistributedDataParallel`` (or ``DataParallel``) inside: its hooks
    reduce gradients on their own, by a mean over ranks that autograd cannot see."""
    from torch.nn.parallel import DistributedDataParallel

    for name, m in model.named_modules():
        if isinstance(m, (DistributedDataParallel, nn.DataParallel)):
            where = f"at {name!r}" if name else "as the model itself"
            raise TypeError(
                f"the model holds a {type(m).__name__} {where}: metaddp takes its place, so "
                "pass the bare module (ddp.module) and wrap the algorithm in metaddp.MetaDDP. "
                "DDP's gradient hooks neither reduce autograd.grad results nor let autograd "
                "see the reduction"
            )


def require_trained(module: nn.Module) -> None:
    """Refuse a module none of whose parameters is trained (every one frozen)."""
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"no parameter of the {type(module).__name__} requires a gradient (all frozen): "
            "there is nothing to meta-train. Leave requires_grad=True on the ones to learn"
        )
