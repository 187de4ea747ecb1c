"""docs/algorithms.md's CUDA-graph loop as a complete program: second-order MAML on sinusoid
tasks, its meta-step recorded once by ``md.distributed.CapturedStep`` and replayed, on a CUDA
device; without one, the same loop runs the step eagerly (what the recorded step replays).
Runs on any number of processes (eagerly, on the CPU: the same meta-losses):

    python examples/algorithms_graphs.py
    torchrun --nproc-per-node 2 examples/algorithms_graphs.py
"""

import torch
from quickstart import per_sample_loss as loss_fn
from quickstart import task
from torch import nn

import metaddp as md


def main() -> None:
    md.init()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 1)).to(device)
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.01, steps=2), md.Mesh.create())
    optimizer = torch.optim.Adam(learner.parameters(), 1e-3)
    n_tasks = 4
    def on_device(i: int) -> md.Task:
        return md.Task(*(md.Batch(b.x.to(device), b.y.to(device), b.n) for b in task(i)))

    batches = [learner.shard(n_tasks, lambda i, s=s: on_device(s * n_tasks + i)) for s in range(6)]
    if device.type == "cuda" and md.world_size() == 1:
        step = md.distributed.CapturedStep(learner, loss_fn)  # MetaDDP on NCCL or one process
    else:  # no CUDA device here: the step CapturedStep records, run eagerly

        def step(tasks):
            loss = learner.meta_loss(tasks, loss_fn)
            loss.backward()
            return loss

    for tasks in batches:                           # MetaBatch from learner.shard(...), same shapes
        optimizer.zero_grad()
        loss = step(tasks)                          # = learner.meta_loss(tasks, loss_fn).backward()
        learner.sync_grads()
        optimizer.step()
        value = float(learner.global_value(loss))
        if md.rank() == 0:
            print(f"meta-loss {value:.6f}")
    md.shutdown()


if __name__ == "__main__":
    main()
