"""Which leaves an autograd graph reaches: the tensors a backward would give a gradient.

A backward writes ``.grad`` on every leaf its graph reaches that needs a gradient. Code that
gives those gradients some other way (a SUM over ranks of the known parameters, an autograd
function whose backward covers its inputs alone) must know that it knows them all: a leaf
it does not know silently gets a gradient of another kind, or none.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def unknown_leaves(
    roots: Sequence[Tensor], known: Sequence[Tensor], stop: Sequence[Tensor] = ()
) -> list[Tensor]:
    """The leaves that need a gradient and that the graphs of ``roots`` reach, other than
    ``known``. The walk does not enter the graphs of ``known`` tensors that are not leaves,
    nor those of ``stop`` (whose graphs the caller knows). Host work only, linear in the
    graph's nodes."""
    leaves = {id(t) for t in known if t.grad_fn is None}
    done = {t.grad_fn for t in (*known, *stop) if t.grad_fn is not None}
    todo = [r.grad_fn for r in roots if r.grad_fn is not None]
    seen, found = set(), []
    while todo:
        node = todo.pop()
        if node in seen or node in done:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # a leaf's AccumulateGrad
        if variable is not None:
            if id(variable) not in leaves:
                found.append(variable)
            continue
        todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return found


def listing(items: Sequence[str], most: int = 5) -> str:
    """The first ``most`` of ``items`` and how many more, for an error message."""
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def shapes(tensors: Sequence[Tensor], most: int = 5) -> str:
    """The first ``most`` tensors' shapes, for an error message."""
    return listing([str(tuple(t.shape)) for t in tensors], most)
