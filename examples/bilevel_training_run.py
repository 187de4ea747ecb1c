"""Data weights learned through a whole training run: the exact metagradient of a model's
validation loss after T minibatch steps of training, on one process or many.

The digits, with 40% of 500 training labels wrong. The inner problem is a whole training run
of a small MLP from a fixed initialisation: T steps of SGD with momentum, each on its own
minibatch of 32 (``md.bilevel.Minibatches``), on the training loss weighted per sample by a
Meta-Weight-Net of the sample's loss. The outer loss is the trained model's cross-entropy on
100 clean validation images. ``memory=md.Replay()`` differentiates exactly through all T
steps, keeping a few dozen states instead of T. Adam trains the weighting on that
metagradient (``--method exact``), or on the one of the last step only (``--method
truncated``, ``md.bilevel.Truncated(1)``); a model then trained from scratch with the learned
weighting is scored on 600 test images, beside plain training on the noisy labels.

    python examples/bilevel_training_run.py                        # about a minute
    python examples/bilevel_training_run.py --method truncated
    torchrun --nproc-per-node 2 examples/bilevel_training_run.py   # the same numbers
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import metaddp as md
from metaddp.tasks.digits import load

TRAIN, VAL, TEST, NOISE, LR, MOMENTUM = 500, 100, 600, 0.4, 0.1, 0.9


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)  # every run, inner or final, starts from these weights
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def ce(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(pred, y, reduction="none")


def data() -> tuple[tuple[torch.Tensor, ...], ...]:
    images, labels = load()
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(labels), generator=g)
    train, val = order[:TRAIN], order[TRAIN : TRAIN + VAL]
    test = order[TRAIN + VAL : TRAIN + VAL + TEST]
    noisy = labels[train].clone()
    flip = torch.rand(TRAIN, generator=g) < NOISE
    noisy[flip] = (noisy[flip] + torch.randint(1, 10, (int(flip.sum()),), generator=g)) % 10
    return (images[train], noisy), (images[val], labels[val]), (images[test], labels[test])


def train(x: torch.Tensor, y: torch.Tensor, weighting: nn.Module | None, steps: int, batch: int,
          seed: int) -> nn.Module:
    """A plain training run with the inner problem's minibatches (and weighting)."""
    net, draws = mlp(seed), md.bilevel.Minibatches(batch, seed)
    opt = torch.optim.SGD(net.parameters(), LR, momentum=MOMENTUM)
    for step in range(steps):
        rows = draws.indices(len(y), step)
        losses = ce(net(x[rows]), y[rows])
        if weighting is not None:
            with torch.no_grad():
                w = weighting(losses.detach())
            losses = w * losses
        opt.zero_grad()
        losses.mean().backward()
        opt.step()
    return net


def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((net(x).argmax(-1) == y).double().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-steps", type=int, default=200, help="T: inner training steps")
    p.add_argument("--batch", type=int, default=32, help="inner minibatch size")
    p.add_argument("--outer-steps", type=int, default=30)
    p.add_argument("--method", choices=("exact", "truncated"), default="exact")
    p.add_argument("--seed", type=int, default=0, help="initialisation, minibatches, weighting")
    a = p.parse_args()
    md.init()
    (xt, yt), (xv, yv), (xs, ys) = data()
    torch.manual_seed(1000 + a.seed)
    weighting = md.bilevel.WeightNet(hidden=16)
    method = md.bilevel.Unrolled() if a.method == "exact" else md.bilevel.Truncated(1)
    problem = md.Bilevel(
        mlp(a.seed),
        weights=weighting,
        inner_loss=ce,
        outer_loss=ce,
        start="current",  # the model is never stepped: every run starts from its initialisation
        steps=a.run_steps,
        optimizer=md.inner.sgd(LR, momentum=MOMENTUM),
        minibatches=md.bilevel.Minibatches(a.batch, a.seed),
        method=method,
        memory=md.Replay() if a.method == "exact" else "default",
    )
    learner = md.MetaDDP(problem, md.Mesh.create())
    opt = torch.optim.Adam(weighting.parameters(), 1e-2)
    task = [md.Task(md.Batch(xt, yt, TRAIN), md.Batch(xv, yv, VAL))]
    for step in range(a.outer_steps):
        opt.zero_grad()
        loss = learner.meta_loss(learner.shard(task))
        loss.backward()
        learner.sync_grads()
        opt.step()
        if step % 10 == 0 or step == a.outer_steps - 1:
            value = float(learner.global_value(loss))
            if md.rank() == 0:
                print(f"outer step {step:3d}: validation loss after the run {value:.4f}")
    plain = accuracy(train(xt, yt, None, a.run_steps, a.batch, a.seed), xs, ys)
    weighted = accuracy(train(xt, yt, weighting, a.run_steps, a.batch, a.seed), xs, ys)
    if md.rank() == 0:
        print(f"test accuracy: plain training {plain:.4f}, "
              f"learned weighting ({a.method}) {weighted:.4f}")
    md.shutdown()


if __name__ == "__main__":
    main()
