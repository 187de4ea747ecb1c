"""docs/algorithms.md's first block as a complete program: one training loop serves every
algorithm (here Meta-SGD) on sinusoid tasks. Runs on any number of processes:

    python examples/algorithms_loop.py                         # one plain process
    torchrun --nproc-per-node 2 examples/algorithms_loop.py    # the same numbers on two
"""

import torch
from quickstart import per_sample_loss as loss_fn
from quickstart import task
from torch import nn

import metaddp


def main(steps: int = 3, n_tasks: int = 4) -> list[float]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 1))
    losses = []
    metaddp.init()                                   # torchrun's environment, or one process
    world = metaddp.world_size()                     # 2 task groups on an even world, else 1
    mesh = metaddp.Mesh.create(tasks=2 if world % 2 == 0 else 1)
    alg = metaddp.MetaDDP(metaddp.MetaSGD(net, inner_lr=0.1, steps=1), mesh)
    opt = torch.optim.Adam(alg.parameters(), 1e-3)
    for step in range(steps):
        all_tasks = [task(step * n_tasks + i) for i in range(n_tasks)]  # the global meta-batch
        tasks = alg.shard(all_tasks)                     # this rank's tasks, cut to its samples
        loss = alg.meta_loss(tasks, loss_fn)             # this rank's share
        opt.zero_grad(); loss.backward(); alg.sync_grads(); opt.step()  # noqa: E702
        losses.append(float(alg.global_value(loss)))
    if metaddp.rank() == 0:
        print("meta-loss per step:", " ".join(f"{v:.6f}" for v in losses))
    return losses


if __name__ == "__main__":
    main()
    metaddp.shutdown()
