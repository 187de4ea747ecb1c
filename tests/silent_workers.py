"""Rank functions for tests/test_silent_cells.py: the loops a researcher porting one-process
code writes by hand, with dropout left on, each returning its meta-gradient or its error."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

import metaddp as md

MSE = lambda p, y: (p - y).squeeze(-1) ** 2  # noqa: E731


def _tasks() -> list[md.Task]:
    x = torch.linspace(-1, 1, 8, dtype=torch.float64)[:, None]
    return [md.Task(md.Batch(x, 2 * x * (i + 1), 8), md.Batch(x, 3 * x * (i + 1), 8)) for i in range(2)]


def _grads(learner: md.MetaDDP) -> list[float]:
    return [v for p in learner.parameters() for v in p.grad.reshape(-1).tolist()]


def _outcome(step) -> dict:
    try:
        return {"grad": step()}
    except (ValueError, FloatingPointError) as e:
        return {"error": str(e)}


def _mesh(layout: str) -> md.Mesh:
    return md.Mesh.create(tasks=md.world_size()) if layout == "task" else md.Mesh.create()


def anil_clone(layout: str, dropout: float) -> dict:
    """ANIL's clone() loop: its body runs outside metaddp's forwards."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Dropout(dropout)).double()
    learner = md.MetaDDP(md.ANIL(body, nn.Linear(8, 1).double(), inner_lr=0.1), _mesh(layout))

    return _outcome(lambda: _clone_loop_step(learner))


class FunctionalDropout(nn.Module):
    """Dropout written in a forward's own code (no dropout layer to see)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        return torch.nn.functional.dropout(x, self.p, self.training)


def call_loop(layout: str, dropout: float, functional: bool = False) -> dict:
    """A hand loop over md.call and learner.grad."""
    torch.manual_seed(0)
    drop = FunctionalDropout(dropout) if functional else nn.Dropout(dropout)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), drop, nn.Linear(8, 1)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1), _mesh(layout))

    def step() -> list[float]:
        mine = learner.shard(_tasks())
        total = torch.zeros((), dtype=torch.float64)
        for t in mine:
            fast = md.params_of(net)
            g = learner.grad(md.share(MSE(md.call(net, fast, t.support.x), t.support.y), t.support), fast)
            fast = {k: v - 0.1 * g[k] for k, v in fast.items()}
            total = total + md.share(MSE(md.call(net, fast, t.query.x), t.query.y), t.query) / mine.n
        total.backward()
        learner.sync_grads()
        return _grads(learner)

    out = _outcome(step)
    # One rank's own work inside local() may draw; the next step is judged on its own.
    with learner.local():
        md.call(net, md.params_of(net), torch.ones(4, 1, dtype=torch.float64))
    net.eval()
    learner.zero_grad()
    out["after local, eval"] = _outcome(step)
    return out


class Noisy(nn.Module):
    """Noise added to each input in the forward: from a torch generator of the module's own,
    torch's default one, numpy's global one, or Python's."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.g = how, torch.Generator().manual_seed(0)
        self.a, self.b = nn.Linear(1, 8), nn.Linear(8, 1)

    def forward(self, x):
        if self.how == "generator":
            x = x + 0.1 * torch.randn(x.shape, generator=self.g, dtype=x.dtype)
        elif self.how == "numpy":
            x = x + 0.1 * torch.from_numpy(np.random.randn(*x.shape)).to(x.dtype)
        elif self.how == "torch":
            x = x + 0.1 * torch.randn(x.shape, dtype=x.dtype)
        elif self.how == "random":
            x = x + 0.1 * torch.tensor([[random.gauss(0, 1)] for _ in x], dtype=x.dtype)
        return self.b(torch.tanh(self.a(x)))


def noisy_forward(how: str, batched: bool | None, where: str = "meta_loss") -> dict:
    """A meta-step of a model whose forward draws noise (:class:`Noisy`), by meta_loss or by
    adapt; the meta-gradient or the error."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    net = Noisy(how).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1, batched=batched), md.Mesh.create())

    def step() -> list[float]:
        tasks = learner.shard(_tasks())
        if where == "adapt":
            learner.adapt(tasks[0].support, MSE)
        learner.meta_loss(tasks, MSE).backward()
        learner.sync_grads()
        return _grads(learner)

    try:
        return _outcome(step)
    except RuntimeError as e:  # stacked tasks refuse any draw
        return {"error": str(e)}


def noisy_clone(how: str) -> dict:
    """learn2learn's clone() loop on a model whose forward draws noise (:class:`Noisy`)."""
    torch.manual_seed(0)
    net = Noisy(how).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1), md.Mesh.create())

    return _outcome(lambda: _clone_loop_step(learner))


# --- losses that read a statistic of their own batch --------------------------------------


def _mse(p, y):
    return (p - y).squeeze(-1) ** 2


def normalised_by_sum(p, y):  # importance weights normalised by the batch's sum (L2RW)
    w = _mse(p, y)
    return w * (w.detach() / w.detach().sum())


def over_variance(p, y):  # a loss divided by the batch targets' variance
    return _mse(p, y) / y.squeeze(-1).var()


def class_balanced(p, y):  # weights from the batch's label counts
    positive = (y.squeeze(-1) > 0).to(p.dtype)
    share = (positive.sum() + 1) / (len(positive) + 2)  # smoothed: a shard may hold one class
    return _mse(p, y) * (positive / share + (1 - positive) / (1 - share)) / 2


def over_offset_variance(p, y):  # a small statistic: it moves the losses by 1e-4
    return _mse(p, y) / (y.squeeze(-1).var() + 1000.0)


LOSSES = {"sum": normalised_by_sum, "variance": over_variance, "balanced": class_balanced,
          "offset": over_offset_variance}


def batch_statistic(loss: str, where: str, n: int = 8) -> dict:
    """A meta-step whose loss reads a statistic of its own batch: meta_loss (stacked or one by
    one; stacked with BatchNorm or dropout in the model), adapt (MAML's, MAML++'s, a
    Bilevel's), or a Bilevel's own inner loss; ``n`` samples per batch. Returns the
    meta-gradient or the error."""
    torch.manual_seed(0)
    middle = {"stacked-bn": [nn.BatchNorm1d(8)], "stacked-dropout": [nn.Dropout(0.2)]}.get(where, [])
    net = nn.Sequential(nn.Linear(1, 8), *middle, nn.Tanh(), nn.Linear(8, 1)).double()
    fn = LOSSES[loss]
    if where == "bilevel":
        alg = md.Bilevel(net, inner_loss=fn, outer_loss=_mse, inner_lr=0.1)
    elif where == "bilevel-adapt":
        alg = md.Bilevel(net, inner_lr=0.1)
    elif where == "mamlpp-adapt":
        alg = md.MAMLPlusPlus(net, inner_lr=0.1, steps=2, per_step_bn=False)
    elif where == "deterministic":
        alg = md.MAML(net, inner_lr=0.1)
    else:
        stacked = where.startswith("stacked")
        alg = md.MAML(net, inner_lr=0.1, batched=True if stacked else {"loop": False}.get(where))
    learner = md.MetaDDP(alg, md.Mesh.create(), deterministic=where == "deterministic")
    x = torch.linspace(-1, 1, n, dtype=torch.float64)[:, None]
    tasks_ = [md.Task(md.Batch(x, 2 * x * (i + 1), n), md.Batch(x, 3 * x * (i + 1), n)) for i in range(2)]

    def step() -> list[float]:
        tasks = learner.shard(tasks_)
        if where.endswith("adapt"):
            fast = learner.adapt(tasks[0].support, fn)
            q = tasks[0].query
            loss = learner.meta_loss(tasks, _mse) + 0 * md.share(_mse(learner(q.x, fast), q.y), q)
        else:
            loss = learner.meta_loss(tasks, None if where == "bilevel" else fn)
        loss.backward()
        learner.sync_grads()
        return _grads(learner)

    return _outcome(step)


def batch_statistics(cases: list[tuple[str, str]]) -> dict:
    """:func:`batch_statistic` for each ``(loss, where)`` of ``cases``, in one process group."""
    return {case: batch_statistic(*case) for case in cases}


class _SumNormalised(nn.Module):
    """Meta-Weight-Net's weights, normalised by their batch's sum (as L2RW normalises)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = md.bilevel.WeightNet(hidden=4)

    def forward(self, losses):
        w = self.net(losses)
        return w * len(w) / w.sum()


def bilevel_weights(normalised: bool, n: int = 8) -> dict:
    """A Bilevel whose ``weights=`` module weighs the inner losses, normalised by their batch's
    sum or each alone; ranks split the samples. Returns the meta-gradient or the error."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    weights = (_SumNormalised() if normalised else md.bilevel.WeightNet(hidden=4)).double()
    alg = md.Bilevel(net, inner_loss=_mse, outer_loss=_mse, inner_lr=0.1, weights=weights)
    learner = md.MetaDDP(alg, md.Mesh.create())
    x = torch.linspace(-1, 1, n, dtype=torch.float64)[:, None]
    tasks_ = [md.Task(md.Batch(x, 2 * x * (i + 1), n), md.Batch(x, 3 * x * (i + 1), n)) for i in range(2)]

    def step() -> list[float]:
        learner.meta_loss(learner.shard(tasks_)).backward()
        learner.sync_grads()
        return _grads(learner)

    return _outcome(step)


def varying_lengths(layout: str) -> dict:
    """Tasks of sequences of other lengths (task ``i``: ``3 + i`` steps), one loss function
    on every rank: whole tasks per rank, so ranks call it on other shapes first."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1), _mesh(layout))

    def task(i: int) -> md.Task:
        t = torch.linspace(-1, 1, 3 + i, dtype=torch.float64)
        x = torch.stack([t * (k + 1) for k in range(4)])[..., None]  # [4 samples, 3 + i, 1]
        return md.Task(md.Batch(x, (i + 1) * x.sin(), 4), md.Batch(x, (i + 1) * x.cos(), 4))

    def step() -> list[float]:
        learner.meta_loss(learner.shard(4, task), _sequence_mse).backward()
        learner.sync_grads()
        return _grads(learner)

    return _outcome(step)


def _sequence_mse(p, y):  # per sample: averaged over its steps by md.share
    return (p - y) ** 2


def global_statistic() -> dict:
    """The same normalisation over the whole batch, by md.data.global_sums: the one-process
    meta-gradient on any split."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1, batched=False), md.Mesh.create())

    def normalised(p, y):
        w = _mse(p, y)
        (total,) = md.data.global_sums([w.detach().sum()], reduce=learner.reduce)
        return w * (w.detach() / total)

    def step() -> list[float]:
        loss = learner.meta_loss(learner.shard(_tasks()), normalised)
        loss.backward()
        learner.sync_grads()
        return _grads(learner)

    return _outcome(step)


def over_largest_target(p, y):  # each loss over the batch's largest target
    return (p - y) ** 2 / y.abs().max()


def over_largest_loss(p, y):  # each loss over the batch's largest loss, held constant
    losses = (p - y) ** 2
    return losses / losses.detach().max()


EXTREME = {"target": over_largest_target, "loss": over_largest_loss,
           # Additive: each sample's loss is its own, averaged or summed over its outputs.
           "mean": lambda p, y: ((p - y) ** 2).mean(1), "sum": lambda p, y: ((p - y) ** 2).sum(1)}


def extreme_sample(loss: str, last: bool, where: str = "loop") -> dict:
    """meta_loss on 8 samples per batch, two outputs each, whose largest target (and loss)
    is the first of each 4-sample part of the batch, or its last (``last``): what a rank holds
    at 2 processes. Returns the meta-gradient or the error."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    alg = md.MAML(net, inner_lr=0.1, batched=True if where == "stacked" else {"loop": False}.get(where))
    learner = md.MetaDDP(alg, md.Mesh.create(), deterministic=where == "deterministic")
    part = [0.1, 0.2, 0.3, 3.0] if last else [3.0, 0.1, 0.2, 0.3]
    x = torch.tensor(part + [v + 0.05 for v in part], dtype=torch.float64)[:, None]
    y = torch.cat([2 * x, -x], 1)
    fn = EXTREME[loss]
    tasks_ = [md.Task(md.Batch(x, y * (i + 1), 8), md.Batch(x, y * (i + 2), 8)) for i in range(2)]

    def step() -> list[float]:
        learner.meta_loss(learner.shard(tasks_), fn).backward()
        learner.sync_grads()
        return _grads(learner)

    return _outcome(step)


# --- state that differs across ranks -------------------------------------------------------


def _error_of(step) -> str:
    try:
        step()
    except (ValueError, RuntimeError) as e:  # OutOfSyncError and CollectiveError included
        return f"{type(e).__name__}: {e}"
    return "accepted"


def differing_state(what: str) -> str:
    """A meta-step after state that differs by rank: a checkpoint loaded on rank 0 after the
    wrapper was built, or an inner rate that differs by 1e-3 (a Bilevel's optimizer)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    if what == "rate":
        alg = md.Bilevel(net, optimizer=md.inner.sgd(0.1 + 1e-3 * md.rank()), outer_loss=_mse, inner_loss=_mse)
    else:
        alg = md.MAML(net, inner_lr=0.1)
    learner = md.MetaDDP(alg, md.Mesh.create())
    if what == "checkpoint" and md.rank() == 0:
        state = {k: v + 1e-3 for k, v in net.state_dict().items()}
        net.load_state_dict(state)

    def step() -> None:
        loss = learner.meta_loss(learner.shard(_tasks()), None if what == "rate" else _mse)
        loss.backward()
        learner.sync_grads()

    return _error_of(step)


def differing_modes() -> dict:
    """Meta-steps after one rank alone changed a setting every rank must share: its model put
    in eval mode (dropout, BatchNorm), a layer's setting changed (a Dropout's p, a BatchNorm's
    momentum), or a parameter frozen (also with sharded weights), on
    the second step (a checked one), or on the third in check mode. Each case's error."""
    def run(layer: nn.Module, change, *, at: int = 1, **options) -> str:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(1, 8), layer, nn.Tanh(), nn.Linear(8, 1)).double()
        learner = md.MetaDDP(md.MAML(net, inner_lr=0.1), md.Mesh.create(), **options)

        def steps() -> None:
            for step in range(at + 1):
                if step == at and md.rank() == 1:
                    change(net)
                learner.zero_grad()
                learner.meta_loss(learner.shard(_tasks()), _mse).backward()
                learner.sync_grads()

        said = _error_of(steps)
        learner.release()
        return said

    freeze = lambda net: net[0].bias.requires_grad_(False)  # noqa: E731
    return {
        "dropout eval": run(nn.Dropout(0.3), lambda net: net.eval()),
        "batchnorm eval": run(nn.BatchNorm1d(8), lambda net: net[1].eval()),
        "frozen": run(nn.Identity(), freeze),
        "frozen sharded": run(nn.Identity(), freeze, shard=True),
        "dropout eval checked": run(nn.Dropout(0.3), lambda net: net.eval(), at=2, check=True),
        "dropout p": run(nn.Dropout(0.3), lambda net: setattr(net[1], "p", 0.5)),
        "batchnorm momentum": run(nn.BatchNorm1d(8), lambda net: setattr(net[1], "momentum", 0.2)),
        # Not settings: an attribute set on a layer (a hook's count), on one rank only.
        "attribute on a layer": run(nn.Tanh(), lambda net: setattr(net[0], "seen", 7)),
        "attribute on one rank's layer": run(nn.Tanh(), lambda net: setattr(net[1], "note", "r1")),
    }


def frozen_alone() -> str:
    """A parameter frozen on rank 1 alone before the third meta-step (not a checked one), in
    the default mode: rank 1's error, or rank 0's once rank 1 has stopped."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1), md.Mesh.create())

    def steps() -> None:
        for step in range(3):
            if step == 2 and md.rank() == 1:
                net[0].bias.requires_grad_(False)
            learner.zero_grad()
            learner.meta_loss(learner.shard(_tasks()), _mse).backward()
            learner.sync_grads()

    return _error_of(steps)


def nan_meta_gradient() -> str:
    """adam(eps_root=0) with a dead unit: the second-order term divides by a zero second
    moment, so the meta-gradient is NaN while the meta-loss is finite."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 2), nn.ReLU(), nn.Linear(2, 1)).double()
    with torch.no_grad():
        net[0].bias[1] = -100.0  # a dead unit: its inner gradient is exactly 0
    learner = md.MetaDDP(md.MAML(net, optimizer=md.inner.adam(0.1, eps_root=0.0), steps=2), md.Mesh.create())

    def step() -> None:
        loss = learner.meta_loss(learner.shard(_tasks()), _mse)
        loss.backward()
        assert torch.isfinite(loss) and not all(bool(torch.isfinite(p.grad).all()) for p in net.parameters())
        learner.sync_grads()

    try:
        step()
    except FloatingPointError as e:
        return str(e)
    return "accepted"


# --- sharded checkpoints written the usual way ---------------------------------------------


def sharded_usual_checkpoint(folder: str) -> dict:
    """Sharded weights saved as a one-GPU script saves them: rank 0 torch.saves
    module.state_dict() and every rank loads it; DCP given state_dict() instead of
    sharded_state_dict(). Both loads are refused; inside gathered() the whole weights save and
    load as usual."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    # Every weight's rows split evenly in two: the rows' shapes match on every rank, so
    # nothing in torch tells one rank's rows from another's.
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1), md.Mesh.create(), shard=True)
    out = {}
    path = f"{folder}/model.pt"
    if md.rank() == 0:
        torch.save(learner.module.state_dict(), path)
    dist.barrier()
    out["torch.save"] = _error_of(lambda: learner.module.load_state_dict(torch.load(path)))
    dcp.save(learner.module.state_dict(), checkpoint_id=f"{folder}/dcp")

    def dcp_load() -> None:
        state = learner.module.state_dict()
        dcp.load(state, checkpoint_id=f"{folder}/dcp")
        learner.module.load_state_dict(state)

    out["dcp"] = _error_of(dcp_load)
    copied = {k: v.clone() for k, v in learner.module.state_dict().items()}  # as .cpu() would
    out["copied"] = _error_of(lambda: learner.module.load_state_dict(copied))
    with learner.gathered():
        whole = learner.module.state_dict()
        out["gathered"] = _error_of(lambda: learner.module.load_state_dict(whole))
    learner.release()
    return out


def hand_cut_starts(right: bool) -> dict:
    """Tasks of 7 samples cut by hand with torch.chunk (parts of 4 and 3), dropout on, each
    part's start= either where it begins or rank * (7 // 2) (the second part then says 3)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 1)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1), md.Mesh.create())
    x = torch.linspace(-1, 1, 7, dtype=torch.float64)[:, None]
    r, w = md.rank(), md.world_size()
    xs, ys = torch.chunk(x, w)[r], torch.chunk(2 * x, w)[r]
    start = sum(len(c) for c in torch.chunk(x, w)[:r]) if right else r * (7 // w)
    part = md.Batch.local(xs, ys, 7, start=start)
    tasks = [md.Task(part, part)]

    def step() -> list[float]:
        loss = learner.meta_loss(tasks, _mse)
        loss.backward()
        learner.sync_grads()
        return _grads(learner)

    try:
        return {"grad": step()}
    except (ValueError, RuntimeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def accumulated_running_statistics() -> str:
    """Two meta-batches accumulated before the first sum (no_sync), task layout, BatchNorm
    with running statistics: the task groups' statistics differ by then, legitimately."""
    from metaddp.testing import scenarios as S

    p = S.Problem("conv", batchnorm=True, running_stats=True, layout="task", steps=1, n_tasks=4)
    learner = md.MetaDDP(p.build_algorithm(), md.Mesh.for_layout("task"))

    def step() -> None:
        with learner.no_sync():
            learner.meta_loss(learner.shard(4, p.task), p.loss_fn).backward()
        learner.meta_loss(learner.shard(4, lambda i: p.task(10 + i)), p.loss_fn).backward()
        learner.sync_grads()

    return _error_of(step)


def _clone_loop_step(learner: md.MetaDDP) -> list[float]:
    """One meta-step of the documented clone() loop: one inner step per task, query shares
    over the global task count, then the gradient SUM."""
    mine = learner.shard(_tasks())
    total = torch.zeros((), dtype=torch.float64)
    for t in mine:
        fast = learner.clone()
        fast.adapt(md.share(MSE(fast(t.support.x), t.support.y), t.support))
        total = total + md.share(MSE(fast(t.query.x), t.query.y), t.query) / mine.n
    total.backward()
    learner.sync_grads()
    return _grads(learner)


# --- a slice of a meta-batch ---------------------------------------------------------------


def _four_tasks() -> list[md.Task]:
    x = torch.linspace(-1, 1, 6, dtype=torch.float64)[:, None]
    return [md.Task(md.Batch(x, (i + 1) * x.sin(), 6), md.Batch(x, (i + 1) * x.cos(), 6)) for i in range(4)]


def sliced_meta_batch(layout: str, pick: slice) -> list[float]:
    """The meta-gradient of ``learner.shard(tasks)[pick]`` (using fewer tasks this step)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1, steps=2), _mesh(layout))
    learner.meta_loss(learner.shard(_four_tasks())[pick], MSE).backward()
    learner.sync_grads()
    return _grads(learner)


def sliced_reference(pick: slice) -> list[float]:
    """The same on one process, with no MetaDDP: a plain list of the picked tasks."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    alg = md.MAML(net, inner_lr=0.1, steps=2)
    alg.meta_loss(_four_tasks()[pick], MSE).backward()
    return [v for p in alg.parameters() for v in p.grad.reshape(-1).tolist()]
