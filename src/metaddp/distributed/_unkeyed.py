"""Draws metaddp cannot key, refused where they run, while ranks split the work.

metaddp keys dropout in the forwards it runs itself (``meta_loss``, ``adapt``, ``predict``: a
draw scope is open, :mod:`metaddp.forward`), so its masks are the one-process ones on any
split. A forward of the wrapped model outside those loops (``clone()``'s ``learner(x)`` and
the body of ANIL inside it, a hand-written ``md.functional.call(model, fast, x)`` or
``model(x)``) says nothing of which samples it runs on: each process would draw its own
masks from its own generator, and the meta-gradient would change with the number of
processes (0.5 in the largest entry of a two-layer MLP at 2 processes).

:class:`UnkeyedDraws` hooks every module of the wrapped model whose forward may draw
(:func:`metaddp.forward.may_draw`). Outside metaddp's loops, a dropout layer in training mode
(or RReLU) is refused before it draws: on every rank alike, an empty shard's too, so all
ranks raise together. Any other such module (``F.dropout`` or ``torch.randn`` in its own
code) is refused after it ran if it changed a default generator's state: host copies of a
few kilobytes, no device wait. Inside ``learner.local()`` (one rank's own work) nothing is
refused. One process refuses as many do: a script written on one runs on any.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from .._functional import draws_when_called, generator_states
from ..forward import may_draw, unkeyed_here

BY_HAND = (
    "this forward runs outside metaddp's loops (clone()'s learner(x), a hand-written "
    "md.functional.call(model, fast, x) or model(x), ANIL's body run by hand) and says "
    "nothing of which samples it runs on"
)


def refusal(where: str, why: str) -> ValueError:
    return ValueError(
        f"{where} draws random numbers where metaddp cannot key them to the samples: "
        f"{why or BY_HAND}. Each process would draw its own, so the meta-gradient would change "
        "with the number of processes. metaddp keys dropout in the forwards of meta_loss and "
        "adapt (and algorithm.predict): use them, call .eval() on the layer for a "
        "hand-written loop, or run one rank's own work inside learner.local()"
    )


class UnkeyedDraws:
    """Hooks on the modules of ``root`` whose forward may draw (module docstring).

    Args:
        root: the wrapped module.
        refusing: whether draws are refused now (``False`` inside ``learner.local()``).
    """

    def __init__(self, root: nn.Module, refusing: Callable[[], bool]) -> None:
        self.refusing = refusing
        # The generator states before each running forward that may draw (nested forwards).
        self._before: list[tuple[nn.Module, list[bytes]]] = []
        self._handles: list[RemovableHandle] = []
        # The hooked modules: a copy of one (copy.deepcopy) carries the hooks, not the checks.
        self._ids: set[int] = set()
        for name, m in root.named_modules():
            if may_draw(m):
                self._ids.add(id(m))
                label = f"{name or 'the model'} ({type(m).__name__})"
                self._handles.append(
                    m.register_forward_pre_hook(functools.partial(self._pre, label))
                )
                self._handles.append(
                    m.register_forward_hook(functools.partial(self._post, label), always_call=True)
                )

    def _pre(self, label: str, module: nn.Module, args: Any) -> None:
        why = unkeyed_here()
        if why is None or id(module) not in self._ids or not self.refusing():
            return  # metaddp's own loops key every draw; local() work may draw
        if draws_when_called(module):
            raise refusal(label, why)
        self._before.append((module, generator_states()))

    def _post(self, label: str, module: nn.Module, args: Any, output: Any) -> None:
        if not self._before or self._before[-1][0] is not module:
            return
        _, states = self._before.pop()
        if states != generator_states():
            raise refusal(label, unkeyed_here() or "")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._ids = [], set()
