"""docs/algorithms.md's blocks on whole-batch statistics, transformers with dropout,
deterministic mode and float16 loss scaling, as one complete program on tiny problems.
It runs on any number of processes (deterministic mode's losses are the same bits):

    python examples/algorithms_modes.py
    torchrun --nproc-per-node 2 examples/algorithms_modes.py
"""

import torch
import torch.nn.functional as F
from quickstart import per_sample_loss as mse
from quickstart import task as sinusoid_task
from torch import nn

import metaddp
import metaddp as md


def statistics() -> list[float]:
    """Class means and a variance of the whole batch, from this rank's part of it."""
    ways, g = 3, torch.Generator().manual_seed(0)
    data, y = torch.randn(12, 4, generator=g), torch.arange(12) % ways
    learner = md.MetaDDP(md.MAML(nn.Linear(4, 2), inner_lr=0.1))
    mesh = learner.mesh
    part = md.Batch.split(data, y, mesh.sample_index, mesh.samples)  # this rank's samples
    features, labels, x, reduce = part.x, part.y, part.x, learner.reduce
    means, counts = metaddp.data.class_means(features, labels, ways, reduce=reduce)  # noqa: E501
    s, s2, n = metaddp.data.global_sums([x.sum(0), (x * x).sum(0), x.new_tensor(len(x))], reduce=reduce)  # noqa: E501
    variance = s2 / n - (s / n) ** 2                                            # the whole batch's
    learner.release()
    return [*means.flatten().tolist(), *counts.tolist(), *variance.tolist()]


def sequence_task(i: int, shots: int = 4) -> md.Task:
    """Task i: 4 steps of 2 features, a target per step with the task's own amplitude."""
    g = md.generator_for(1, i)
    amp = 1 + torch.rand((), generator=g)
    x = torch.randn(2 * shots, 4, 2, generator=g)
    y = amp * torch.sin(x.sum(-1, keepdim=True))
    return md.Task(md.Batch(x[:shots], y[:shots], shots), md.Batch(x[shots:], y[shots:], shots))


def per_sample_loss(pred, y):
    return F.mse_loss(pred, y, reduction="none").mean((1, 2))


def transformer(steps: int = 2, n_tasks: int = 2, seed: int = 0) -> list[float]:
    """Second-order MAML through attention, dropout on."""
    torch.manual_seed(0)
    embed, head = nn.Linear(2, 64), nn.Linear(64, 1)
    task = sequence_task
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)  # samples first
    maml = md.MAML(nn.Sequential(embed, layer, head), inner_lr=0.01, steps=2)  # second order
    learner = md.MetaDDP(maml, md.Mesh.create())   # dropout on: the same meta-gradient at any size
    opt = torch.optim.Adam(learner.parameters(), 1e-3)
    maml.draw_seed = seed                          # metaddp train sets it to --seed
    losses = []
    for step in range(steps):
        maml.at_step(step)                         # keys this step's masks (resumes continue them)
        loss = learner.meta_loss(learner.shard(n_tasks, task), per_sample_loss)
        opt.zero_grad()
        loss.backward()
        learner.sync_grads()
        opt.step()
        losses.append(float(learner.global_value(loss)))
    learner.release()
    return losses


def deterministic(steps: int = 2, n_tasks: int = 4) -> list[float]:
    """MAML whose losses are the same bits at any number of processes."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1))
    mesh = md.Mesh.create()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.01), mesh, deterministic=True)
    opt = torch.optim.SGD(learner.parameters(), 1e-2)
    losses = []
    for step in range(steps):
        tasks = learner.shard(n_tasks, lambda i: sinusoid_task(step * n_tasks + i))  # noqa: B023
        opt.zero_grad()
        loss = learner.meta_loss(tasks, mse)
        loss.backward()
        learner.sync_grads()
        opt.step()
        losses.append(float(learner.global_value(loss)))
    learner.release()
    return losses


def float16() -> list[float]:
    """MAML's float16 forward passes scale the inner loss (on by default), or not."""
    net = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1))
    learner = md.MAML(net, inner_lr=0.01, autocast=torch.float16, batched=False)
    learner.loss_scale  # noqa: B018 (the page shows it: LossScale(init=1024.0), on by default)
    first = learner.loss_scale.init
    learner.loss_scale = md.inner.LossScale(init=2.0**12)   # or None / False: off
    return [first, learner.loss_scale.init]


def main() -> list[float]:
    md.init()
    values = statistics() + transformer() + deterministic() + float16()
    if md.rank() == 0:
        print("class means, counts, variance, transformer meta-losses, deterministic meta-losses, "
              "float16 loss scales:")
        print(" ".join(f"{v:.9f}" for v in values))
    return values


if __name__ == "__main__":
    main()
    md.shutdown()
