"""MAML in deterministic mode: the same bits on any number of processes.

A float sum depends on the order of its additions, and kernels sum over whatever samples a
process holds: so the default mode agrees across process counts only to rounding. Here the
order of every sum is fixed by the problem, not by the split:

* every batch is cut by global index into chunks (:class:`metaddp.data.Chunks`); a process holds
  whole chunks. Each chunk runs with its own copy of the weights, all chunks of a process in
  one ``torch.vmap`` call, so every chunk's gradient is computed alone, by the same kernels,
  whichever process holds it and whatever else it holds (short chunks are padded and
  masked, so every chunk has one shape);
* every sum over chunks, tasks or processes (inner gradients, BatchNorm statistics, the loss,
  the meta-gradient) is the mesh's order-free sum (``sums``: fixed point, added exactly),
  reached through copies whose adjoint it is, so the backward sums in the same way.

The values every process holds alike are therefore equal bit for bit, and so is the
meta-gradient, which is complete on every process when the backward ends. This module never
knows about ranks: it asks ``sums`` for copies and sums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from .. import _mask, forward
from .._adapt import descend
from .._data import Batch, Chunks, Task
from .._functional import call
from .._share import check_per_sample, one_per_sample
from .._types import LossFn, Params, identity_reduce
from ..inner import InnerOptimizer
from ._layers import stacked_layers
from ._stacked import per_task

NO_BUFFERS = (
    "deterministic mode cannot run models with buffers (BatchNorm's running statistics are "
    "updated in place per task): build BatchNorm layers with track_running_stats=False, as "
    "MAML does"
)


class Sums(Protocol):
    """What the executor asks of the processes (``metaddp.distributed.ExactSums``)."""

    def cut(self, n: int) -> Chunks: ...
    def spread_tasks(self, tensors: Sequence[Tensor], n_local: int) -> list[Tensor]: ...
    def spread_units(self, tensors: Sequence[Tensor], width: int) -> list[Tensor]: ...
    def gather_units(self, tensors: Sequence[Tensor]) -> list[Tensor]: ...
    def total(self, values: Tensor) -> Tensor: ...
    def total_tasks(self, values: Tensor) -> Tensor: ...
    def units(self, tasks: int, width: int) -> Any: ...


def _chunked(batches: Sequence[Batch], chunks: Chunks) -> tuple[Tensor, Tensor, Tensor, int]:
    """This rank's chunks of every task, padded to one shape: ``x [T*m, size, ...]``,
    ``y``, ``mask [T*m, size]`` and ``m`` (a rank without chunks gets one empty chunk)."""
    held = len(chunks.samples)
    for i, b in enumerate(batches):
        if b.n != chunks.n or b.x.shape[0] != held:
            raise ValueError(
                f"deterministic mode: task {i}'s shard holds {b.x.shape[0]} of {b.n} samples, "
                f"but the chunks cut for the first task's batch of {chunks.n} hold {held} here: "
                "every task's batch is cut alike. Cut meta-batches "
                "with learner.shard(...), which cuts every batch into whole chunks, and give "
                "every task the same support and query sizes"
            )
    width, size, n_local = max(len(chunks.mine), 1), chunks.size, len(batches)
    x, y = torch.stack([b.x for b in batches]), torch.stack([b.y for b in batches])
    pad = width * size - held  # only the batch's last chunk is short, or none is held
    mask = x.new_ones(width * size, dtype=torch.float32)
    if pad:
        mask[held:] = 0
        # Padding repeats a real target where there is one (any valid class), else zeros;
        # its loss is multiplied by zero.
        fill = y[:, :1] if held else y.new_zeros((n_local, 1, *y.shape[2:]))
        x = torch.cat([x, x.new_zeros((n_local, pad, *x.shape[2:]))], 1)
        y = torch.cat([y, fill.expand(n_local, pad, *y.shape[2:])], 1)
    return (
        x.reshape(n_local * width, size, *x.shape[2:]),
        y.reshape(n_local * width, size, *y.shape[2:]),
        mask.view(1, width, size).expand(n_local, width, size).reshape(-1, size),
        width,
    )


def _chunk_values(
    model: nn.Module,
    weights: Mapping[str, Tensor],
    x: Tensor,
    y: Tensor,
    mask: Tensor,
    loss_fn: LossFn,
    divisor: float,
    starts: list[int],
    width: int,
) -> Tensor:
    """Every chunk's sum of its samples' losses over ``divisor`` (``[U]``), chunks vmapped.
    ``starts``: each chunk's first global sample (its dropout masks are those samples'),
    ``width`` chunks of each task in a row."""

    # A loss function still to be checked per sample (PerSampleCheck, which cannot check
    # under torch.vmap) is given the first chunk's predictions after it: a statistic of its
    # batch would be one of a chunk's, on any number of processes.
    probe = getattr(loss_fn, "probe", None) if getattr(loss_fn, "probing", False) else None

    def one(w: Mapping[str, Tensor], xc: Tensor, yc: Tensor, mc: Tensor, slot: Any) -> Any:
        with _mask.sample_mask(mc), forward.stacked_forward(slot, starts, xc.shape[0], width):
            prediction = call(model, w, xc)
            per = loss_fn(prediction, yc)
        check_per_sample(per, xc.shape[0])
        per = one_per_sample(per)
        value = (per * mc.to(per.dtype)).sum() / divisor
        if probe is None or not isinstance(prediction, Tensor):
            return value
        return value, prediction.detach()

    # A slot per chunk for a model that may draw only: the others dispatch nothing more.
    slots = torch.arange(x.shape[0], device=x.device) if forward.needs_routes(model) else None
    with stacked_layers(model):
        out = torch.vmap(one, in_dims=(0, 0, 0, 0, None if slots is None else 0))(
            dict(weights), x, y, mask, slots
        )
    if not isinstance(out, tuple):
        return out
    values, predictions = out
    assert probe is not None
    held = mask[0].bool()  # the first chunk's own samples, not its padding
    probe(predictions[0][held], y[0][held])
    return values


class Adapted:
    """Every local task's fast weights in deterministic mode: a copy per task
    (``fast[k]: [T, ...]``) of the meta-parameters, then of the weights after the inner loop
    (:meth:`run`), the same bits on every rank that holds the task.

    Args:
        model: the network, evaluated functionally on chunk copies of the weights.
        params: the fast weights' starts (the meta-parameters the inner loop adapts).
        tasks: this rank's tasks, every batch cut into whole chunks (``sums.cut``).
        sums: the processes' copies and sums.
        rates: the learned rates by parameter name (``None`` without them).
        held: trained parameters the inner loop reads but does not adapt (BOIL's head,
            CAVIA's network, ANIL's body): copied to every chunk like the fast weights, so
            their meta-gradient is summed order-free too.
        extra: names of fast weights each task starts from a value of its own, given to
            :meth:`run` (ProtoMAML's head, made from the task's prototypes).
    """

    def __init__(
        self,
        model: nn.Module,
        params: Params,
        tasks: Sequence[Task],
        loss_fn: LossFn,
        *,
        sums: Sums,
        rates: Params | None = None,
        held: Params | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        if any(n not in params and n not in extra for n, _ in model.named_buffers()):
            raise ValueError(NO_BUFFERS)
        held = dict(held or {})
        self.model, self.loss_fn, self.sums, self.tasks = model, loss_fn, sums, tasks
        self.names, self.kept = list(params), list(held)
        # The rates' distinct tensors (one scalar may serve every parameter), each spread once.
        rate_leaves = list({id(r): r for r in (rates or {}).values()}.values())
        self.n_local = n_local = len(tasks)
        names, kept = self.names, self.kept
        copies = sums.spread_tasks(
            [params[k] for k in names] + [held[k] for k in kept] + rate_leaves, n_local
        )
        self.copies = copies
        self.start: Params = dict(zip(names, copies[: len(names)], strict=True))
        self.fast = self.start
        self.fixed = dict(zip(kept, copies[len(names) : len(names) + len(kept)], strict=True))
        self.rates = None
        if rates is not None:
            leaves = copies[len(names) + len(kept) :]
            spread_of = {id(r): c for r, c in zip(rate_leaves, leaves, strict=True)}
            self.rates = {k: spread_of[id(r)] for k, r in rates.items()}

    def run(self, *args: Any, **kwargs: Any) -> Params:
        """The weights after every step of :meth:`stepping` (its arguments)."""
        for _ in self.stepping(*args, **kwargs):
            pass
        return self.fast

    def stepping(
        self,
        steps: int,
        first_order: bool,
        build: Callable[[Params | None], InnerOptimizer],
        extra: Params | None = None,
        extra_grad: Callable[[Params], Params] | None = None,
    ) -> Iterator[Params]:
        """``steps`` inner steps from the start (and ``extra``'s per-task starts), every
        inner gradient summed over the chunks order-free (``extra_grad(fast)`` added to it:
        iMAML's proximal term), yielding the weights after each (MAML++'s multi-step loss);
        a rank without tasks yields as often, so that every rank scores as many losses."""
        if not self.n_local:
            for _ in range(steps):
                yield self.fast
            return
        n_local, sums = self.n_local, self.sums
        start = {**self.start, **(extra or {})}
        optimizer = per_task(build, n_local, self.rates)
        support = sums.cut(self.tasks[0].support.n)
        sx, sy, sm, sw = _chunked([t.support for t in self.tasks], support)
        # By each task's weights: the chunk copies' backward sums their gradients order-free
        # (so no reduce follows), and a start made from another (ProtoMAML's head, from the
        # body's prototypes) passes its part on, as in the tasks-one-by-one loop.
        for fast, _ in descend(
            lambda w, _: self.values(w, sw, sx, sy, sm, support.n, support)[1].sum(),
            start, optimizer.init(start), optimizer, range(steps), reduce=identity_reduce,
            first_order=first_order, extra_grad=extra_grad,
        ):  # fmt: skip
            self.fast = fast
            yield fast

    def copies_for(self, fast: Params, width: int) -> dict[str, Tensor]:
        """Each task's ``fast`` and held weights, a copy per chunk, ``[T * width, ...]``."""
        both = {**fast, **self.fixed}
        copies = self.sums.spread_units(list(both.values()), width)
        flat = [c.reshape(self.n_local * width, *c.shape[2:]) for c in copies]
        return dict(zip(both, flat, strict=True))

    def starts(self, cut: Chunks, width: int) -> list[int]:
        """Each chunk's first global sample (its dropout masks are those samples')."""
        return [(cut.mine.start + c) * cut.size for _ in range(self.n_local) for c in range(width)]

    def values(
        self,
        fast: Params,
        width: int,
        x: Tensor,
        y: Tensor,
        mask: Tensor,
        divisor: int,
        cut: Chunks,
    ) -> tuple[list[Tensor], Tensor]:
        """A copy of each task's weights per chunk (the fast weights' copies, returned) and
        every chunk's loss, chunks vmapped."""
        weights = self.copies_for(fast, width)
        with self.sums.units(self.n_local, width):
            values = _chunk_values(
                self.model, weights, x, y, mask, self.loss_fn, divisor, self.starts(cut, width),
                width,
            )  # fmt: skip
        return [weights[k] for k in fast], values

    def embeddings(self, batch: str, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor, int, Chunks]:
        """Every chunk's outputs of the model at the start's weights on the ``batch``
        ("support" or "query") of every task, ``[T * width, size, D]`` (``kwargs`` to the
        forward), with the chunks' labels, mask, width and cut."""
        cut = self.sums.cut(getattr(self.tasks[0], batch).n)
        x, y, mask, width = _chunked([getattr(t, batch) for t in self.tasks], cut)
        weights, starts = self.copies_for(self.start, width), self.starts(cut, width)

        def one(w: Params, xc: Tensor, mc: Tensor, slot: Any) -> Tensor:
            with _mask.sample_mask(mc), forward.stacked_forward(slot, starts, xc.shape[0], width):
                return call(self.model, w, xc, **kwargs).flatten(1)

        slots = (
            torch.arange(x.shape[0], device=x.device) if forward.needs_routes(self.model) else None
        )
        in_dims = (0, 0, 0, None if slots is None else 0)
        with torch.enable_grad(), self.sums.units(self.n_local, width), stacked_layers(self.model):
            out = torch.vmap(one, in_dims=in_dims)(weights, x, mask, slots)
        return out, y, mask, width, cut

    def prototypes(self, ways: int, **kwargs: Any) -> Tensor:
        """Each task's class means of its support set's embeddings (``[T, ways, D]``): every
        chunk's class sums and counts, summed over the chunks order-free."""
        feats, y, mask, width, _ = self.embeddings("support", **kwargs)
        classes = torch.arange(ways, device=y.device)
        hot = (y.unsqueeze(-1) == classes).to(feats.dtype) * mask.to(feats.dtype).unsqueeze(-1)
        sums, counts = self.sums.gather_units(
            [(hot.transpose(1, 2) @ feats).reshape(self.n_local, width, ways, -1),
             hot.sum(1).reshape(self.n_local, width, ways)]
        )  # fmt: skip
        return sums / counts.clamp(min=1).unsqueeze(-1)

    def gradient(
        self, batch: str, at: Params, *, create_graph: bool = False
    ) -> tuple[Tensor, list[Tensor]]:
        """Every chunk's share of each task's mean loss on ``batch`` ("support" or "query")
        at the per-task weights ``at`` (leaves), and its gradient by them, summed over the
        chunks order-free (``[T, ...]`` per weight)."""
        cut = self.sums.cut(getattr(self.tasks[0], batch).n)
        x, y, mask, width = _chunked([getattr(t, batch) for t in self.tasks], cut)
        with torch.enable_grad():
            _, values = self.values(at, width, x, y, mask, cut.n, cut)
            grads = torch.autograd.grad(
                values.sum(), list(at.values()), create_graph=create_graph,
                allow_unused=True, materialize_grads=True,
            )  # fmt: skip
        return values, list(grads)

    def nothing(self) -> Tensor:
        """On a rank without tasks: no values, but ones that still reach the copies, so that
        the meta-gradient's sum in their backward runs on this rank too."""
        zero = sum((c.sum() for c in self.copies), self.copies[0].new_zeros(())) * 0
        return zero.expand(0)

    def query_loss(self, n_tasks: int, fast: Params | None = None) -> Tensor:
        """This rank's share of the meta-batch's mean query loss at the adapted weights (or
        at ``fast``, weights :meth:`stepping` yielded)."""
        if not self.n_local:
            return self.sums.total(self.nothing())
        query = self.sums.cut(self.tasks[0].query.n)
        qx, qy, qm, qw = _chunked([t.query for t in self.tasks], query)
        at = self.fast if fast is None else fast
        with torch.enable_grad():
            _, values = self.values(at, qw, qx, qy, qm, query.n * n_tasks, query)
        return self.sums.total(values)

    def prototype_loss(self, ways: int, n_tasks: int) -> Tensor:
        """A prototypical network's share of the mean query loss: every query chunk scored
        against its task's prototypes (:meth:`prototypes`)."""
        if not self.n_local:
            return self.sums.total(self.nothing())
        prototypes = self.prototypes(ways)
        q, y, mask, width, query = self.embeddings("query")
        (protos,) = self.sums.spread_units([prototypes], width)
        protos = protos.reshape(self.n_local * width, ways, -1)

        def losses(logits: Tensor, yc: Tensor) -> Tensor:
            raw = self.loss_fn(logits, yc)
            check_per_sample(raw, logits.shape[0])
            return one_per_sample(raw)

        with torch.enable_grad():
            logits = -((q.unsqueeze(2) - protos.unsqueeze(1)) ** 2).sum(-1)  # [U, size, ways]
            per = torch.vmap(losses)(logits, y)
            values = (per * mask.to(per.dtype)).sum(1) / (query.n * n_tasks)
        return self.sums.total(values)

    def displacement_loss(self, n_tasks: int) -> Tensor:
        """This rank's share of the mean over the meta-batch of ``0.5 * ||theta -
        stop_grad(phi)||^2`` (Reptile's): its gradient is the mean displacement, each task's
        summed order-free over the task axis by the start's copies."""
        if not self.n_local:
            return self.sums.total_tasks(self.nothing())
        per = sum(
            ((self.start[k] - self.fast[k].detach()) ** 2).flatten(1).sum(1) for k in self.names
        )
        return self.sums.total_tasks(0.5 * cast(Tensor, per) / n_tasks)


def exact_meta_loss(
    model: nn.Module,
    params: Params,
    tasks: Sequence[Task],
    loss_fn: LossFn,
    *,
    n_tasks: int,
    steps: int,
    first_order: bool,
    build: Callable[[Params | None], InnerOptimizer],
    rates: Params | None,
    sums: Sums,
    held: Params | None = None,
) -> Tensor:
    """This rank's share of the meta-batch's mean query loss over ``n_tasks`` tasks, every
    sum order-free: a scalar whose sum over ranks is the meta-loss, and whose backward leaves
    the complete meta-gradient on every rank. ``steps``, ``first_order`` and ``build`` are
    :meth:`Adapted.stepping`'s, the rest :class:`Adapted`'s."""
    adapted = Adapted(model, params, tasks, loss_fn, sums=sums, rates=rates, held=held)
    adapted.run(steps, first_order, build)
    return adapted.query_loss(n_tasks)


def task_dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """Each task's inner product of two lists of per-task tensors ``[T, ...]``: ``[T]``."""
    return cast(Tensor, sum((x * y).flatten(1).sum(1) for x, y in zip(a, b, strict=True)))


def batched_conjugate_gradient(
    matvec: Callable[[list[Tensor]], list[Tensor]],
    b: list[Tensor],
    *,
    max_iter: int,
    tol: float,
    what: str,
    advice: str,
) -> tuple[list[Tensor], float, int]:
    """Every task's own conjugate gradient at once (``A_t x_t = b_t``, tensors ``[T, ...]``),
    each stopping where :func:`metaddp.algorithms._hypergrad.conjugate_gradient` alone would:
    a task whose residual is within ``tol`` takes no more steps. Returns ``x``, the largest
    relative residual and the most iterations taken."""
    from ._hypergrad import NotPositiveDefinite

    x = [torch.zeros_like(t) for t in b]
    b_norm = task_dot(b, b).sqrt()
    r, p = [t.clone() for t in b], [t.clone() for t in b]
    rr = task_dot(r, r)
    it = 0

    def each(v: Tensor, like: Tensor) -> Tensor:  # a per-task scalar against [T, ...]
        return v.reshape(-1, *([1] * (like.dim() - 1)))

    while it < max_iter:
        active = (b_norm > 0) & (rr.sqrt() > tol * b_norm)
        if not bool(active.any()):
            break
        ap = matvec(p)
        pap = task_dot(p, ap)
        bad = active & ~(torch.isfinite(pap) & (pap > 0))
        if bool(bad.any()):
            raise NotPositiveDefinite.along(what, float(pap[bad][0]), advice)
        alpha = torch.where(active, rr / torch.where(active, pap, 1.0), 0.0)
        x = [xi + each(alpha, xi) * pi for xi, pi in zip(x, p, strict=True)]
        r = [ri - each(alpha, ri) * api for ri, api in zip(r, ap, strict=True)]
        rr_new = task_dot(r, r)
        beta = torch.where(active, rr_new / torch.where(active, rr, 1.0), 0.0)
        p = [
            torch.where(each(active, pi), ri + each(beta, pi) * pi, pi)
            for ri, pi in zip(r, p, strict=True)
        ]
        rr = torch.where(active, rr_new, rr)
        it += 1
    ratio = torch.where(b_norm > 0, rr.sqrt() / torch.where(b_norm > 0, b_norm, 1.0), 0.0)
    return x, float(ratio.max()) if ratio.numel() else 0.0, it
