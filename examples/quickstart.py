"""The README's one-screen API as a runnable script: sinusoid MAML on a task x sample mesh.
It runs on any number of processes, with the same numbers to rounding.

    python examples/quickstart.py                         # one plain process
    torchrun --nproc-per-node 4 examples/quickstart.py    # 2 task groups x 2 ranks each
"""

import torch
import torch.nn.functional as F
from torch import nn

import metaddp as md


def task(i: int, seed: int = 0, shots: int = 10) -> md.Task:
    """Sinusoid task i: a function of the seed and the global index only."""
    g = md.generator_for(seed, i)
    amp, phase = 0.1 + 4.9 * torch.rand((), generator=g), torch.pi * torch.rand((), generator=g)
    x = 10 * torch.rand(2 * shots, 1, generator=g) - 5
    y = amp * torch.sin(x - phase)
    return md.Task(md.Batch(x[:shots], y[:shots], shots), md.Batch(x[shots:], y[shots:], shots))


def per_sample_loss(pred, y):
    return F.mse_loss(pred, y, reduction="none")


def main(steps: int = 20, n_tasks: int = 8) -> list[float]:
    md.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
    mesh = md.Mesh.create(tasks=2 if md.world_size() % 2 == 0 else 1)
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.01), mesh)
    opt = torch.optim.Adam(learner.parameters(), 1e-3)
    losses = []
    for step in range(steps):
        tasks = learner.shard(n_tasks, lambda i: task(step * n_tasks + i))  # this rank's part  # noqa: B023
        opt.zero_grad()
        loss = learner.meta_loss(tasks, per_sample_loss)
        loss.backward()
        learner.sync_grads()
        opt.step()
        losses.append(float(learner.global_value(loss)))
    if md.rank() == 0:
        print(f"meta-loss: step 0 {losses[0]:.3f} -> step {steps - 1} {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main()
    md.shutdown()
