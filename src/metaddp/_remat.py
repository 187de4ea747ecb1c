"""Second-order inner loops in memory that does not grow with the number of inner steps.

The default inner loop keeps every step's graph (built with ``create_graph=True``) alive until
the outer backward, so its memory grows with the step count K. Here the first K - 1 steps are
one autograd function. Its forward runs them first order and keeps only each step's fast
weights and optimizer state. Its backward walks the steps in reverse: it rebuilds one step's
graph from the kept weights (the inner gradient with ``create_graph=True``, then the optimizer
update) and pulls the adjoint of the step's outputs through it with one vector-Jacobian
product (reverse over reverse), which holds the Hessian-vector product of the inner loss. The
last step is built once, with its graph, as by default: the query pass differentiates through
it. One step's graph exists at a time, and at K = 1 nothing runs twice.

:func:`rematerialized_loss` goes one step further (:class:`_RematerializedLoss`): its
backward runs in the forward, so a meta-batch of many tasks holds one task's graph at a time.

The result is the default's meta-gradient: the same operations, differentiated by autograd
(``tests/test_remat.py`` compares them). Through a ``reduce`` the rebuilt step's inner gradient
is again the global one, and the vector-Jacobian product passes through the reduction's
adjoint (a SUM over the same ranks), so every rank runs the same collectives in the same
order: per inner step one SUM forward and one adjoint, and one more to rebuild each step but
the last: 3K per meta-step with the final gradient SUM (the default: 2K + 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import forward as _draws
from ._adapt import inner_step
from ._data import at_least
from ._reach import shapes, unknown_leaves
from ._types import Params, Reduce
from .inner import InnerOptimizer, SlotState, State

LossOf = Callable[[Params, "Params | None"], Tensor]
"""``query_of(fast, buffers)``: the query loss share at ``fast``, with the module's own buffers
(``None``) or the given ones."""
StepLoss = Callable[[Params, "Params | None", int], Tensor]
"""``loss_of(fast, buffers, k)``: inner step ``k``'s support loss share at ``fast``, with the
module's own buffers (``None``) or the given ones."""
Optimizer = InnerOptimizer | Callable[[], InnerOptimizer]
"""The inner optimizer, or a function of nothing that builds it (on learned rates computed
from the function's inputs): built again for every step, so that each rebuilt step's
vector-Jacobian product walks back through a graph of the rates of its own."""


@dataclasses.dataclass(frozen=True)
class Replay:
    """``memory=Replay(...)``: the exact meta-gradient through K inner steps, keeping a tree of
    O(k log_k K) saved weights and optimizer states instead of ``memory="low"``'s K - 1.

    The steps' range is cut into k parts; the forward keeps the state at each part's start.
    The backward walks the parts in reverse: a part of one step is rebuilt with its graph, as
    ``memory="low"`` does; a longer part is replayed from its start, without a graph, keeping
    the starts of its own k parts, and walked the same way (REPLAY, Engstrom et al. 2025,
    arXiv:2503.13751; the k = 2 case is the bisection of Griewank 1992). At most
    ``1 + (k - 1) * ceil(log_k K)`` states are alive at once, and a meta-gradient runs about
    ``K * (1 + log_k K)`` inner steps, against K for ``memory="low"``. The numbers are the same
    operations on the same values: the meta-gradient is ``memory="low"``'s and the default's.

    Args:
        k: parts per level (at least 2). ``None``: the largest k whose tree keeps at most
            ``states`` states alive (the fastest that fits); K or more is ``memory="low"``.
        states: the budget that chooses k when ``k`` is ``None`` (at least 2).
    """

    k: int | None = None
    states: int = 32

    def __post_init__(self) -> None:
        if self.k is not None:
            at_least(self.k, "Replay(k=)", 2)
        at_least(self.states, "Replay(states=)", 2)

    def parts(self, steps: int) -> int:
        """k for a loop of ``steps`` steps."""
        if self.k is not None:
            return self.k
        for k in range(max(steps, 2), 1, -1):
            if alive(k, steps) <= self.states:
                return k
        return 2


MEMORY_MODES = ("default", "low", "replay")


def memory_mode(memory: object) -> str | Replay:
    """``memory=`` checked: ``"default"`` (every step's graph kept), ``"low"`` (every step's
    weights kept, each graph rebuilt), or a :class:`Replay` tree (``"replay"``: the default
    one)."""
    if isinstance(memory, Replay):
        return memory
    if memory == "replay":
        return Replay()
    if memory not in MEMORY_MODES:
        raise ValueError(
            f"memory must be one of {', '.join(map(repr, MEMORY_MODES))} or a "
            f"metaddp.Replay(k=...), got {memory!r}"
        )
    return str(memory)


def alive(k: int, steps: int) -> int:
    """The most states a replay tree with ``k`` parts per level keeps at once over ``steps``
    steps: the start, and k - 1 more per level."""
    depth, span = 0, 1
    while span < steps:
        depth, span = depth + 1, span * k
    return 1 + (k - 1) * depth if steps > 1 else 1


def _starts(begin: int, end: int, k: int | None) -> list[int]:
    """Where the parts of ``[begin, end)`` start: every step without a tree (``k`` ``None``),
    else ``min(k, end - begin)`` parts as even as whole steps allow."""
    n = end - begin
    c = n if k is None else min(k, n)
    return [begin + (n * i) // c for i in range(c)]


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
        loss_of: StepLoss,
        names: list[str],
        optimizer: Optimizer,
        steps: int,
        reduce: Reduce,
        buffers: Params,
        check: Callable[[Params, int], None],
        extras: Sequence[Tensor],
        then: LossOf | None = None,
        draws: _draws.DrawScope | None = None,
        tree: int | None = None,
    ) -> None:
        self.loss_of, self.names = loss_of, names
        # Rates computed once (``hp.exp()``) would have one graph, which the first step's
        # vector-Jacobian product frees: every step builds the optimizer anew instead.
        self.optimizer: Callable[[], InnerOptimizer] = (
            (lambda: optimizer) if isinstance(optimizer, InnerOptimizer) else optimizer
        )
        # Parts per level of the replay tree (Replay), or None: every step's state kept.
        self.tree = tree
        # The dropout keys of the loop's forwards, numbered once: step k's forward is forward
        # k, the query's forward ``steps``, each time it runs (metaddp.forward).
        self.draws = draws
        self.steps, self.reduce, self.buffers, self.check = steps, reduce, buffers, check
        self.extras, self.then = list(extras), then
        # How the optimizer state's tensors go back into its structure (set by the forward of
        # _Rematerialized, which outputs them).
        self.put: Callable[[Sequence[Tensor]], State] | None = None
        # Whether a step inside the function has been searched for tensors from outside its
        # inputs (once per function: every later step reads the same tensors).
        self.looked = False

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
        check: bool = False,
    ) -> tuple[Params, State]:
        with _draws.numbered(self.draws, k):
            loss = self.loss_of(fast, buffers, k)
        seen: list[Params] = []

        def checked(g: Params, k: int) -> None:
            seen.append(g)
            if check:  # once per step, where it first runs; a rebuilt step is the same
                self.check(g, k)

        new, after = inner_step(
            loss,
            fast,
            state,
            self.optimizer(),
            step=k,
            reduce=self.reduce,
            first_order=not create_graph,
            check=checked,
        )
        if not self.looked:  # the first step inside the function: every later one is alike
            self.looked = True
            inside = [*fast.values(), *_unzip(state)[0], *self.extras]
            roots = [loss, *new.values(), *_unzip(after)[0]]
            _refuse_outside(roots, inside, stop=list(seen[0].values()))
        return new, after

    def plain(
        self, fast: Params, state: State, k: int, *, check: bool, buffers: Params | None = None
    ) -> tuple[Params, State]:
        """Step ``k`` with no graph kept: the weights and state after it, detached."""
        with torch.enable_grad():
            leaf = {name: v.detach().requires_grad_() for name, v in fast.items()}
            new, new_state = self.step(
                leaf, state, k, create_graph=False, check=check, buffers=buffers
            )
        tensors, put = _unzip(new_state)
        return {name: v.detach() for name, v in new.items()}, put([t.detach() for t in tensors])

    def sweep(
        self, fast: Params, state: State, begin: int, end: int, stop: int, *, rebuilt: bool
    ) -> tuple[list[Kept], Params, State]:
        """Steps ``begin`` to ``stop`` without a graph, keeping the state where each of the
        tree's parts of ``[begin, end)`` starts (every step's without a tree); returns those
        and the weights and state after the last. ``rebuilt``: steps run again in the
        backward, on copies of the buffers and unchecked (their first run checked them)."""
        starts = _starts(begin, end, self.tree)
        kept = [(begin, fast, state)] if starts else []
        for k in range(begin, stop):
            buffers = self.copies() if rebuilt else None
            fast, state = self.plain(fast, state, k, check=not rebuilt, buffers=buffers)
            if k + 1 in starts:
                kept.append((k + 1, fast, state))
        return kept, fast, state

    def walk(
        self,
        kept: list[Kept],
        end: int,
        a_fast: list[Tensor],
        a_state: list[Tensor],
        extra_grads: list[Tensor],
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Pull the adjoint of the weights and optimizer state after step ``end - 1`` back to
        ``kept[0]``'s, part by part in reverse: a one-step part is rebuilt with its graph, a
        longer one replayed from its kept start (:meth:`sweep`) and walked in turn. Returns
        the adjoints of ``kept[0]``'s weights and state; adds the extras' into
        ``extra_grads``. ``kept`` is emptied as it goes, so a part's states are freed once
        walked."""
        while kept:
            k, fast, state = kept.pop()
            if end - k > 1:  # replayed from its start, keeping its own parts' starts
                part = self.sweep(
                    fast, state, k, end, _starts(k, end, self.tree)[-1], rebuilt=True
                )[0]
                a_fast, a_state = self.walk(part, end, a_fast, a_state, extra_grads)
                end = k
                continue
            copies = self.copies()
            with torch.enable_grad():
                leaf, s_leaves, leaf_state = _leaves(fast, state)
                new, new_state = self.step(leaf, leaf_state, k, create_graph=True, buffers=copies)
                outs = list(new.values()) + _unzip(new_state)[0]
                a_fast, a_state, grads = _vjp(outs, leaf, s_leaves, self.extras, a_fast + a_state)
            for e, g in zip(extra_grads, grads, strict=True):
                e.add_(g)
            end = k
        return a_fast, a_state


Kept = tuple[int, Params, State]
"""A kept state: the step it comes before, the weights and the optimizer state."""


def _leaves(fast: Params, state: State) -> tuple[Params, list[Tensor], State]:
    """New leaves for the weights and for the state's tensors, and the state made of them."""
    leaf = {name: v.detach().requires_grad_() for name, v in fast.items()}
    tensors, put = _unzip(state)
    s_leaves = [t.detach().requires_grad_() for t in tensors]
    return leaf, s_leaves, put(s_leaves)


def _vjp(
    outputs: Tensor | list[Tensor],
    leaf: Params,
    s_leaves: list[Tensor],
    extras: list[Tensor],
    adjoint: list[Tensor] | None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The adjoint of ``outputs`` pulled back to the weights, the state and the extras."""
    n, m = len(leaf), len(s_leaves)
    grads = torch.autograd.grad(
        outputs,
        list(leaf.values()) + s_leaves + extras,
        grad_outputs=adjoint,
        allow_unused=True,
        materialize_grads=True,
    )
    return list(grads[:n]), list(grads[n : n + m]), list(grads[n + m :])


def _refuse_outside(
    roots: Sequence[Tensor], inside: Sequence[Tensor], stop: Sequence[Tensor] = ()
) -> None:
    """Raise if the graphs of ``roots`` reach a tensor that needs a gradient other than
    ``inside`` (the step's weights and state, the function's other inputs) or ``stop`` (whose
    graphs are known: the step's gradients). The function's backward gives gradients to its
    inputs alone: such a tensor (a weight the loss function captures, a rate a custom
    optimizer reads) would silently get none."""
    outside = unknown_leaves(roots, inside, stop)
    if outside:
        raise ValueError(
            f"memory='low' cannot give a gradient to {len(outside)} tensor(s) of shape "
            f"{shapes(outside)} that need one and that the inner steps or "
            "the query loss read from outside: captured by the loss function, the model or a "
            "custom inner optimizer. The low mode's steps run inside one autograd function "
            "whose inputs are the meta-parameters, the learned rates (learn_lr, or tensors "
            "given to sgd or adam as lr) and inputs computed from parameters. Make such a "
            "tensor a parameter of the model or a learned rate, or use memory='default'"
        )


def _sweep(loop: _Loop, fast: Params, steps: int) -> tuple[list[Kept], Params, State]:
    """``steps`` first-order steps from ``fast`` (:meth:`_Loop.sweep`), checked."""
    return loop.sweep(fast, loop.optimizer().init(fast), 0, steps, steps, rebuilt=False)


class _Rematerialized(torch.autograd.Function):
    """``loop.steps`` inner steps, first order forward, each rebuilt in the backward. Outputs
    the weights and the optimizer state's tensors after the last; :attr:`_Loop.put` puts the
    latter back in the state's structure."""

    @staticmethod
    def forward(ctx: Any, loop: _Loop, n: int, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.loop, ctx.n = loop, n
        fast = dict(zip(loop.names, (t.detach() for t in inputs[:n]), strict=True))
        ctx.kept, fast, state = _sweep(loop, fast, loop.steps)
        tensors, loop.put = _unzip(state)
        return (*fast.values(), *tensors)

    @staticmethod
    def backward(ctx: Any, *adjoint: Tensor | None) -> tuple[Tensor | None, ...]:
        _first_derivatives_only()
        loop, n = ctx.loop, ctx.n
        extra_grads = [torch.zeros_like(e) for e in loop.extras]
        _, last, before = ctx.kept[-1]  # shapes for the adjoints autograd leaves out (None)
        a_fast = [
            torch.zeros_like(f) if a is None else a
            for a, f in zip(adjoint[:n], last.values(), strict=True)
        ]
        a_state = [
            torch.zeros_like(t) if a is None else a
            for a, t in zip(adjoint[n:], _unzip(before)[0], strict=True)
        ]
        a_fast, _ = loop.walk(ctx.kept, loop.steps, a_fast, a_state, extra_grads)
        return (None, None, *a_fast, *extra_grads)


class _RematerializedLoss(torch.autograd.Function):
    """The query loss after the inner steps, its gradient computed in the forward.

    The loss is the function's only output, so its backward is the gradient at an upstream
    gradient of one, times the upstream gradient: all of it can run at once, in the forward.
    That saves what the backward would redo: the query pass (forward without a graph, then
    rebuilt) and the last inner step (first order, then rebuilt), whose graphs now live
    together, once: the last step is built with its graph, the query loss on top of it, and
    one vector-Jacobian product goes through both. The steps before are rebuilt one at a time
    as in :class:`_Rematerialized`. Memory still does not grow with K (one step's graph and
    the query pass at a time) nor with the tasks (each function holds only gradients, the
    size of its inputs, until the backward). On one step (K = 1) nothing is computed twice.
    """

    @staticmethod
    def forward(ctx: Any, loop: _Loop, n: int, *inputs: Tensor) -> Tensor:
        assert loop.then is not None
        start = dict(zip(loop.names, (t.detach() for t in inputs[:n]), strict=True))
        extras = loop.extras  # the very tensors inputs[n:] (rates, features)
        kept, fast, state = _sweep(loop, start, max(loop.steps - 1, 0))
        with torch.enable_grad():
            leaf, s_leaves, leaf_state = _leaves(fast, state)
            at = leaf
            if loop.steps:
                at, _ = loop.step(leaf, leaf_state, loop.steps - 1, create_graph=True, check=True)
            with _draws.numbered(loop.draws, loop.steps):
                loss = loop.then(at, None)
            _refuse_outside([loss], [*at.values(), *extras])
            a_fast, a_state, extra_grads = _vjp(loss, leaf, s_leaves, extras, None)
        a_fast, _ = loop.walk(kept, max(loop.steps - 1, 0), a_fast, a_state, extra_grads)
        ctx.grads = (*a_fast, *extra_grads)
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, a_loss: Tensor) -> tuple[Tensor | None, ...]:
        _first_derivatives_only()
        return (None, None, *(a_loss * g for g in ctx.grads))


def _first_derivatives_only() -> None:
    """A backward here runs under grad mode only for ``create_graph=True``: a derivative of
    the meta-gradient, which the rebuilt steps' plain vector-Jacobian products do not give.
    Refuse rather than return gradients that silently lack those terms."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "memory='low' gives the meta-gradient (first derivatives of the meta-loss) only: a "
            "backward with create_graph=True through it would miss its second-order terms. "
            "Use memory='default' to differentiate the meta-gradient again"
        )


def rematerialized_loop(
    loss_of: StepLoss,
    params: Params,
    *,
    steps: int,
    optimizer: Optimizer,
    reduce: Reduce,
    extras: Sequence[Tensor] = (),
    buffers: Params | None = None,
    check: Callable[[Params, int], None] = lambda g, k: None,
    replay: Replay | None = None,
) -> Params:
    """``steps`` second-order inner steps whose memory does not grow with ``steps``.

    Args:
        loss_of: this rank's share of step k's support loss at the given fast weights.
        params: the weights to start from.
        steps, reduce: as :func:`metaddp.functional.inner_loop`.
        optimizer: the inner optimizer, or a function of nothing that builds it
            (:data:`Optimizer`): one whose learned rates are computed from the extras
            (``hp.exp()``) must be the latter.
        extras: every other tensor the steps depend on that needs a gradient (learned rates
            the optimizer reads, or the parameters a built one computes them from; features
            ``loss_of`` reads).
        buffers: the module's buffers by name (BatchNorm's running statistics), which a step
            updates in place: a rebuilt step runs on copies, so they move once per step, as
            by default.
        check: called with each step's reduced gradient and the step number.
        replay: keep a tree of states (:class:`Replay`) instead of every step's.
    """
    if steps == 0:
        return dict(params)
    names, n = list(params), len(params)
    # The first K - 1 steps in one function; the last one is built with its graph, which the
    # caller's query pass differentiates through (the last step is then not run twice).
    draws = _draws.reserve(steps)
    loop = _Loop(
        loss_of, names, optimizer, steps - 1, reduce, dict(buffers or {}), check, extras,
        draws=draws, tree=replay.parts(steps - 1) if replay else None,
    )  # fmt: skip
    if loop.steps:
        out = _Rematerialized.apply(loop, n, *params.values(), *extras)
        assert loop.put is not None  # set by the forward
        fast, state = dict(zip(names, out[:n], strict=True)), loop.put(out[n:])
    else:
        fast, state = dict(params), loop.optimizer().init(dict(params))
    loop.looked = True  # the last step is the caller's graph: autograd reaches every tensor
    return loop.step(fast, state, steps - 1, create_graph=True, check=True)[0]


def rematerialized_loss(
    loss_of: StepLoss,
    query_of: LossOf,
    params: Params,
    *,
    steps: int,
    optimizer: Optimizer,
    reduce: Reduce,
    extras: Sequence[Tensor] = (),
    buffers: Params | None = None,
    check: Callable[[Params, int], None] = lambda g, k: None,
    replay: Replay | None = None,
) -> Tensor:
    """``query_of`` at the weights after ``steps`` second-order inner steps, in memory that
    grows with neither ``steps`` nor, across tasks, the query pass: nothing but the kept
    weights lives until the backward.

    Args:
        loss_of: this rank's share of step k's support loss at the given fast weights.
        query_of: this rank's share of the query loss at the given fast weights.
        extras: every other tensor either loss depends on that needs a gradient.
        Others: as :func:`rematerialized_loop`.
    """
    names = list(params)
    draws = _draws.reserve(steps + 1)  # the steps' forwards, then the query's
    loop = _Loop(
        loss_of, names, optimizer, steps, reduce, dict(buffers or {}), check, extras, query_of,
        draws, replay.parts(steps - 1) if replay else None,
    )  # fmt: skip
    inputs = (*params.values(), *extras)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _RematerializedLoss.apply(loop, len(names), *inputs)
    with torch.no_grad():  # no gradient to compute: the steps first order, then the loss
        loop.tree = 1  # nothing to walk back: keep only the start
        fast = _sweep(loop, {k: v.detach() for k, v in params.items()}, steps)[1]
        with _draws.numbered(draws, steps):
            return query_of(fast, None)
