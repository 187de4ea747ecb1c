"""docs/migration.md's learn2learn loop written with metaddp, as a complete program: `clone()`
and `adapt(loss)` on small 3-way classification tasks. Runs on any number of processes:

    python examples/migration_learn2learn.py
    torchrun --nproc-per-node 2 examples/migration_learn2learn.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import metaddp


def classification_task(i: int, ways: int = 3, shots: int = 4) -> metaddp.Task:
    """Task i: `ways` Gaussian classes in 5 dimensions, from the seed and i alone."""
    g = metaddp.generator_for(0, i)
    centres = 2 * torch.randn(ways, 5, generator=g)
    y = torch.arange(ways).repeat(2 * shots)
    x = centres[y] + torch.randn(len(y), 5, generator=g)
    n = ways * shots
    return metaddp.Task(metaddp.Batch(x[:n], y[:n], n), metaddp.Batch(x[n:], y[n:], n))


def main(meta_steps: int = 3, steps: int = 2, n_tasks: int = 4) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    metaddp.init()
    losses = []
    alg = metaddp.MetaDDP(metaddp.MAML(model, inner_lr=0.1))
    opt = torch.optim.Adam(alg.parameters(), 1e-3)
    for meta_step in range(meta_steps):
        all_tasks = [classification_task(meta_step * n_tasks + i) for i in range(n_tasks)]
        total = torch.zeros(())
        opt.zero_grad()
        batch = alg.shard(all_tasks)  # this rank's part of every task it works on
        for task in batch:
            s, q = task.support, task.query
            learner = alg.clone()
            for _ in range(steps):
                learner.adapt(metaddp.share(F.cross_entropy(learner(s.x), s.y, reduction="none"), s))  # noqa: E501
            loss = metaddp.share(F.cross_entropy(learner(q.x), q.y, reduction="none"), q)
            (loss / batch.n).backward()  # batch.n: tasks in the global meta-batch
            total = total + loss.detach() / batch.n
        alg.sync_grads()
        opt.step()
        losses.append(float(alg.global_value(total)))
    if metaddp.rank() == 0:
        print("meta-loss per step:", " ".join(f"{v:.6f}" for v in losses))
    return losses


if __name__ == "__main__":
    main()
    metaddp.shutdown()
