"""Second-order inner loops in memory that does not grow with the number of inner steps.

The default inner loop keeps every step's graph (built with ``create_graph=True``) alive until
the outer backward, so its memory grows with the step count K. Here the loop is one autograd
function. Its forward runs the K steps first order and keeps only each step's fast weights and
optimizer state. Its backward walks the steps in reverse: it rebuilds one step's graph from
the kept weights (the inner gradient with ``create_graph=True``, then the optimizer update)
and pulls the adjoint of the step's outputs through it with one vector-Jacobian product
(reverse over reverse), which holds the Hessian-vector product of the inner loss. Only one
step's graph exists at a time.

:func:`rematerialized_loss` goes one step further: the function also computes the query loss
at the adapted weights, without a graph, and rebuilds it first in the backward. A task then
keeps nothing but its K copies of the weights (and optimizer state) until the outer backward,
so a meta-batch of many tasks holds one task's graph at a time.

The result is the default's meta-gradient: the same operations, differentiated by autograd
(``tests/test_remat.py`` compares them). Through a ``reduce`` the rebuilt step's inner gradient
is again the global one, and the vector-Jacobian product passes through the reduction's
adjoint (a SUM over the same ranks), so every rank runs the same collectives in the same
order: per inner step one SUM forward, and in the backward one to rebuild and one adjoint:
3K + 1 per meta-step with the final gradient SUM (the default: 2K + 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._adapt import grad
from ._types import Params, Reduce
from .inner import InnerOptimizer, SlotState, State, apply_updates

LossOf = Callable[[Params, "Params | None"], Tensor]
"""``loss_of(fast, buffers)``: the support loss share at ``fast``, with the module's own buffers
(``None``) or the given ones."""


def _unzip(state: State) -> tuple[list[Tensor], Callable[[Sequence[Tensor]], State]]:
    """The state's tensors, and how to put other tensors in their places."""
    if isinstance(state, SlotState):
        # The common case, without a general tree walk (which visits every int of the shapes).
        names = [list(slot) for slot in state.slots]
        tensors = [slot[k] for slot in state.slots for k in slot]

        def slots(new: Sequence[Tensor]) -> State:
            it = iter(new)
            return state._replace(slots=tuple({k: next(it) for k in ks} for ks in names))

        return tensors, slots
    leaves, spec = tree_flatten(state)

    def tree(new: Sequence[Tensor]) -> State:
        it = iter(new)
        return tree_unflatten([next(it) if isinstance(x, Tensor) else x for x in leaves], spec)

    return [leaf for leaf in leaves if isinstance(leaf, Tensor)], tree


class _Loop:
    """What one rematerialized loop needs besides its tensor inputs."""

    def __init__(
        self,
        loss_of: LossOf,
        names: list[str],
        optimizer: InnerOptimizer,
        steps: int,
        reduce: Reduce,
        buffers: Params,
        check: Callable[[Params, int], None],
        then: LossOf | None = None,
    ) -> None:
        self.loss_of, self.names, self.optimizer = loss_of, names, optimizer
        self.steps, self.reduce, self.buffers, self.check = steps, reduce, buffers, check
        self.then = then

    def copies(self) -> Params | None:
        """Copies of the buffers for a rebuilt forward: BatchNorm's running statistics moved
        once per forward already, and the outer graph may still hold them."""
        return {name: b.clone() for name, b in self.buffers.items()} or None

    def step(
        self,
        fast: Params,
        state: State,
        k: int,
        *,
        create_graph: bool,
        buffers: Params | None = None,
    ) -> tuple[Params, State]:
        loss = self.loss_of(fast, buffers)
        g = grad(loss, fast, reduce=self.reduce, create_graph=create_graph)
        if not create_graph:  # checked once, in the forward; the rebuilt step is the same
            self.check(g, k)
        updates, state = self.optimizer.update(g, state, fast)
        return apply_updates(fast, updates), state


class _Rematerialized(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loop: _Loop, n: int, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.loop, ctx.n = loop, n
        fast = dict(zip(loop.names, (t.detach() for t in inputs[:n]), strict=True))
        state = loop.optimizer.init(fast)
        kept = []
        for k in range(loop.steps):
            kept.append((fast, state))
            with torch.enable_grad():
                leaf = {
                    name: t.requires_grad_()
                    for name, t in ((name, v.detach()) for name, v in fast.items())
                }
                new, new_state = loop.step(leaf, state, k, create_graph=False)
            fast = {name: v.detach() for name, v in new.items()}
            tensors, put = _unzip(new_state)
            state = put([t.detach() for t in tensors])
        ctx.kept, ctx.last = kept, fast
        ctx.extras = inputs[n:]  # the very tensors the steps read (rates, features)
        if loop.then is not None:
            return (loop.then(fast, None),)
        return tuple(fast.values())

    @staticmethod
    def backward(ctx: Any, *adjoint: Tensor | None) -> tuple[Tensor | None, ...]:
        loop, n = ctx.loop, ctx.n
        extras = list(ctx.extras)
        extra_grads = [torch.zeros_like(e) for e in extras]
        if loop.then is not None:
            # The query loss first: its gradient at the K-th weights is the loop's adjoint.
            (a_loss,) = adjoint
            with torch.enable_grad():
                leaf = {name: v.detach().requires_grad_() for name, v in ctx.last.items()}
                loss = loop.then(leaf, loop.copies())
                grads = torch.autograd.grad(
                    loss,
                    list(leaf.values()) + extras,
                    grad_outputs=a_loss,
                    allow_unused=True,
                    materialize_grads=True,
                )
            adjoint = grads[:n]
            for e, g in zip(extra_grads, grads[n:], strict=True):
                e.add_(g)
        a_fast = [
            torch.zeros_like(f) if a is None else a
            for a, f in zip(adjoint, ctx.last.values(), strict=True)
        ]
        a_state: list[Tensor] | None = None  # the state's adjoint (none after the last step)
        for k in reversed(range(loop.steps)):
            fast, state = ctx.kept[k]
            copies = loop.copies()
            with torch.enable_grad():
                leaf = {name: v.detach().requires_grad_() for name, v in fast.items()}
                tensors, put = _unzip(state)
                s_leaves = [t.detach().requires_grad_() for t in tensors]
                new, new_state = loop.step(
                    leaf, put(s_leaves), k, create_graph=True, buffers=copies
                )
                new_tensors = _unzip(new_state)[0]
                outs = list(new.values()) + new_tensors
                if a_state is None:
                    a_state = [torch.zeros_like(t) for t in new_tensors]
                grads = torch.autograd.grad(
                    outs,
                    list(leaf.values()) + s_leaves + extras,
                    grad_outputs=a_fast + a_state,
                    allow_unused=True,
                    materialize_grads=True,
                )
            a_fast = list(grads[:n])
            a_state = list(grads[n : n + len(s_leaves)])
            for e, g in zip(extra_grads, grads[n + len(s_leaves) :], strict=True):
                e.add_(g)
        return (None, None, *a_fast, *extra_grads)


def rematerialized_loop(
    loss_of: LossOf,
    params: Params,
    *,
    steps: int,
    optimizer: InnerOptimizer,
    reduce: Reduce,
    extras: Sequence[Tensor] = (),
    buffers: Params | None = None,
    check: Callable[[Params, int], None] = lambda g, k: None,
) -> Params:
    """``steps`` second-order inner steps whose memory does not grow with ``steps``.

    Args:
        loss_of: this rank's share of the support loss at the given fast weights.
        params: the weights to start from.
        steps, optimizer, reduce: as :func:`metaddp.inner_loop`.
        extras: every other tensor the steps depend on that needs a gradient (learned rates
            the optimizer reads, features ``loss_of`` reads).
        buffers: the module's buffers by name (BatchNorm's running statistics), which a step
            updates in place: a rebuilt step runs on copies, so they move once per step, as
            by default.
        check: called with each step's reduced gradient and the step number.
    """
    names = list(params)
    loop = _Loop(loss_of, names, optimizer, steps, reduce, dict(buffers or {}), check)
    out = _Rematerialized.apply(loop, len(names), *params.values(), *extras)
    return dict(zip(names, out, strict=True))


def rematerialized_loss(
    loss_of: LossOf,
    query_of: LossOf,
    params: Params,
    *,
    steps: int,
    optimizer: InnerOptimizer,
    reduce: Reduce,
    extras: Sequence[Tensor] = (),
    buffers: Params | None = None,
    check: Callable[[Params, int], None] = lambda g, k: None,
) -> Tensor:
    """``query_of`` at the weights after ``steps`` second-order inner steps, in memory that
    grows with neither ``steps`` nor, across tasks, the query pass: nothing but the kept
    weights lives until the backward.

    Args:
        loss_of: this rank's share of the support loss at the given fast weights.
        query_of: this rank's share of the query loss at the given fast weights.
        extras: every other tensor either loss depends on that needs a gradient.
        Others: as :func:`rematerialized_loop`.
    """
    names = list(params)
    loop = _Loop(loss_of, names, optimizer, steps, reduce, dict(buffers or {}), check, query_of)
    (out,) = _Rematerialized.apply(loop, len(names), *params.values(), *extras)
    return out
