"""docs/bilevel.md's first block as a complete program: Meta-Weight-Net's reweighting of noisy
labels by the hypergradient of a one-step lookahead, on a small synthetic problem (4 features,
3 classes, 30% of 48 training labels wrong, 12 clean ones). Runs on any number of processes:

    python examples/bilevel_reweight.py                         # one plain process
    torchrun --nproc-per-node 2 examples/bilevel_reweight.py    # the same numbers on two
"""

import torch
import torch.nn.functional as F
from torch import nn

import metaddp as md


def data(n: int, noise: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples whose class is the argmax of a fixed projection; a fraction `noise` flipped."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    w = torch.tensor([[1.0, -1.0, 0.5], [0.5, 1.0, -1.0], [-1.0, 0.5, 1.0], [0.0, 0.0, 0.0]])
    y = (x @ w).argmax(1)
    flip = torch.rand(n, generator=g) < noise
    return x, torch.where(flip, (y + 1) % 3, y)


def main(steps: int = 4) -> list[float]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    x_noisy, y_noisy = data(48, 0.3, seed=1)
    x_clean, y_clean = data(12, 0.0, seed=2)
    losses = []
    md.init()
    weights = md.bilevel.WeightNet()        # Meta-Weight-Net: a sample's loss -> its weight
    problem = md.Bilevel(
        net,
        weights=weights,                      # inner loss = weights(losses) * losses
        start="current",                      # a lookahead from the model's current weights
        train_inner=True,                     # ... which the same step trains on the weighted loss
        steps=1, optimizer=md.inner.sgd(0.1),       # the lookahead: one SGD step
        method=md.bilevel.Unrolled(),           # or Truncated, ImplicitCG, Neumann, T1T2, SAMA
    )
    learner = md.MetaDDP(problem, md.Mesh.create())   # every rank splits both batches
    opt = torch.optim.Adam(learner.parameters(), 1e-3)
    per_sample = lambda pred, y: F.cross_entropy(pred, y, reduction="none")  # noqa: E731
    for _step in range(steps):
        pair = learner.shard([md.Task(md.Batch(x_noisy, y_noisy, len(y_noisy)),
                                      md.Batch(x_clean, y_clean, len(y_clean)))])
        opt.zero_grad()
        loss = learner.meta_loss(pair, per_sample)  # this rank's share of the clean loss
        loss.backward()                             # the hypergradient, and the model's gradient
        learner.sync_grads()                        # SUM over ranks
        opt.step()
        losses.append(float(learner.global_value(loss)))
    if md.rank() == 0:
        print("clean loss per step:", " ".join(f"{v:.6f}" for v in losses))
    return losses


if __name__ == "__main__":
    main()
    md.shutdown()
