"""Hyperparameters by hypergradient: per-layer learning rates and a weight decay of a small CNN on
the digits, learned while it trains, against the best of a grid; on one process or many.

Every step, the network takes a differentiable ``--lookahead``-step SGD trajectory from its
current weights with the current rates and decay (``Bilevel(start="current")``), scored on a
held-out validation batch; the exact hypergradient of that score trains the log-rates and the
log-decay (Adam), and the network itself takes one SGD step with them
(``train_inner=True``). The grid trains the same network with fixed rates and decays for as many
steps and keeps the one best on the validation images; both are scored on 600 test digits.

    python examples/bilevel_hyperparameters.py                        # about two minutes
    torchrun --nproc-per-node 2 examples/bilevel_hyperparameters.py   # the same numbers
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

import metaddp as md
from metaddp.tasks.digits import load

TEST, VAL = 600, 100
LAYERS = ("0", "3", "7")  # the Sequential's indices of the layers with weights


def cnn(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(32 * 2 * 2, 10),
    )  # fmt: skip


def ce(pred, y):
    return F.cross_entropy(pred, y, reduction="none")


def layer(name: str) -> str:
    return name.split(".")[0]


def batches(n: int, size: int, step: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(step))[:size]


def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((net(x).argmax(-1) == y).double().mean())


def fixed(data, lr: float, wd: float, steps: int, batch: int) -> nn.Module:
    (xt, yt), _, _ = data
    net = cnn(0)
    opt = torch.optim.SGD(net.parameters(), lr, weight_decay=wd)
    for step in range(steps):
        rows = batches(len(yt), batch, step)
        opt.zero_grad()
        F.cross_entropy(net(xt[rows]), yt[rows]).backward()
        opt.step()
    return net


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lookahead", type=int, default=5)
    a = p.parse_args()
    md.init()
    images, labels = load()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, val, train = order[:TEST], order[TEST : TEST + VAL], order[TEST + VAL :]
    data = [(images[i], labels[i]) for i in (train, val, test)]
    (xt, yt), (xv, yv), (xs, ys) = data

    net = cnn(0)
    hp = nn.ParameterDict({f"lr{k}": nn.Parameter(torch.tensor(math.log(0.03))) for k in LAYERS})
    hp["log_wd"] = nn.Parameter(torch.tensor(math.log(1e-3)))

    def decay(fast):
        return 0.5 * hp["log_wd"].exp() * sum((w * w).sum() for w in fast.values())

    def rates():
        return md.inner.sgd({k: hp[f"lr{layer(k)}"].exp() for k, _ in net.named_parameters()})

    problem = md.Bilevel(
        net, outer=hp, inner_loss=ce, outer_loss=ce, penalty=decay, start="current",
        train_inner=True, steps=a.lookahead, optimizer=rates,
    )  # fmt: skip
    learner = md.MetaDDP(problem)
    hyper_opt = torch.optim.Adam(hp.parameters(), 0.02)
    for step in range(a.steps):
        # The lookahead's steps each take one training batch; the score, a validation batch.
        rows = batches(len(yt), a.batch, step)
        vrows = batches(len(yv), a.batch, 10**6 + step)
        task = md.Task(
            md.Batch(xt[rows], yt[rows], a.batch), md.Batch(xv[vrows], yv[vrows], a.batch)
        )
        learner.zero_grad(set_to_none=True)
        learner.meta_loss(learner.shard([task])).backward()
        learner.sync_grads()
        with torch.no_grad():  # the network's own step, at the rates before this update
            for k, w in net.named_parameters():
                w -= hp[f"lr{layer(k)}"].exp() * w.grad
        hyper_opt.step()
    learned = {k: float(v.detach().exp()) for k, v in hp.items()}
    if md.rank() == 0:
        shown = ", ".join(f"{k.removeprefix('lr') and 'layer ' + k[2:]} lr {v:.3f}"
                          for k, v in learned.items() if k != "log_wd")  # fmt: skip
        print(f"learned: {shown}; weight decay {learned['log_wd']:.2e}")
        print(
            f"  test accuracy {accuracy(net, xs, ys):.4f}, validation {accuracy(net, xv, yv):.4f}"
        )
        grid = []
        for lr, wd in itertools.product((0.01, 0.03, 0.1, 0.3), (0.0, 1e-3, 1e-2)):
            trained = fixed(data, lr, wd, a.steps, a.batch)
            grid.append((accuracy(trained, xv, yv), accuracy(trained, xs, ys), lr, wd))
        v, t, lr, wd = max(grid)
        print(f"best of a 4 x 3 grid on validation: lr {lr}, weight decay {wd}: test accuracy "
              f"{t:.4f}, validation {v:.4f}")  # fmt: skip
        print(f"  the grid's test accuracies: {', '.join(f'{g[1]:.3f}' for g in sorted(grid))}")
    md.shutdown()


if __name__ == "__main__":
    main()
