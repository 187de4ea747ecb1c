"""Which reductions an algorithm uses when it is not told: the ones of the wrapper around it.

An algorithm never knows about ranks; it reads the :class:`Collectives` it holds in its
``metaddp_bound`` attribute (:func:`collectives_for`). :class:`metaddp.MetaDDP` sets its own
there (the mesh's sample-axis SUM, the global task count, its guards) on every algorithm inside
the module it wraps when it is built, and takes them back in ``release()``, so that
``wrapper.module.meta_loss(tasks, loss_fn)`` and ``wrapper.module.clone()`` reduce across ranks
without a keyword. An algorithm that holds none gets the one-process default, :data:`LOCAL`,
on one process, and an error on several instead of rank-local gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from ._types import Reduce, identity_reduce

_NONE_MADE = types.SimpleNamespace(calls=0)


@dataclasses.dataclass(frozen=True)
class Collectives:
    """What an algorithm may ask of the processes it runs on.

    Attributes:
        reduce: differentiable SUM over the processes that split one task's samples.
        count_tasks: the number of tasks in the global meta-batch, from this process's count.
        where: a description for error messages.
        step_ends_in_sync: whoever bound these reads the step's device-side checks at its
            end (``MetaDDP.sync_grads``), so ``meta_loss`` may leave them there
            (:mod:`metaddp._host`).
        exact: in deterministic mode, the order-free copies and sums the meta-loss must go
            through (``metaddp.distributed.ExactSums``); ``None`` otherwise.
        split: the work is split over processes by whoever bound these, so that a random
            draw inside the model (dropout) would differ with the number of processes.
        check_loss: called with every meta-loss and its loss function; raises if the
            meta-loss depends on what the binder cannot sum (a trained tensor outside the
            module).
        samples_split: processes may split a task's samples, so a batch may hold part of its
            ``n`` samples; without it every batch must hold all of them.
        check_share: called with every loss a caller hands to an inner step (``clone()``'s
            ``adapt``, ``MetaDDP.grad``) and where it was given; raises unless the loss is a
            share of a batch the processes that split it agree on (:func:`metaddp.share`).
        note: ``note(kind, flag)``: a verdict of this process's work (a 1-element bool
            tensor on the device, true for a mistake of ``kind``), which the binder sums over
            the processes with the step and judges alike on every one of them.
        counting: a context manager whose value's ``calls`` counts the collectives made
            inside (``metaddp.distributed.counting``).
        printing: ``printing(key)``: whether to note the print of the loss function ``key``
            (``note("loss_fn", print)``) for the processes to compare: true once per function
            on a step the binder checks.
    """

    reduce: Reduce
    count_tasks: Callable[[int], int]
    where: str
    step_ends_in_sync: bool = False
    exact: Any = None
    split: bool = False
    check_loss: Callable[[Any, Any], None] = lambda loss, loss_fn: None
    samples_split: bool = False
    check_share: Callable[[Any, str], None] = lambda loss, where: None
    note: Callable[[str, Any], None] = lambda kind, flag: None
    counting: Callable[[], Any] = lambda: contextlib.nullcontext(_NONE_MADE)
    printing: Callable[[Any], bool] = lambda key: False


LOCAL = Collectives(identity_reduce, int, "one process")

_SHARDINGS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
"""The models whose trained parameters are shards, each with its sharding: a callable that,
given the model and the weights of a forward, returns them with every sharded one full, and
whose ``whole(weights)`` gathers them outside a forward
(``metaddp.distributed._sharded.Sharding``). Kept here, beside the model, as torch's
composable APIs keep their per-module state: nothing is written into the user's module."""


def sharding_of(model: nn.Module) -> Any:
    """The sharding of ``model``'s parameters, or ``None`` (they are whole)."""
    return _SHARDINGS.get(model)


def set_sharding(model: nn.Module, sharding: Any) -> None:
    """Make ``sharding`` the one of ``model``; ``None`` forgets it."""
    if sharding is None:
        _SHARDINGS.pop(model, None)
    else:
        _SHARDINGS[model] = sharding


BINDABLE = "metaddp_bound"
"""The attribute of a module that holds its :class:`Collectives` (``None``: unbound)."""


def bind(module: nn.Module, collectives: Collectives | None) -> None:
    """Make ``collectives`` the default of every algorithm inside ``module`` (``None``: none)."""
    for m in module.modules():
        if hasattr(m, BINDABLE):
            setattr(m, BINDABLE, collectives)


def unbind(module: nn.Module) -> None:
    bind(module, None)


def several_processes() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collectives_for(*modules: nn.Module) -> Collectives:
    """The collectives held by the first of ``modules`` that holds any.

    Raises:
        RuntimeError: none is bound, and this process is one of several: the algorithm would
            otherwise adapt on its own shard only and sum meta-gradients of a different problem.
    """
    for m in modules:
        found = getattr(m, BINDABLE, None)
        if found is not None:
            return found
    if several_processes():
        raise RuntimeError(
            f"{type(modules[0]).__name__} runs on {dist.get_world_size()} processes but is not "
            "wrapped in metaddp.MetaDDP, so it cannot know which processes split a task's "
            "samples or how many tasks the meta-batch holds. Wrap it: "
            "`learner = metaddp.MetaDDP(algorithm, mesh)`, then call `learner.meta_loss(...)` "
            "(or pass reduce= explicitly and a metaddp.MetaBatch, for hand-made set-ups)."
        )
    return LOCAL
