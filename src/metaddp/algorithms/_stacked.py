"""MAML over a whole meta-batch at once: fast weights stacked along a leading task dimension.

The per-task loop runs ``T`` small forwards and ``T`` inner ``autograd.grad`` calls per inner
step. Here the fast weights of the ``T`` tasks are one tensor per parameter, of shape
``[T, *shape]``; the forward is ``torch.vmap`` of :func:`metaddp.functional.call` over tasks;
and one ``autograd.grad`` of the *sum* of the per-task support shares gives every task's inner
gradient at once. That is exact, not an approximation: task ``t``'s share depends only on
row ``t`` of the stacked weights, so

    d(sum_u share_u) / d W[t] = d share_t / d W[t],

the same per-task gradient the loop computes (with ``create_graph=True`` the second-order
terms are kept too). The sample-axis ``reduce`` then runs once per inner step on the stacked
gradients of all tasks, instead of once per task. Rows are independent, so a SUM over ranks
of the stacked gradients is each task's SUM.

Finn, Abbeel & Levine, "Model-Agnostic Meta-Learning", ICML 2017, arXiv:1703.03400.
``torch.vmap``: https://pytorch.org/docs/stable/generated/torch.vmap.html
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import forward as _draws
from .._adapt import check_finite, descend
from .._binding import sharding_of
from .._data import Batch, Task
from .._functional import call, drawn_at, random_layers
from .._remat import Replay, rematerialized_loss
from .._share import check_per_sample, own_share
from .._types import LossFn, Params, Reduce
from ..forward import needs_routes
from ..inner import InnerOptimizer, State
from ._conv_ways import GROUPED, ConvChoice
from ._layers import has_convolutions, stacked_layers
from ._running import TaskStatistics, tracking


def _signature(batch: Batch) -> tuple:
    return (tuple(batch.x.shape), batch.x.dtype, tuple(batch.y.shape), batch.y.dtype, batch.n)


def batchable(tasks: Sequence[Task]) -> str | None:
    """``None`` when ``tasks`` can be stacked along a task dimension, else the reason why not.

    Stacking needs every task's local support shard to have one shape, dtype and global size,
    and likewise every query shard (true whenever the global tasks share their sizes).
    """
    if not tasks:
        return "there are no tasks"
    if any(t.support.n < 1 or t.query.n < 1 for t in tasks):
        return "a task has no support or no query samples"
    s0, q0 = _signature(tasks[0].support), _signature(tasks[0].query)
    for i, t in enumerate(tasks[1:], 1):
        if _signature(t.support) != s0:
            return f"task {i}'s support shard {_signature(t.support)} differs from task 0's {s0}"
        if _signature(t.query) != q0:
            return f"task {i}'s query shard {_signature(t.query)} differs from task 0's {q0}"
    return None


def _start(batches: Sequence[Batch]) -> int | None:
    """Where the samples of every batch's shard start, where it is one place (it is, for
    tasks of one size cut alike), else ``None`` (dropout is then refused)."""
    starts = {_draws.batch_start(b) for b in batches}
    return starts.pop() if len(starts) == 1 else None


def _stack(batches: Sequence[Batch]) -> tuple[Tensor, Tensor, int]:
    return torch.stack([b.x for b in batches]), torch.stack([b.y for b in batches]), batches[0].n


def stacked_shares(
    model: nn.Module,
    params: Mapping[str, Tensor],
    x: Tensor,
    y: Tensor,
    n: int,
    loss_fn: LossFn,
    buffers: Mapping[str, Tensor] | None = None,
    conv: ConvChoice = GROUPED,
    start: int | None = None,
) -> Tensor:
    """Per-task shares ``[T]`` of stacked weights ``params[k]: [T, ...]`` on
    ``x: [T, n_local, ...]``, forward convolutions run the way ``conv`` gives; ``buffers``,
    when given, are per task too (``[T, ...]``: :class:`TaskStatistics`'s copies, which the
    forwards move in place).

    Returns:
        ``out[t] = sum_i loss(f(W[t], x[t, i]), y[t, i]) / n`` (this rank's share of task t's
        mean over its ``n`` global samples).
    """

    # A loss function still to be checked per sample (``PerSampleCheck``, which cannot check
    # under torch.vmap) is given the first task's predictions after it: those of this very
    # forward, so the check costs no forward and no collective (ranks decide on it alone).
    probe = getattr(loss_fn, "probe", None) if getattr(loss_fn, "probing", False) else None

    def one(p: Mapping[str, Tensor], xt: Tensor, yt: Tensor, b: Params | None, slot: Any):
        # Dropout keyed by each task's own keys (metaddp.forward), ``start`` the global index
        # of the first sample every task's shard holds; ``slot``, the task's position, only
        # for a model whose forward may draw (no operation more for the others).
        with _draws.stacked_forward(slot, start, xt.shape[0]):
            prediction = call(model, p, xt, buffers=b)
        losses = loss_fn(prediction, yt)
        check_per_sample(losses, xt.shape[0])  # shapes are a task's own under vmap
        shared = own_share(losses, n)
        if probe is None or not isinstance(prediction, Tensor):
            return shared, shared
        return shared, prediction.detach()

    with stacked_layers(model, conv):
        try:
            slots = torch.arange(x.shape[0], device=x.device) if needs_routes(model) else None
            dims = (0, 0, 0, None if buffers is None else 0, None if slots is None else 0)
            shares, predictions = torch.vmap(one, in_dims=dims)(
                dict(params), x, y, None if buffers is None else dict(buffers), slots
            )
        except RuntimeError as e:
            if "random operation" not in str(e):
                raise
            raise RuntimeError(
                "the model or the loss function draws random numbers in the forward "
                f"({drawn_at(e)}): stacked tasks cannot draw them. On one process, build the "
                "algorithm with batched=False to adapt the tasks one by one; under MetaDDP, "
                "where each process would draw its own, remove the draw (dropout: set it to 0 "
                "or call model.eval())"
            ) from e
    if probe is not None and predictions.dim() > 1 and x.shape[1]:  # [T, n, ...], not shares
        probe(predictions[0], y[0])
    return shares


_TENSOR = object()  # marks where a state's tensor leaves go back


def per_task(
    optimizer: InnerOptimizer | Callable[[Params | None], InnerOptimizer],
    n: int,
    rates: Params | None = None,
) -> InnerOptimizer:
    """``optimizer`` applied to each task's row of stacked ``[n, *shape]`` weights.

    ``update`` runs under ``torch.vmap``, so the optimizer sees one task's shapes: a
    per-entry learning rate of the parameter's shape, a shape check, or a norm over a whole
    tensor mean what they mean in the loop. Tensor leaves of the state get the task
    dimension; other leaves (step counters) are shared, as they are equal for every task.

    With ``rates`` (learned rates stacked ``[n, ...]`` by parameter name, one copy per task),
    ``optimizer`` builds a task's optimizer from its row of them.

    A ``rowwise`` optimizer (``sgd`` or ``adam`` with plain rates: its update is entry by
    entry) is its own per-task form, returned as it is: the same bits without ``vmap``'s cost
    per call (BENCHMARKS.md).
    """
    if isinstance(optimizer, InnerOptimizer):
        built = optimizer
        build: Callable[[Params | None], InnerOptimizer] = lambda r: built  # noqa: E731
    else:
        build = optimizer
    if rates is None and (plain := build(None)).rowwise:
        return plain

    def init(params: Params) -> State:
        # Every task starts from the same weights, so task 0's state is every task's.
        row0 = None if rates is None else {k: v[0] for k, v in rates.items()}
        state = build(row0).init({k: v[0] for k, v in params.items()})
        leaves, spec = tree_flatten(state)
        return tree_unflatten(
            [
                leaf.unsqueeze(0).expand(n, *leaf.shape) if isinstance(leaf, Tensor) else leaf
                for leaf in leaves
            ],
            spec,
        )

    def update(grads: Params, state: State, params: Params) -> tuple[Params, State]:
        leaves, spec = tree_flatten(state)
        tensor_leaves = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
        out: dict = {}

        def one(g: Params, p: Params, ts: list[Tensor], r: Params | None):
            it = iter(ts)
            st = tree_unflatten(
                [next(it) if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec
            )
            updates, new = build(r).update(g, st, p)
            new_leaves, out["spec"] = tree_flatten(new)
            out["other"] = [_TENSOR if isinstance(leaf, Tensor) else leaf for leaf in new_leaves]
            return updates, [leaf for leaf in new_leaves if isinstance(leaf, Tensor)]

        updates, new_tensors = torch.vmap(one, in_dims=(0, 0, 0, None if rates is None else 0))(
            dict(grads), dict(params), tensor_leaves, None if rates is None else dict(rates)
        )
        it = iter(new_tensors)
        new = tree_unflatten(
            [next(it) if leaf is _TENSOR else leaf for leaf in out["other"]], out["spec"]
        )
        return updates, new

    return InnerOptimizer(init, update)


def stacked_task_losses(
    model: nn.Module,
    params: Mapping[str, Tensor],
    tasks: Sequence[Task],
    loss_fn: LossFn,
    *,
    steps: int,
    optimizer: InnerOptimizer | Callable[[], InnerOptimizer],
    first_order: bool = False,
    reduce: Reduce,
    rematerialize: bool = False,
    replay: Replay | None = None,
    extras: Sequence[Tensor] = (),
    conv: ConvChoice = GROUPED,
    step_weights: Sequence[float] | None = None,
) -> Tensor:
    """Sum over ``tasks`` of their query shares after ``steps`` inner steps.

    The same value and the same meta-gradient as adapting each task in a loop
    (:func:`metaddp.functional.inner_loop` then a query share), computed with the tasks stacked.

    Args:
        model: the network, evaluated functionally (never mutated).
        params: the meta-parameters (the weights every task starts from).
        tasks: this rank's tasks; :func:`batchable` must accept them.
        loss_fn: per-sample loss, ``reduction='none'``.
        steps: inner steps.
        optimizer: differentiable inner optimizer, applied to each task (:func:`per_task`), or
            a function of nothing that builds it (on rates computed from ``extras``):
            ``rematerialize`` builds it for each step.
        first_order: treat inner gradients as constants.
        reduce: differentiable SUM of the inner gradients over the ranks sharing the tasks'
            samples (identity on one process); called once per inner step for all tasks.
        rematerialize: second order in memory that does not grow with ``steps``
            (``memory="low"``, :mod:`metaddp._remat`), for all tasks at once.
        replay: with ``rematerialize``, the tree of kept states (``memory=Replay(...)``).
        extras: what the optimizer reads that needs a gradient (learned rates), with
            ``rematerialize``.
        conv: how the stacked forward convolutions run (:class:`ConvChoice`).
        step_weights: MAML++'s multi-step loss: the query shares after every inner step,
            step ``i``'s weighed by ``step_weights[i]``, in place of the last step's alone.

    Returns:
        A scalar: the sum of this rank's query shares of its tasks.
    """
    why = batchable(tasks)
    if why is not None:
        raise ValueError(f"cannot stack these tasks along a task dimension: {why}")
    names = list(params)
    n_local = len(tasks)
    sx, sy, sn = _stack([t.support for t in tasks])
    qx, qy, qn = _stack([t.query for t in tasks])
    s0, q0 = _start([t.support for t in tasks]), _start([t.query for t in tasks])
    # expand() is a view: every task starts from the meta-parameters, and the gradient flowing
    # back through it into params[k] is the sum over tasks, as in the loop.
    fast: Params = {k: params[k].unsqueeze(0).expand(n_local, *params[k].shape) for k in names}
    build = (lambda o=optimizer: o) if isinstance(optimizer, InnerOptimizer) else optimizer
    optimizer = per_task(build(), n_local)
    stats = TaskStatistics(model, n_local) if tracking(model) else None
    remat = rematerialize and not first_order and torch.is_grad_enabled()
    if stats is not None and remat:
        raise ValueError(
            "memory='low' with stacked tasks rebuilds one stacked step at a time, without "
            "running statistics: for BatchNorm layers that track them use batched=False (or "
            "None), which rebuilds each task's steps on copies of them"
        )
    buffers = None if stats is None else stats.copies
    if remat:
        assert step_weights is None  # MAML++ takes no memory mode
        # memory="low": every task's steps at once, one stacked step's graph at a time.
        return rematerialized_loss(
            lambda w, _, __: stacked_shares(
                model, w, sx, sy, sn, loss_fn, conv=conv, start=s0
            ).sum(),
            lambda w, _: stacked_shares(model, w, qx, qy, qn, loss_fn, conv=conv, start=q0).sum(),
            fast,
            steps=steps,
            optimizer=lambda: per_task(build(), n_local),
            reduce=reduce,
            extras=list(extras),
            check=check_finite,
            replay=replay,
        )
    weighted: Tensor | None = None

    def loss(w: Params, step: int) -> Tensor:
        # Task t's share depends on row t only, so the gradient of the sum is every task's
        # own gradient, row by row (module docstring).
        return stacked_shares(model, w, sx, sy, sn, loss_fn, buffers, conv=conv, start=s0).sum()

    loop = descend(
        loss, fast, optimizer.init(fast), optimizer, range(steps), reduce=reduce,
        first_order=first_order,
    )  # fmt: skip
    with torch.enable_grad():
        for step, (fast, _) in enumerate(loop):
            if step_weights is not None and (w := step_weights[step]):
                q = stacked_shares(model, fast, qx, qy, qn, loss_fn, buffers, conv=conv, start=q0)
                weighted = w * q.sum() if weighted is None else weighted + w * q.sum()
        if step_weights is None:
            out = stacked_shares(model, fast, qx, qy, qn, loss_fn, buffers, conv=conv, start=q0)
            out = out.sum()
        else:
            assert weighted is not None  # the last weight is never 0
            out = weighted
    if stats is not None:
        stats.commit()  # the layers' statistics as the loop leaves them
    return out


def use_batched(batched: bool | None, tasks: Sequence[Task], model: nn.Module) -> bool:
    """Whether to run ``tasks`` stacked (:func:`stacked_task_losses`) or one by one.

    Args:
        batched: ``True`` forces stacking (an error if the tasks cannot be stacked),
            ``False`` forces the loop, ``None`` chooses by measurement (BENCHMARKS.md):
            stacked on CUDA, where one batched kernel replaces many launch-bound small ones,
            and on CPU for models without convolutions (a sinusoid MLP meta-step measured
            tens of times faster stacked); the loop on CPU for convolutional models, whose
            vmapped convolutions measured slower there; the loop for models with buffers
            (running statistics: ``True`` stacks them too, moved as the loop moves them,
            :mod:`metaddp.algorithms._running`), for
            models with dropout layers in training mode (``vmap`` draws no random numbers),
            models whose forward may call attention or dropout (``needs_routes``: the loop
            keys each task's masks) and for tasks of different sizes. BatchNorm with batch
            statistics only (MAML's) is stacked like any layer, synchronized or not.
            Sharded meta-parameters stack as replicated ones (their gathers run under
            ``vmap`` for every task at once), except where graphs keep some gathered weight
            as its rows (one of ``unit_bytes`` or more), which stacked graphs keep whole:
            there the loop.
        tasks: this rank's tasks.
        model: the network.
    """
    if batched is False or not tasks:
        return False
    sharding = sharding_of(model)
    if batched is None and sharding is not None and sharding.keeps_rows():
        # Sharded weights large enough to be kept as rows in graphs: stacked tasks keep them
        # whole (metaddp.distributed._sharded), T copies per forward; the loop keeps rows.
        return False
    if batched is None and needs_routes(model):
        # Attention or dropout inside the forward: the loop keys dropout by each task's
        # samples (metaddp.forward), and runs attention on metaddp's own kernel.
        return False
    if batched is None and random_layers(model):
        return False
    why = batchable(tasks)
    if batched:
        if why is not None:
            raise ValueError(
                f"batched=True, but these tasks cannot be stacked along a task dimension: {why}. "
                "Give every task the same support and query sizes, or use batched=None to fall "
                "back to the per-task loop automatically."
            )
        return True
    if why is not None or any(True for _ in model.buffers()):
        # Buffers (BatchNorm's running statistics) are moved per task, in the loop's order;
        # stacked, they need a copy per task and a fold afterwards (metaddp.algorithms.
        # _running), so only batched=True takes it. BatchNorm without them (MAML's own: batch
        # statistics, per task) stacks: a synchronized layer's one SUM carries every task's
        # statistics at once.
        return False
    if tasks[0].support.x.device.type == "cuda":
        return True
    return not has_convolutions(model)
