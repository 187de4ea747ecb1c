"""iMAML: meta-gradients through the proximal inner problem by implicit differentiation.

Rajeswaran, Finn, Kakade & Levine, "Meta-Learning with Implicit Gradients", NeurIPS 2019,
arXiv:1909.04630. The task's weights solve ``phi = argmin L_s(phi) + lam/2 ||phi - theta||^2``
(approximately, by the inner optimizer). At that solution ``d phi / d theta =
(I + H_s(phi) / lam)^-1``, so the meta-gradient of the query loss is ``v`` solving

    (I + H_s(phi) / lam) v = g_q,      g_q = grad L_q(phi),

found by conjugate gradient (Hestenes & Stiefel 1952) from Hessian-vector products alone.

Across ranks: ``L_s`` and ``L_q`` are global means; each Hessian-vector product is this
rank's share's product passed through ``reduce``, i.e. the global one, and ``g_q`` is
reduced the same way. Every vector CG builds is therefore the global one and the same, bit
for bit, on every rank that shares the task, so each dot product computed from them already
*is* the global dot product and every rank takes the same number of CG steps: the implicit
gradient equals the single-process one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .._adapt import batch_share
from .._data import Task, positive
from .._functional import whole
from .._remat import Replay
from .._types import LossFn, Params, Reduce, Supports
from ..inner import InnerOptimizer
from ._base import Algorithm, OptimizerFactory, local_fraction, own_loss
from ._exact import Adapted, batched_conjugate_gradient, task_dot
from ._hypergrad import (
    PROXIMAL_ADVICE,
    Vectors,
    conjugate_gradient,
    dot_of,
    hessian_products,
    warn_unconverged,
)


class IMAML(Algorithm):
    """Implicit MAML around any ``nn.Module``.

    Args:
        model: the network; its parameters are the meta-parameters.
        lam: strength of the proximal term ``lam/2 ||phi - theta||^2`` (the paper's lambda).
        inner_lr, steps, optimizer: the inner optimizer run on the proximal objective.
        cg_steps: the conjugate-gradient budget (Hessian-vector products per task).
        cg_tol: relative residual at which CG stops.
        memory: any of :class:`metaddp.MAML`'s modes: the proximal steps are first order, so
            the default loop's memory does not grow with them, and every mode runs it.
        batched: ``None`` or ``False``; ``True`` is refused (stacked tasks are MAML's loss).

    :meth:`meta_loss` returns the query loss share, with a gradient that is the implicit
    meta-gradient (weighted by this rank's fraction of the query samples, so the SUM over
    ranks counts every task once). :attr:`last_cg` holds ``(residual, iterations)`` of the
    latest solve.
    """

    # The conjugate gradient reads its residual on the host at every iteration. memory="low":
    # the proximal steps are first order and the solve needs the last point's graph only, so
    # the default loop's memory does not grow with the steps (nothing to rebuild).
    supports: ClassVar[Supports] = Supports(
        deterministic=True, capture=False, sharded=True, low_memory=True,
        why=(own_loss("iMAML's (a proximal loop, then conjugate gradient)"),),
    )  # fmt: skip

    def __init__(
        self,
        model: nn.Module,
        *,
        lam: float = 1.0,
        inner_lr: float = 0.01,
        steps: int = 5,
        optimizer: InnerOptimizer | OptimizerFactory | None = None,
        cg_steps: int = 10,
        cg_tol: float = 1e-10,
        memory: str | Replay = "default",
        batched: bool | None = None,
    ) -> None:
        lam = positive(lam, "the proximal strength lam")
        cg_steps = positive(cg_steps, "cg_steps", integer=True)
        cg_tol = positive(cg_tol, "cg_tol")
        super().__init__(
            model, inner_lr=inner_lr, steps=steps, first_order=True, optimizer=optimizer,
            memory=memory, batched=batched,
        )  # fmt: skip
        self.lam, self.cg_steps, self.cg_tol = float(lam), int(cg_steps), float(cg_tol)
        self.last_cg: tuple[float, int] = (0.0, 0)

    def settings(self) -> dict[str, object]:
        return dict(super().settings(), lam=self.lam, cg_steps=self.cg_steps, cg_tol=self.cg_tol)

    def extra_grad(self) -> Callable[[Params], Params]:
        """The gradient of the proximal term ``lam/2 ||phi - theta||^2`` at ``phi``, added to
        every inner step's (a constant: iMAML's inner steps are first order), so that
        :meth:`adapt` and ``clone()`` step on the objective :meth:`meta_loss` does."""
        lam = self.lam
        theta = {k: p.detach() for k, p in self.fast_weights().items()}
        return lambda fast: {k: lam * (fast[k].detach() - theta[k]) for k in theta}

    def solve(
        self, task: Task, loss_fn: LossFn, *, reduce: Reduce | None = None
    ) -> tuple[Params, Tensor]:
        """The implicit meta-gradient of one task (global, identical on every rank) and this
        rank's share of its query loss (detached)."""
        reduce = self.collectives(reduce).reduce
        theta = {k: p.detach() for k, p in self.fast_weights().items()}
        names = list(theta)
        lam = self.lam
        start = {k: p.clone().requires_grad_() for k, p in theta.items()}
        phi = self.inner_loop(
            task.support, loss_fn, reduce=reduce, start=start, extra_grad=self.extra_grad()
        )
        phi = {k: p.detach().requires_grad_() for k, p in phi.items()}
        phis = [phi[k] for k in names]
        with torch.enable_grad():
            q = batch_share(self.model, phi, task.query, loss_fn)
            g_q = reduce(
                list(torch.autograd.grad(q, phis, allow_unused=True, materialize_grads=True))
            )
            s = batch_share(self.model, phi, task.support, loss_fn)
        _, hvp = hessian_products(s, phis, reduce)  # the global Hessian's products

        def matvec(v: Vectors) -> Vectors:
            return [vi + h / lam for vi, h in zip(v, hvp(v), strict=True)]

        v, residual, iters = conjugate_gradient(
            matvec,
            [g.detach() for g in g_q],
            max_iter=self.cg_steps,
            tol=self.cg_tol,
            what="iMAML conjugate gradient",
            dot=dot_of(reduce),
        )
        self.last_cg = (residual, iters)
        return dict(zip(names, v, strict=True)), q.detach()

    def task_loss(self, task: Task, loss_fn: LossFn, *, reduce: Reduce) -> Tensor:
        grad, q = self.solve(task, loss_fn, reduce=reduce)
        w = local_fraction(task.query)
        # Whole weights where they are sharded: every rank's share reaches every row (the
        # gather's adjoint sums the shares), as it would in a forward.
        theta = dict(whole(self.model, self.fast_weights()))
        grad = dict(whole(self.model, grad))
        # Value: the query share; gradient: w * (implicit meta-gradient).
        return q + w * sum(((theta[k] - theta[k].detach()) * grad[k]).sum() for k in theta)

    def exact_meta_loss(
        self, tasks: Sequence[Task], loss_fn: LossFn, n_tasks: int, sums: Any
    ) -> Tensor:
        """Deterministic mode: the proximal inner loop, the query gradient and every
        Hessian-vector product on the chunks of :mod:`metaddp.algorithms._exact` (each sum
        order-free), every local task's conjugate gradient run at once, each stopping where
        it would alone; the implicit meta-gradients summed over the task axis."""
        optimizer, lam = self.inner_optimizer(), self.lam
        adapted = Adapted(self.model, self.fast_weights(), tasks, loss_fn, sums=sums)
        if not adapted.n_local:  # the value's sum is detached on every rank, as below
            loss = sums.total(adapted.nothing().detach())
            return loss + sums.total_tasks(adapted.nothing())
        theta = {k: t.detach() for k, t in adapted.start.items()}
        adapted.run(
            self.steps,
            True,
            lambda rates: optimizer,
            extra_grad=lambda fast: {k: lam * (fast[k].detach() - theta[k]) for k in theta},
        )
        phi = {k: t.detach().requires_grad_() for k, t in adapted.fast.items()}
        values, g_q = adapted.gradient("query", phi)
        _, g_s = adapted.gradient("support", phi, create_graph=True)

        def matvec(v: list[Tensor]) -> list[Tensor]:
            with torch.enable_grad():
                hv = torch.autograd.grad(
                    g_s, list(phi.values()), grad_outputs=v, retain_graph=True,
                    allow_unused=True, materialize_grads=True,
                )  # fmt: skip
            return [vi + h / lam for vi, h in zip(v, hv, strict=True)]

        v, residual, iters = batched_conjugate_gradient(
            matvec,
            [g.detach() for g in g_q],
            max_iter=self.cg_steps,
            tol=self.cg_tol,
            what="iMAML conjugate gradient",
            advice=PROXIMAL_ADVICE,
        )
        warn_unconverged("iMAML conjugate gradient", self.cg_steps, residual, self.cg_tol)
        self.last_cg = (residual, iters)
        # Value: the query loss; gradient: the implicit meta-gradient, summed over the tasks.
        start = [adapted.start[k] for k in theta]
        per = task_dot([s - s.detach() for s in start], v) / n_tasks
        return sums.total(values.detach() / n_tasks) + sums.total_tasks(per)
