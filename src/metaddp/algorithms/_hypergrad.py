"""Hypergradient methods: how the gradient of an outer loss reaches the outer variables
through an inner problem solved by K optimizer steps.

The problem (:class:`InnerProblem`) is given as two functions of the fast weights, this
rank's *share* of the inner objective and of the outer loss, with the start, the steps, the
inner optimizer and ``reduce``, the differentiable SUM over the processes that split the
batches. Every method returns one scalar per problem whose value is the outer share and whose
gradient (``backward()``, then the wrapper's SUM of ``.grad``) is the method's hypergradient.

None of them knows about ranks, and none computes a data-dependent quantity (a norm, a
finite-difference step, a conjugate-gradient coefficient) from a rank's own part: every
vector such a quantity is made of is a reduced gradient or Hessian-vector product, identical
on every rank that shares the problem. The value is therefore the one-process value of the
same method for any split, uneven and empty shards included. Terms each rank differentiates
on its own (the mixed second derivative ``d/d lambda <grad_phi L_in, v>``) are taken of its
share, so the final SUM counts each once.

Each method's cost, memory, bias against ``Unrolled`` and paper: the table of
docs/bilevel.md.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from .._adapt import StepLoss, descend
from .._data import at_least
from .._types import Params, Reduce
from ..inner import InnerOptimizer, State, learned_rates
from ._first_step import FirstStep

Vectors = list[Tensor]


class ConvergenceWarning(RuntimeWarning):
    """An iterative solver stopped at its budget before reaching its tolerance."""


class NotPositiveDefinite(FloatingPointError):
    """Conjugate gradient met a direction of zero, negative or non-finite curvature: the
    system is not positive definite (for iMAML, the support loss curves down more steeply
    than the proximal term ``lam`` holds it up, or it is not finite)."""

    def __init__(self, message: str, curvature: float) -> None:
        super().__init__(message)
        self.curvature = curvature

    @classmethod
    def along(cls, what: str, curvature: float, advice: str) -> NotPositiveDefinite:
        """The error of a solver named ``what`` that met ``p^T A p = curvature``."""
        return cls(
            f"{what}: the system matrix is not positive definite along a search direction "
            f"(p^T A p = {curvature:.3g}); {advice}",
            curvature,
        )


PROXIMAL_ADVICE = (
    "increase the proximal strength lam or lower the inner learning rate so that the inner "
    "solution is near a minimum"
)


def warn_unconverged(what: str, max_iter: int, residual: float, tol: float) -> None:
    """Warn (:class:`ConvergenceWarning`) where a solver's budget ended above its tolerance."""
    if tol > 0 and residual > tol:
        warnings.warn(
            f"{what} did not converge in {max_iter} iterations: relative residual "
            f"{residual:.3g} > tolerance {tol:.3g}; the implicit gradient is approximate. Raise "
            "the iteration budget, or make the system better conditioned.",
            ConvergenceWarning,
            stacklevel=4,
        )


def _whole_dot(a: Vectors, b: Vectors) -> Tensor:
    # A tensor for the non-empty vectors the solver works on (an empty right-hand side sums
    # to 0, which conjugate_gradient only passes to float() before returning).
    return cast(Tensor, sum((x * y).sum() for x, y in zip(a, b, strict=True)))


def dot_of(reduce: Reduce) -> Callable[[Vectors, Vectors], Tensor]:
    """The inner product of vectors that ``reduce``'s gradients live in: the reduce's own
    ``dot`` (each rank's rows of sharded weights, summed over the ranks), else whole."""
    return cast(Callable[[Vectors, Vectors], Tensor], getattr(reduce, "dot", _whole_dot))


def conjugate_gradient(
    matvec: Callable[[Vectors], Vectors],
    b: Vectors,
    *,
    max_iter: int,
    tol: float,
    what: str = "conjugate gradient",
    advice: str = PROXIMAL_ADVICE,
    dot: Callable[[Vectors, Vectors], Tensor] | None = None,
) -> tuple[Vectors, float, int]:
    """Solve ``A x = b`` for symmetric positive definite ``A`` given by ``matvec``.

    Args:
        matvec: ``v -> A v`` over lists of tensors.
        b: right-hand side.
        max_iter: the budget of matrix-vector products.
        tol: stop when ``||r|| <= tol * ||b||`` (0: always ``max_iter`` products).
        what: named in the warning.
        advice: what the error of a non-positive curvature suggests.
        dot: the inner product of two lists of tensors (default: of whole tensors; where they
            are each rank's rows of sharded weights, the reduce's ``dot``, summed over the
            ranks: :func:`dot_of`).

    Returns:
        ``(x, relative residual ||b - A x|| / ||b||, iterations used)``. Warns with
        :class:`ConvergenceWarning` when the budget ends above a positive tolerance.
    """
    _dot = _whole_dot if dot is None else dot
    x = [torch.zeros_like(t) for t in b]
    b_norm = float(_dot(b, b)) ** 0.5
    if b_norm == 0.0:
        return x, 0.0, 0
    r = [t.clone() for t in b]
    p = [t.clone() for t in b]
    rr = _dot(r, r)
    it = 0
    while it < max_iter and float(rr) ** 0.5 > tol * b_norm:
        ap = matvec(p)
        pap = _dot(p, ap)
        if not torch.isfinite(pap) or float(pap) <= 0:
            raise NotPositiveDefinite.along(what, float(pap), advice)
        alpha = rr / pap
        x = [xi + alpha * pi for xi, pi in zip(x, p, strict=True)]
        r = [ri - alpha * api for ri, api in zip(r, ap, strict=True)]
        rr_new = _dot(r, r)
        p = [ri + (rr_new / rr) * pi for ri, pi in zip(r, p, strict=True)]
        rr = rr_new
        it += 1
    residual = float(rr) ** 0.5 / b_norm
    warn_unconverged(what, max_iter, residual, tol)
    return x, residual, it


@dataclasses.dataclass(frozen=True)
class InnerProblem:
    """One inner problem as every method sees it.

    Attributes:
        inner: ``inner(fast, k)``: this rank's share of inner step k's objective at the given
            fast weights (a function of the outer variables too, through whatever it closes
            over); ``k`` ``None``: the objective at a solution, for methods that read no step
            (the same objective at every step unless the problem has minibatches).
        outer: this rank's share of the outer loss at the given fast weights.
        start: the fast weights the inner steps start from.
        steps: the number of inner optimizer steps, K.
        optimizer: the differentiable inner optimizer.
        reduce: the differentiable SUM over the processes that split the batches.
        check: ``check(reduced_grads, step)``: refuses a non-finite inner gradient.
        first: keeps the objective and this rank's gradient of the step taken at ``start``
            (:class:`metaddp.algorithms._first_step.FirstStep`), or ``None``.
    """

    inner: Callable[[Params, int | None], Tensor]
    outer: Callable[[Params], Tensor]
    start: Params
    steps: int
    optimizer: InnerOptimizer
    reduce: Reduce
    check: Callable[[Params, int], None] = lambda grads, step: None
    first: FirstStep | None = None

    def stepping(self) -> tuple[StepLoss, Reduce]:
        """The inner steps' objective and SUM (:func:`metaddp._adapt.descend`'s), which keep
        the step at the start's objective and gradient where :attr:`first` asks for them."""
        return (
            (self.inner, self.reduce)
            if self.first is None
            else self.first.watch(self.inner, self.reduce)
        )


class _Held(torch.autograd.Function):
    """Copies of ``values`` that need a gradient, through which none flows back.

    The point a method differentiates at (the weights after steps taken without a graph, or
    a lookahead's start) must need a gradient for ``torch.autograd.grad``, but must not pass
    one on. A new leaf would do that, and the wrapper's search of the meta-loss's graph would
    rightly refuse a leaf it does not know; this node hangs off ``anchors``, tensors of the
    graph already (meta-parameters), and gives them nothing. One node holds every copy.
    """

    @staticmethod
    def forward(ctx: Any, n: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        # The first n are the values, the rest their anchors.
        ctx.inputs = 1 + len(tensors)
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:
        return (None,) * ctx.inputs


def held(values: Params, anchor: Tensor | Params) -> Params:
    """``values`` as tensors that need a gradient with no path back (:class:`_Held`), hung
    off ``anchor``, or off ``anchor[k]`` each where it is a dict of the same names."""
    if not values:
        return {}
    names = list(values)
    anchors = [anchor] if isinstance(anchor, Tensor) else [anchor[k] for k in names]
    with torch.enable_grad():
        copies = _Held.apply(len(names), *(values[k].detach() for k in names), *anchors)
    return dict(zip(names, cast(tuple[Tensor, ...], copies), strict=True))


_HELD: type = _Held._backward_cls  # the class of its nodes


def held_start(p: InnerProblem) -> Params:
    """The start as copies through which no gradient flows back (:func:`held`): the start
    itself where it is such copies already (a lookahead's, ``start="current"``)."""
    if p.start and all(isinstance(t.grad_fn, _HELD) for t in p.start.values()):
        return p.start
    return held(p.start, _anchor(p))


def _anchor(p: InnerProblem) -> Tensor:
    for t in p.start.values():
        if t.requires_grad:
            return t
    raise ValueError("the inner problem's start has no weight that needs a gradient")


def _detached(state: State) -> State:
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, state)


@dataclasses.dataclass
class _Last:
    """The last inner step's point, reduced gradient and optimizer state before it."""

    point: Params
    grads: Params
    state: State


def _first_order(
    p: InnerProblem, fast: Params, state: State, steps: int, first: int = 0
) -> tuple[Params, State, _Last | None]:
    """``steps`` inner steps with no graph kept; returns the weights (new leaves), the state
    and the last step's :class:`_Last`."""
    last, anchor, seen = None, _anchor(p), []

    def check(g: Params, k: int) -> None:
        seen.append(g)  # the step's reduced gradient, kept for _Last
        p.check(g, k)

    loss, reduce = p.stepping()
    for after, new_state in descend(
        loss, fast, state, p.optimizer, range(first, first + steps), reduce=reduce, check=check,
        restart=lambda f, s: (held(f, anchor), _detached(s)),
    ):  # fmt: skip
        last = _Last(fast, seen.pop(), state)
        fast, state = after, new_state
    return fast, state, last


def unroll(p: InnerProblem, fast: Params, state: State, steps: int, first: int = 0) -> Params:
    """``steps`` inner steps whose graph is kept (second order); ``first`` numbers them. Each
    is :func:`metaddp.functional.inner_step`, the step MAML's loop takes."""
    loss, reduce = p.stepping()
    ks = range(first, first + steps)
    last = collections.deque(descend(loss, fast, state, p.optimizer, ks, reduce=reduce), maxlen=1)
    return last[0][0] if last else fast


def _outer_gradient(p: InnerProblem, fast: Params) -> tuple[Tensor, Vectors]:
    """The outer share at ``fast`` (with its graph to the outer variables) and the global
    gradient of the outer loss with respect to the fast weights."""
    with torch.enable_grad():
        q = p.outer(fast)
        g = torch.autograd.grad(
            q, list(fast.values()), retain_graph=True, allow_unused=True, materialize_grads=True
        )
    return q, p.reduce(list(g))


def hessian_products(
    share: Tensor, weights: Vectors, reduce: Reduce
) -> tuple[Vectors, Callable[[Vectors], Vectors]]:
    """The gradient of this rank's ``share`` in ``weights`` (with its graph), and ``v -> H v``
    for the *global* objective: each rank's product of its share, through ``reduce``, so the
    same vector on every rank that shares the batch."""
    with torch.enable_grad():
        g = torch.autograd.grad(
            share, weights, create_graph=True, allow_unused=True, materialize_grads=True
        )
    live = [i for i, t in enumerate(g) if t.requires_grad]

    def hvp(v: Vectors) -> Vectors:
        local = [torch.zeros_like(t) for t in v]
        if live:  # a rank with no samples contributes a zero product
            with torch.enable_grad():
                got = torch.autograd.grad(
                    [g[i] for i in live], weights, grad_outputs=[v[i] for i in live],
                    retain_graph=True, allow_unused=True, materialize_grads=True,
                )  # fmt: skip
            local = list(got)
        return reduce(local)

    return list(g), hvp


def _refuse_learned_rates(p: InnerProblem, method: str) -> None:
    if learned_rates(p.optimizer):
        raise ValueError(
            f"{method} differentiates the inner objective, not the inner optimizer: learning "
            "rates that require grad would get no gradient from it. Use Unrolled() or "
            "Truncated(T), which differentiate through the steps"
        )


def _with_gradient_of(value: Tensor, term: Tensor) -> Tensor:
    """``value``, with ``term``'s gradient added (``term``'s value is not)."""
    return value + (term - term.detach())


class Method:
    """A hypergradient method: :meth:`loss` of an :class:`InnerProblem`."""

    name: str = ""

    def loss(self, problem: InnerProblem) -> Tensor:
        """This rank's outer share, whose gradient is its share of the hypergradient."""
        raise NotImplementedError

    def reaches_start(self, steps: int) -> bool:
        """Whether the hypergradient has a path to the inner steps' start (MAML's
        meta-parameters); the implicit and one-step methods take the inner solution as
        independent of it, and reach it only through the inner objective (a proximal term)."""
        return False

    def settings(self) -> dict[str, Any]:
        """What defines the method's number (ranks compare it)."""
        return {"method": self.name, **dataclasses.asdict(cast(Any, self))}


@dataclasses.dataclass(frozen=True)
class Unrolled(Method):
    """Backpropagation through all K inner steps, second order: the exact gradient of the
    outer loss after K steps (what MAML computes). ``memory="low"`` on the algorithm rebuilds
    one step's graph at a time."""

    name = "unrolled"

    def reaches_start(self, steps: int) -> bool:
        return True

    def loss(self, problem: InnerProblem) -> Tensor:
        fast = unroll(problem, problem.start, problem.optimizer.init(problem.start), problem.steps)
        return problem.outer(fast)


@dataclasses.dataclass(frozen=True)
class Truncated(Method):
    """Backpropagation through the last ``last`` inner steps only (Shaban et al. 2019,
    arXiv:1810.10667): the first K - T steps run without a graph, so memory holds T steps.

    Args:
        last: T, the steps differentiated through (1 <= T <= K; T = K is :class:`Unrolled`).
    """

    last: int = 1
    name = "truncated"

    def __post_init__(self) -> None:
        at_least(self.last, "Truncated(last=)")

    def reaches_start(self, steps: int) -> bool:
        return self.last >= steps

    def loss(self, problem: InnerProblem) -> Tensor:
        if self.last > problem.steps:
            raise ValueError(
                f"Truncated(last={self.last}) differentiates more steps than the {problem.steps} "
                "inner steps the problem takes"
            )
        skip = problem.steps - self.last
        fast, state = problem.start, problem.optimizer.init(problem.start)
        if skip:
            fast, state, _ = _first_order(problem, fast, state, skip)
        return problem.outer(unroll(problem, fast, state, self.last, skip))


class _Implicit(Method):
    """The implicit function theorem at the inner solution phi (the weights after K steps,
    taken as a minimum of the inner objective): the hypergradient is
    ``d_lambda L_out - d_lambda <grad_phi L_in, v>`` with ``H v = grad_phi L_out``, H the
    inner objective's Hessian at phi. Subclasses solve for v."""

    def solve(self, hvp: Callable[[Vectors], Vectors], b: Vectors) -> Vectors:
        raise NotImplementedError

    def loss(self, problem: InnerProblem) -> Tensor:
        _refuse_learned_rates(problem, type(self).__name__)
        start = held_start(problem)
        phi, _, _ = _first_order(problem, start, problem.optimizer.init(start), problem.steps)
        q, b = _outer_gradient(problem, phi)
        # This rank's share's gradient, with its graph: to phi for the Hessian-vector
        # products, to the outer variables for the mixed term.
        with torch.enable_grad():
            share = problem.inner(phi, None)
        g_in, hvp = hessian_products(share, list(phi.values()), problem.reduce)
        with torch.no_grad():
            v = self.solve(hvp, [t.detach() for t in b])
        return _with_gradient_of(q, -_whole_dot(g_in, v))


@dataclasses.dataclass(frozen=True)
class ImplicitCG(_Implicit):
    """Implicit differentiation with v from conjugate gradient on ``(H + damping I) v = g``
    (iMAML's solve, for any inner objective; Rajeswaran et al. 2019).

    Args:
        iterations: the budget of Hessian-vector products.
        tol: stop at this relative residual; 0 (the default) always runs ``iterations``, so
            every run takes the same iterate.
        damping: added to the Hessian's diagonal, for inner solutions that are not minima
            (CG needs a positive definite system and says so when it is not).
    """

    iterations: int = 10
    tol: float = 0.0
    damping: float = 0.0
    name = "implicit-cg"

    def __post_init__(self) -> None:
        at_least(self.iterations, "ImplicitCG(iterations=)")
        if not (self.tol >= 0 and self.damping >= 0):
            raise ValueError(
                f"ImplicitCG needs tol and damping >= 0, got {self.tol}, {self.damping}"
            )

    def solve(self, hvp: Callable[[Vectors], Vectors], b: Vectors) -> Vectors:
        damping = self.damping

        def matvec(v: Vectors) -> Vectors:
            return [h + damping * x for h, x in zip(hvp(v), v, strict=True)] if damping else hvp(v)

        v, _, _ = conjugate_gradient(
            matvec, b, max_iter=self.iterations, tol=self.tol, what="ImplicitCG",
            advice="the inner weights are not at a minimum of the inner objective: add "
            "ImplicitCG(damping=...), take more inner steps, or use Neumann or T1T2",
        )  # fmt: skip
        return v


@dataclasses.dataclass(frozen=True)
class Neumann(_Implicit):
    """Implicit differentiation with ``H^-1 g ~ alpha sum_{j=0..m} (I - alpha H)^j g``
    (Lorraine et al. 2020): m Hessian-vector products, no host read.

    Args:
        iterations: m, the terms of the series after the first.
        alpha: the series' step; it converges when ``alpha < 2 / lambda_max(H)``, and the
            inner learning rate of SGD is the usual choice.
    """

    iterations: int = 5
    alpha: float = 0.1
    name = "neumann"

    def __post_init__(self) -> None:
        at_least(self.iterations, "Neumann(iterations=)", least=0)
        if not self.alpha > 0:
            raise ValueError(f"Neumann(alpha=) must be positive, got {self.alpha!r}")

    def solve(self, hvp: Callable[[Vectors], Vectors], b: Vectors) -> Vectors:
        term, total = list(b), list(b)
        for _ in range(self.iterations):
            term = [t - self.alpha * h for t, h in zip(term, hvp(term), strict=True)]
            total = [s + t for s, t in zip(total, term, strict=True)]
        return [self.alpha * s for s in total]


class _FiniteDifference(Method):
    """One inner step's Jacobian, applied by central differences: for the step
    ``phi' = phi + u(g(phi, lambda))`` the hypergradient is ``d_lambda L_out(phi') +
    d_lambda <g(phi, lambda), J_u^T v>`` with ``v = grad L_out(phi')`` and ``J_u`` the
    update's Jacobian in the gradient (``-lr`` for SGD; Adam's own diagonal otherwise). The
    mixed term is ``[L_in(phi + e p) - L_in(phi - e p)] / 2e`` with ``p = J_u^T v`` and
    ``e = r / ||p||``: no second-order graph. ``p`` is reduced, so ``||p||`` is the whole
    batch's on every rank.

    The differences see the inner objective's *value*: where the inner loss detaches part of
    itself (Meta-Weight-Net's weights computed from detached losses), they differentiate
    through that part too, which the other methods' gradients do not."""

    r: float
    at_end: bool  # the differences at the adapted weights (SAMA) or before the last step

    def __post_init__(self) -> None:
        if not self.r > 0:
            raise ValueError(f"{type(self).__name__}(r=) must be positive, got {self.r!r}")

    def loss(self, problem: InnerProblem) -> Tensor:
        _refuse_learned_rates(problem, type(self).__name__)
        start = held_start(problem)
        fast, _, last = _first_order(problem, start, problem.optimizer.init(start), problem.steps)
        assert last is not None  # steps >= 1
        q, v = _outer_gradient(problem, fast)
        names = list(fast)
        # J_u^T v: the optimizer's update is a function of the gradient; its vector-Jacobian
        # product at the last step's gradient and state.
        g = {k: t.detach().requires_grad_() for k, t in last.grads.items()}
        with torch.enable_grad():
            updates, _ = problem.optimizer.update(g, last.state, last.point)
            vjp = torch.autograd.grad(
                [updates[k] for k in names], [g[k] for k in names], grad_outputs=v,
                allow_unused=True, materialize_grads=True,
            )  # fmt: skip
        point = fast if self.at_end else last.point
        with torch.no_grad():
            norm = torch.sqrt(_whole_dot(list(vjp), list(vjp)))
            # p = 0 gives equal points and a zero difference: the term is 0, not 0/0.
            e = self.r / norm.clamp_min(torch.finfo(norm.dtype).tiny)
            plus = {k: point[k].detach() + e * d for k, d in zip(names, vjp, strict=True)}
            minus = {k: point[k].detach() - e * d for k, d in zip(names, vjp, strict=True)}
        with torch.enable_grad():
            mixed = (problem.inner(plus, None) - problem.inner(minus, None)) / (2 * e)
        return _with_gradient_of(q, mixed)


@dataclasses.dataclass(frozen=True)
class T1T2(_FiniteDifference):
    """The one-step hypergradient (T1-T2, Luketina et al. 2016) with DARTS's central
    differences (Liu et al. 2019): the gradient through the last inner step only, as
    ``Truncated(1)`` without its second-order graph, equal to it to O(r^2) where no part of
    the inner loss is detached. Where a part is (Meta-Weight-Net's weights computed from
    detached losses), the differences of the loss's value differentiate through it too, and
    the two differ by order one: on :class:`metaddp.testing.scenarios.BilevelProblem`'s
    reweighting at r = 1e-4, the weighting network's hypergradient by 25% of its norm, while
    the learned weight decay's agrees to 1e-11.

    Args:
        r: the difference's radius in weight space (DARTS: 0.01).
    """

    r: float = 0.01
    at_end: bool = dataclasses.field(default=False, init=False)
    name = "t1t2"


@dataclasses.dataclass(frozen=True)
class SAMA(_FiniteDifference):
    """SAMA (Choe et al. 2023): the base Jacobian ``d phi / d lambda`` taken as ``J_u
    d_lambda g`` at the adapted weights (``-lr d_lambda g`` for SGD, whose ``J_u`` is
    ``-lr``), the inner Hessian dropped (identity), and ``J_u`` the inner optimizer's own
    update Jacobian, so Adam's per-entry scaling is kept ("Adam-aware"). The sign is the
    paper's ``-(du/dg) d_lambda g`` for a step written ``phi - u(g)``: here the update is
    added, so its minus sign is inside ``J_u``. Central differences as in :class:`T1T2`.

    Args:
        r: the difference's radius in weight space.
    """

    r: float = 0.01
    at_end: bool = dataclasses.field(default=True, init=False)
    name = "sama"


METHODS: dict[str, Callable[..., Method]] = {
    "unrolled": Unrolled,
    "truncated": Truncated,
    "implicit-cg": ImplicitCG,
    "neumann": Neumann,
    "t1t2": T1T2,
    "sama": SAMA,
}
"""The methods by the names ``metaddp verify`` and ``metaddp train`` use."""
