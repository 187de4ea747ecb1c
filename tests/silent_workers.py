"""Rank functions for tests/test_silent_cells.py: the loops a researcher porting one-process
code writes by hand, with dropout left on, each returning its meta-gradient or its error."""

from __future__ import annotations

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
    except ValueError as e:
        return {"error": str(e)}


def _mesh(layout: str) -> md.Mesh:
    return md.Mesh.create(tasks=md.world_size()) if layout == "task" else md.Mesh.create()


def anil_clone(layout: str, dropout: float) -> dict:
    """ANIL's clone() loop: its body runs outside metaddp's forwards."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Dropout(dropout)).double()
    learner = md.MetaDDP(md.ANIL(body, nn.Linear(8, 1).double(), inner_lr=0.1), _mesh(layout))

    def step() -> list[float]:
        mine = learner.shard(_tasks())
        total = torch.zeros((), dtype=torch.float64)
        for t in mine:
            fast = learner.clone()
            fast.adapt(md.share(MSE(fast(t.support.x), t.support.y), t.support))
            total = total + md.share(MSE(fast(t.query.x), t.query.y), t.query) / mine.n
        total.backward()
        learner.sync_grads()
        return _grads(learner)

    return _outcome(step)


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
