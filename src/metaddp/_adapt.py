"""The one differentiable inner step, shared by the per-task loop, the stacked executor and
the stateful learner.

A step takes this process's *share* of a support loss, differentiates it with respect to the
fast weights (keeping the graph for second order), passes the gradients through ``reduce``
(a differentiable SUM over the processes that split the task's samples, so the result is the
gradient of the global loss), and applies a pure inner optimizer out of place.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import overload

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _host
from ._binding import several_processes
from ._data import Batch, Shard
from ._functional import call, params_of
from ._share import own_share
from ._types import LossFn, Params, Reduce, identity_reduce
from .forward import keyed_forward
from .inner import InnerOptimizer, LossScale, State, TaskScale, apply_updates


@overload
def grad(
    loss: Tensor,
    params: Mapping[str, Tensor],
    *,
    reduce: Reduce | None = ...,
    create_graph: bool = ...,
    retain_graph: bool | None = ...,
) -> Params: ...
@overload
def grad(
    loss: Tensor,
    params: Sequence[Tensor],
    *,
    reduce: Reduce | None = ...,
    create_graph: bool = ...,
    retain_graph: bool | None = ...,
) -> list[Tensor]: ...
def grad(loss, params, *, reduce=None, create_graph=True, retain_graph=None):
    """The gradient of the *global* loss: ``torch.autograd.grad`` of a share, then ``reduce``.

    Args:
        loss: this process's share of a global mean loss (:func:`metaddp.share`).
        params: the tensors to differentiate by, as a dict (returns a dict with the same keys)
            or a sequence (returns a list).
        reduce: the SUM over the processes that split the batch (``MetaDDP.reduce``). It
            must be given on several processes (``identity_reduce`` for this rank's own
            gradient); on one process it defaults to the identity.
        create_graph: keep the graph of the gradient (second-order meta-gradients).
        retain_graph: keep ``loss``'s graph for a later backward. Defaults to
            ``create_graph``; a first-order step whose loss is used again (the question's
            ``(l1 + l2).backward()``) needs ``retain_graph=True``.

    Tensors that do not influence ``loss`` get a zero gradient (a process with an empty
    shard still takes part in the SUM).
    """
    named = isinstance(params, Mapping)
    tensors = list(params.values()) if named else list(params)
    if loss.dim() != 0:
        raise ValueError(
            f"expected a scalar loss, got shape {tuple(loss.shape)}: on several processes "
            "pass metaddp.share(per_sample_losses, batch), this process's share of the mean"
        )
    if reduce is None:
        reduce = _local_only("metaddp.functional.grad")
    with torch.enable_grad():
        grads = torch.autograd.grad(
            loss,
            tensors,
            create_graph=create_graph,
            retain_graph=retain_graph,
            allow_unused=True,
            materialize_grads=True,
        )
    by_name = getattr(reduce, "by_name", None)  # sharded weights: the others summed by name
    if named and by_name is not None:
        reduced = by_name(list(params), list(grads))
    else:
        reduced = reduce(list(grads))
    return dict(zip(params, reduced, strict=True)) if named else reduced


def _local_only(what: str) -> Reduce:
    """The identity, where no reduction was given: refused on several processes, where it
    would give every rank the gradient of its own shard instead of the task's."""
    if several_processes():
        raise ValueError(
            f"{what} runs on several processes without reduce=: pass learner.reduce (the SUM "
            "over the ranks that split a task's samples; learner.grad(...) does it), or "
            "metaddp.functional.identity_reduce for this rank's own gradient"
        )
    return identity_reduce


def finite_flags(tensors: Sequence[Tensor]) -> Tensor:
    """Whether each tensor is finite, as one bool tensor on the device (no host read).

    One multi-tensor kernel: the largest |entry| of a tensor is NaN or Inf exactly when the
    tensor has a non-finite entry (a max never overflows). Empty tensors are finite.
    """
    full = [t for t in tensors if t.numel()]
    if not full:
        return torch.ones(len(tensors), dtype=torch.bool)
    with torch.no_grad():  # a graph here would hold the gradients (and theirs) until read
        finite = torch.isfinite(torch.stack(torch._foreach_norm(full, ord=float("inf"))))
    if len(full) == len(tensors):
        return finite
    out = finite.new_ones(len(tensors))
    out[[i for i, t in enumerate(tensors) if t.numel()]] = finite
    return out


def check_finite(grads: Mapping[str, Tensor], step: int) -> None:
    """Raise :class:`FloatingPointError` naming the first non-finite gradient.

    Inside a meta-step the verdict waits on the device and is read once, at the step's end
    (:mod:`metaddp._host`): the error is the same, raised later in the step.
    """
    names = [k for k, g in grads.items() if g.numel()]
    if not names:
        return
    finite = finite_flags([grads[k] for k in names])

    def verdict(ok: list[float]) -> Exception | None:
        for name, fine in zip(names, ok, strict=True):
            if not fine:
                return FloatingPointError(
                    f"inner step {step}: the gradient of {name!r} is not finite (NaN or Inf); "
                    "lower the inner learning rate, check the support data and the loss "
                    "function (one that divides by a statistic of its batch, such as a "
                    "variance, is NaN on one sample: deterministic mode calls it on chunks of "
                    "a task's samples), or use adam(eps_root>0) if a second-order step divides "
                    "by a zero second moment"
                )
        return None

    _host.check(finite, verdict)


def check_finite_loss(loss: Tensor) -> None:
    """Raise :class:`FloatingPointError` if the meta-loss is not finite, as an inner gradient
    would (read with the step's other checks)."""
    if loss.numel() != 1:
        return
    with torch.no_grad():
        finite = torch.isfinite(loss.detach()).reshape(1)

    def verdict(ok: list[float]) -> Exception | None:
        return None if ok[0] else FloatingPointError(NON_FINITE_LOSS)

    _host.check(finite, verdict)


NON_FINITE_LOSS = (
    "the meta-loss is not finite (NaN or Inf): check the query data (a NaN target?), lower "
    "the inner learning rate, or look for a loss that divides by zero"
)


def inner_step(
    loss: Tensor,
    fast: Params,
    state: State,
    optimizer: InnerOptimizer,
    *,
    step: int,
    reduce: Reduce | None = None,
    first_order: bool = False,
    extra_grad: Callable[[Params], Params] | None = None,
    scale: TaskScale | None = None,
    check: Callable[[Params, int], None] | None = None,
) -> tuple[Params, State]:
    """One differentiable optimizer step on ``loss``; returns the next fast weights and state.

    The step of every path: the per-task loop (:func:`inner_steps`), deterministic mode's
    chunks, the rematerialised and replayed loops and the hypergradient methods' unrolls.

    Args:
        loss: this process's share of the support loss, computed from ``fast``.
        fast: the current fast weights (a dict of tensors on the meta-parameters' graph).
        state: the inner optimizer's state for ``fast``.
        optimizer: a differentiable inner optimizer (:func:`metaddp.inner.sgd`,
            :func:`metaddp.inner.adam`).
        step: the step's number, for error messages.
        reduce: SUM of gradients over the processes that split the task's samples (as
            :func:`grad`: required on several processes).
        first_order: treat the gradients as constants (no second-order terms).
        extra_grad: a term added after the reduction, a function of the fast weights that
            every process computes in full (iMAML's proximal term).
        scale: the task's running loss scale (:meth:`metaddp.inner.LossScale.start`), or ``None``.
            ``loss`` must then be computed from ``scale.watch(fast)``; the step
            differentiates ``scale.value * loss``, unscales, and is skipped where the reduced
            gradient is not finite (:func:`scaled_step`), instead of raising.
        check: called with the step's gradient (reduced, ``extra_grad`` added) and ``step``
            before the optimizer reads it; ``None``: :func:`check_finite`.
    """
    if scale is not None:
        return scaled_step(
            loss,
            fast,
            state,
            optimizer,
            scale,
            reduce=reduce,
            first_order=first_order,
            extra_grad=extra_grad,
        )
    grads = grad(loss, fast, reduce=reduce, create_graph=not first_order)
    if extra_grad is not None:
        extra = extra_grad(fast)
        grads = {k: g + extra[k] for k, g in grads.items()}
    (check_finite if check is None else check)(grads, step)
    updates, state = optimizer.update(grads, state, fast)
    return apply_updates(fast, updates), state


def scaled_step(
    loss: Tensor,
    fast: Params,
    state: State,
    optimizer: InnerOptimizer,
    scale: TaskScale,
    *,
    reduce: Reduce | None = None,
    first_order: bool = False,
    extra_grad: Callable[[Params], Params] | None = None,
) -> tuple[Params, State]:
    """:func:`inner_step` with dynamic loss scaling (:mod:`metaddp.inner._loss_scale`).

    The gradient of ``scale.value * loss`` by the watched fast weights, reduced, divided by
    the scale on the graph (a power of two: exact). Whether every reduced gradient is finite
    is one bool on the device, the same on every rank that splits the task; where it is
    false the gradients are replaced by zeros before the optimizer (no Inf or NaN enters its
    update, in the forward or the backward), the fast weights and the optimizer's tensor
    slots keep their old values, the watched inputs pass no gradient back (the discarded
    graph's ``0 * inf``) and the scale backs off. Nothing is read on the host.
    """
    watched = scale.watched(fast)
    scaled = grad(scale.value * loss, watched, reduce=reduce, create_graph=not first_order)
    grads = {k: g / scale.value for k, g in scaled.items()}
    finite = finite_flags(list(grads.values())).all()
    scale.settle(finite)
    grads = {k: torch.where(finite, g, g.new_zeros(())) for k, g in grads.items()}
    if extra_grad is not None:
        extra = extra_grad(fast)
        grads = {k: g + extra[k] for k, g in grads.items()}
    updates, new_state = optimizer.update(grads, state, fast)
    stepped = apply_updates(fast, updates)
    kept = {
        k: torch.where(finite, stepped[k], fast[k]) if k in updates else v
        for k, v in stepped.items()
    }
    return kept, _kept_state(finite, new_state, state)


def _kept_state(finite: Tensor, new: State, old: State) -> State:
    """``new`` where the step was kept, else ``old``, tensor by tensor; what is not a tensor
    (a step count, read on the host by bias corrections) is ``new``'s."""
    new_leaves, spec = tree_flatten(new)
    old_leaves, old_spec = tree_flatten(old)
    if spec != old_spec:
        raise TypeError(
            "a loss-scaled inner step keeps the optimizer's old state where it skips a step, "
            "but this optimizer's update changed the state's structure: use a metaddp inner "
            "optimizer, or loss_scale=None"
        )
    leaves = [
        torch.where(finite, n, o) if isinstance(n, Tensor) and isinstance(o, Tensor) else n
        for n, o in zip(new_leaves, old_leaves, strict=True)
    ]
    return tree_unflatten(leaves, spec)


StepLoss = Callable[[Params, int], Tensor]
"""``loss(fast, k)``: this process's share of inner step ``k``'s loss at ``fast``."""


def descend(
    loss: StepLoss,
    fast: Params,
    state: State,
    optimizer: InnerOptimizer,
    steps: Iterable[int],
    *,
    restart: Callable[[Params, State], tuple[Params, State]] | None = None,
    first_order: bool = False,
    reduce: Reduce | None = None,
    extra_grad: Callable[[Params], Params] | None = None,
    scale: TaskScale | None = None,
    check: Callable[[Params, int], None] | None = None,
) -> Iterator[tuple[Params, State]]:
    """The K-step loop, written once: for each ``k`` of ``steps``, :func:`inner_step` on
    ``loss(fast, k)``, yielding the weights and optimizer state after it. Every path's loop
    is this one: the per-task loop (:func:`inner_steps`), stacked tasks, deterministic mode's
    chunks, the hypergradient methods' unrolls and their steps without a graph.

    Args:
        restart: the steps keep no graph between them: each is taken first order with no
            graph of its own, and ``restart(fast, state)`` makes the next step's start
            (tensors that need a gradient with no path back).
        first_order, reduce, extra_grad, scale, check: as :func:`inner_step`.
    """
    for k in steps:
        with torch.enable_grad():
            share = loss(fast, k)
        with torch.set_grad_enabled(restart is None):
            fast, state = inner_step(
                share, fast, state, optimizer, step=k, reduce=reduce,
                first_order=first_order or restart is not None, extra_grad=extra_grad,
                scale=scale, check=check,
            )  # fmt: skip
        if restart is not None:
            fast, state = restart(fast, state)
        yield fast, state


def batch_share(
    model: nn.Module,
    params: Mapping[str, Tensor],
    batch: Batch,
    loss_fn: LossFn,
    buffers: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """This process's share of the mean loss of ``params`` over the whole (global) ``batch``.

    The forward's dropout masks are keyed by the batch's samples (:mod:`metaddp.forward`)."""
    with keyed_forward(batch):
        prediction = call(model, params, batch.x, buffers=buffers)
    return own_share(loss_fn(prediction, batch.y), batch)


StepInputs = Callable[[int], "tuple[Params, Mapping[str, Tensor] | None]"]
"""``at(step)``: the weights a step's forward reads besides the fast weights (MAML++'s
per-step BatchNorm weights) and the buffers it runs with (``None``: the model's own)."""


def inner_loop(
    model: nn.Module,
    params: Mapping[str, Tensor],
    support: Batch,
    loss_fn: LossFn,
    *,
    steps: int,
    optimizer: InnerOptimizer,
    first_order: bool = False,
    reduce: Reduce | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    extra_grad: Callable[[Params], Params] | None = None,
    loss_scale: LossScale | None = None,
    at: StepInputs | None = None,
) -> Params:
    """``steps`` differentiable optimizer steps on the support loss; returns the fast weights.

    Args:
        model: the network, called functionally on the fast weights.
        params: the weights to start from (names missing here keep the model's own).
        support: this process's shard of the support batch.
        loss_fn: per-sample loss (``reduction='none'``).
        steps: number of inner steps.
        optimizer: a differentiable inner optimizer (:func:`metaddp.inner.sgd`,
            :func:`metaddp.inner.adam`).
        first_order: treat inner gradients as constants (first-order MAML); otherwise they
            are built with ``create_graph=True`` and the meta-gradient is exact to second order.
        reduce: SUM of gradients over the processes sharing this task's samples.
        buffers: buffers to run the model with (default: its own).
        extra_grad: see :func:`inner_step`.
        loss_scale: dynamic loss scaling of every step (:class:`metaddp.inner.LossScale`), for
            float16 forward passes; its scale starts at ``init`` for this task.
        at: each step's other weights and buffers (:data:`StepInputs`).

    Returns:
        The adapted fast weights.
    """
    last = collections.deque(
        inner_steps(
            model,
            params,
            support,
            loss_fn,
            steps=steps,
            optimizer=optimizer,
            first_order=first_order,
            reduce=reduce,
            buffers=buffers,
            extra_grad=extra_grad,
            loss_scale=loss_scale,
            at=at,
        ),
        maxlen=1,
    )
    return last[0] if last else dict(params)


def inner_steps(
    model: nn.Module,
    params: Mapping[str, Tensor],
    support: Batch,
    loss_fn: LossFn,
    *,
    steps: int,
    optimizer: InnerOptimizer,
    first_order: bool = False,
    reduce: Reduce | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    extra_grad: Callable[[Params], Params] | None = None,
    loss_scale: LossScale | None = None,
    at: StepInputs | None = None,
) -> Iterator[Params]:
    """The per-task loop (:func:`descend` on the support share): yields the fast weights
    after each of ``steps`` inner steps, so that a caller scores every step (MAML++'s
    multi-step loss) or only the last (:func:`inner_loop`). Under loss scaling every tensor
    a step's forward reads that needs a gradient is watched
    (:meth:`metaddp.inner.TaskScale.watch`), ``at``'s weights too.

    Arguments as :func:`inner_loop`; ``at`` gives each step's other weights and buffers.
    """
    start: Params = dict(params)
    scale = None
    if loss_scale is not None and start:
        scale = loss_scale.start(next(iter(start.values())))

    def loss(fast: Params, step: int) -> Tensor:
        held, step_buffers = ({}, buffers) if at is None else at(step)
        weights, batch = {**fast, **held}, support
        if scale is not None:
            weights, batch = _watched_inputs(scale, model, weights, support)
        return batch_share(model, weights, batch, loss_fn, step_buffers)

    for fast, _ in descend(
        loss, start, optimizer.init(start), optimizer, range(steps), reduce=reduce,
        first_order=first_order, extra_grad=extra_grad, scale=scale,
    ):  # fmt: skip
        yield fast


def _watched_inputs(
    scale: TaskScale, model: nn.Module, fast: Params, support: Batch
) -> tuple[Params, Batch]:
    """What a scaled step's forward reads, watched (:meth:`TaskScale.watch`): the fast
    weights, the model's other trained parameters (BOIL's head, CAVIA's network) and support
    inputs computed from parameters (ANIL's features). A tensor the loss reads besides these
    (a learned weighting inside ``loss_fn``) is not watched: a skipped step may give it NaN."""
    held = {k: p for k, p in params_of(model).items() if k not in fast}
    weights = scale.watch({**held, **fast})
    if not support.x.requires_grad:
        return weights, support
    x = scale.watch({"x": support.x})["x"]
    if isinstance(support, Shard):
        return weights, Shard.at(x, support.y, support.n, support.start)
    return weights, support._replace(x=x)
