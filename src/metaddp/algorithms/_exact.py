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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from .. import _mask, forward
from .._adapt import check_finite
from .._data import Batch, Chunks, Task
from .._functional import call
from .._share import check_per_sample, one_per_sample
from .._types import LossFn, Params
from ..inner import InnerOptimizer, apply_updates, sgd
from ._layers import stacked_layers
from ._stacked import per_task


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

    def one(w: Mapping[str, Tensor], xc: Tensor, yc: Tensor, mc: Tensor, slot: Any) -> Tensor:
        with _mask.sample_mask(mc), forward.stacked_forward(slot, starts, xc.shape[0], width):
            per = loss_fn(call(model, w, xc), yc)
        check_per_sample(per, xc.shape[0])
        per = one_per_sample(per)
        return (per * mc.to(per.dtype)).sum() / divisor

    # A slot per chunk for a model that may draw only: the others dispatch nothing more.
    slots = torch.arange(x.shape[0], device=x.device) if forward.needs_routes(model) else None
    with stacked_layers(model):
        return torch.vmap(one, in_dims=(0, 0, 0, 0, None if slots is None else 0))(
            dict(weights), x, y, mask, slots
        )


class Adapted:
    """Every local task's fast weights after the inner loop, in deterministic mode: a copy
    per task (``fast[k]: [T, ...]``), the same bits on every rank that holds the task."""

    def __init__(
        self,
        model: nn.Module,
        params: Params,
        tasks: Sequence[Task],
        loss_fn: LossFn,
        *,
        steps: int,
        first_order: bool,
        build: Callable[[Params | None], InnerOptimizer],
        rates: Params | None,
        sums: Sums,
        held: Params | None = None,
    ) -> None:
        if any(name not in params for name, _ in model.named_buffers()):
            raise ValueError(
                "deterministic mode cannot run models with buffers (BatchNorm's running "
                "statistics are updated in place per task): build BatchNorm layers with "
                "track_running_stats=False, as MAML does"
            )
        held = dict(held or {})
        self.model, self.loss_fn, self.sums = model, loss_fn, sums
        self.names, self.kept = list(params), list(held)
        # The rates' distinct tensors (one scalar may serve every parameter), each spread once.
        rate_leaves = list({id(r): r for r in (rates or {}).values()}.values())
        self.n_local = n_local = len(tasks)
        names, kept = self.names, self.kept
        copies = sums.spread_tasks(
            [params[k] for k in names] + [held[k] for k in kept] + rate_leaves, n_local
        )
        self.copies = copies
        if not n_local:
            self.start = self.fast = self.fixed = {}
            return
        self.start = fast = dict(zip(names, copies[: len(names)], strict=True))
        self.fixed = dict(zip(kept, copies[len(names) : len(names) + len(kept)], strict=True))
        task_rates = None
        if rates is not None:
            leaves = copies[len(names) + len(kept) :]
            spread_of = {id(r): c for r, c in zip(rate_leaves, leaves, strict=True)}
            task_rates = {k: spread_of[id(r)] for k, r in rates.items()}
        optimizer = per_task(build, n_local, task_rates)
        self.tasks = tasks
        support = sums.cut(tasks[0].support.n)
        sx, sy, sm, sw = _chunked([t.support for t in tasks], support)
        state = optimizer.init(fast)
        with torch.enable_grad():
            for step in range(steps):
                flat, values = self.values(fast, sw, sx, sy, sm, support.n, support)
                grads = torch.autograd.grad(
                    values.sum(),
                    flat,
                    create_graph=not first_order,
                    allow_unused=True,
                    materialize_grads=True,
                )
                summed = sums.gather_units([g.reshape(n_local, sw, *g.shape[1:]) for g in grads])
                g_fast = dict(zip(names, summed, strict=True))
                check_finite(g_fast, step)
                updates, state = optimizer.update(g_fast, state, fast)
                fast = apply_updates(fast, updates)
        self.fast = fast

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
        both = {**fast, **self.fixed}
        copies = self.sums.spread_units(list(both.values()), width)
        flat = [c.reshape(self.n_local * width, *c.shape[2:]) for c in copies]
        starts = [
            (cut.mine.start + c) * cut.size for _ in range(self.n_local) for c in range(width)
        ]
        with self.sums.units(self.n_local, width):
            values = _chunk_values(
                self.model, dict(zip(both, flat, strict=True)), x, y, mask, self.loss_fn,
                divisor, starts, width,
            )  # fmt: skip
        return flat[: len(self.names)], values

    def nothing(self) -> Tensor:
        """On a rank without tasks: no values, but ones that still reach the copies, so that
        the meta-gradient's sum in their backward runs on this rank too."""
        zero = sum((c.sum() for c in self.copies), self.copies[0].new_zeros(())) * 0
        return zero.expand(0)

    def query_loss(self, n_tasks: int) -> Tensor:
        """This rank's share of the meta-batch's mean query loss at the adapted weights."""
        if not self.n_local:
            return self.sums.total(self.nothing())
        query = self.sums.cut(self.tasks[0].query.n)
        qx, qy, qm, qw = _chunked([t.query for t in self.tasks], query)
        with torch.enable_grad():
            _, values = self.values(self.fast, qw, qx, qy, qm, query.n * n_tasks, query)
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
    """This rank's share of the meta-batch's mean query loss, every sum order-free.

    Args:
        model: the network, evaluated functionally on chunk copies of the fast weights.
        params: the fast weights' starts (the meta-parameters the inner loop adapts).
        tasks: this rank's tasks, every batch cut into whole chunks (``sums.cut``).
        n_tasks: tasks in the global meta-batch.
        steps, first_order: the inner loop.
        build: the inner optimizer, from a task's learned rates (``None`` without them).
        rates: the learned rates by parameter name (``None`` without them).
        sums: the processes' copies and sums.
        held: trained parameters the inner loop reads but does not adapt (BOIL's head,
            CAVIA's network): spread to every chunk like the fast weights, so their
            meta-gradient is summed order-free too.

    Returns:
        A scalar whose sum over ranks is the meta-loss; its backward leaves the complete
        meta-gradient on every rank.
    """
    adapted = Adapted(
        model, params, tasks, loss_fn, steps=steps, first_order=first_order, build=build,
        rates=rates, sums=sums, held=held,
    )  # fmt: skip
    return adapted.query_loss(n_tasks)


def exact_prototype_loss(
    model: nn.Module,
    params: Params,
    tasks: Sequence[Task],
    loss_fn: LossFn,
    *,
    ways: int,
    n_tasks: int,
    sums: Sums,
) -> Tensor:
    """A prototypical network's share of the meta-batch's mean query loss, every sum
    order-free: each support chunk's class sums and counts of its embeddings, summed over
    the chunks by the mesh's exact gather (the prototypes, the same bits wherever they are
    made), then every query chunk's loss against them, as MAML's query loss."""
    adapted = Adapted(
        model, params, tasks, loss_fn, steps=0, first_order=True, build=lambda rates: sgd(1.0),
        rates=None, sums=sums,
    )  # fmt: skip
    if not adapted.n_local:
        return sums.total(adapted.nothing())
    names, n_local = adapted.names, adapted.n_local
    support, query = sums.cut(tasks[0].support.n), sums.cut(tasks[0].query.n)
    sx, sy, sm, sw = _chunked([t.support for t in tasks], support)
    qx, qy, qm, qw = _chunked([t.query for t in tasks], query)
    classes = torch.arange(ways, device=sy.device)

    def embed(
        w: Params, x: Tensor, mask: Tensor, slots: Tensor | None, starts: list[int], width: int
    ):
        def one(wc: Params, xc: Tensor, mc: Tensor, slot: Any) -> Tensor:
            with _mask.sample_mask(mc), forward.stacked_forward(slot, starts, xc.shape[0], width):
                return call(model, wc, xc).flatten(1)

        in_dims = (0, 0, 0, None if slots is None else 0)
        with stacked_layers(model):
            return torch.vmap(one, in_dims=in_dims)(w, x, mask, slots)

    def losses(logits: Tensor, y: Tensor) -> Tensor:
        raw = loss_fn(logits, y)
        check_per_sample(raw, logits.shape[0])
        return one_per_sample(raw)

    def copies(width: int) -> tuple[Params, Tensor | None]:
        spread = sums.spread_units([adapted.fast[k] for k in names], width)
        flat = [c.reshape(n_local * width, *c.shape[2:]) for c in spread]
        units = n_local * width
        slots = torch.arange(units, device=sx.device) if forward.needs_routes(model) else None
        return dict(zip(names, flat, strict=True)), slots

    def starts(cut: Chunks, width: int) -> list[int]:
        return [(cut.mine.start + c) * cut.size for _ in range(n_local) for c in range(width)]

    with torch.enable_grad():
        w, slots = copies(sw)
        with sums.units(n_local, sw):
            feats = embed(w, sx, sm, slots, starts(support, sw), sw)  # [U, size, D]
        hot = (sy.unsqueeze(-1) == classes).to(feats.dtype) * sm.to(feats.dtype).unsqueeze(-1)
        class_sums = hot.transpose(1, 2) @ feats  # [U, ways, D]
        counts = hot.sum(1)  # [U, ways]
        total_sums, total_counts = sums.gather_units(
            [class_sums.reshape(n_local, sw, *class_sums.shape[1:]),
             counts.reshape(n_local, sw, ways)]
        )  # fmt: skip
        prototypes = total_sums / total_counts.clamp(min=1).unsqueeze(-1)  # [T, ways, D]
        (protos,) = sums.spread_units([prototypes], qw)
        protos = protos.reshape(n_local * qw, ways, -1)
        w, slots = copies(qw)
        with sums.units(n_local, qw):
            q = embed(w, qx, qm, slots, starts(query, qw), qw)  # [U, size, D]
        logits = -((q.unsqueeze(2) - protos.unsqueeze(1)) ** 2).sum(-1)  # [U, size, ways]
        per = torch.vmap(losses)(logits, qy)
        values = (per * qm.to(per.dtype)).sum(1) / (query.n * n_tasks)
    return sums.total(values)
