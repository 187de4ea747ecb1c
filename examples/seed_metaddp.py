"""The question's scenario written with metaddp: the same model, data (a batch of 8 split over
the ranks), one inner step with lr 1, and the objective ``l1(w) + l2(w - lr * grad l1(w))``.

The gradient after the meta step is 7.02 on every world size, first order and with
``create_graph=True`` (true second order), for as many iterations as you like. Compare
``seed_ddp.py``, the user's DistributedDataParallel recipe (7.02 / 6.52 / 5.52).

    python examples/seed_metaddp.py                       # 1, 2 and 4 local processes
    torchrun --nproc-per-node 2 examples/seed_metaddp.py --here   # under a launcher
"""

import argparse

import torch
import torch.nn as nn

import metaddp as md
from metaddp.distributed.launch import run_local


class Net2(nn.Module):
    """The user's model. Its forward returned ``conv(x).mean()`` over the batch; it now returns
    one value per sample, whose global mean is that loss, so each rank can take its share."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Linear(4, 1, bias=False))

    def forward(self, x):
        return self.conv(x).mean(dim=-1)


def train(second_order: bool, iterations: int) -> list[float]:
    """Rank code: returns grad2 (the [0, 0] entry of the meta-gradient) per iteration."""
    torch.manual_seed(1234)
    data = torch.tensor([0.01, 10, 0.4, 33]) + torch.arange(100.0)[:, None]  # the user's Datax
    net = md.MetaDDP(Net2())               # replaces DistributedDataParallel
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    mesh = net.mesh                        # default: every rank splits every batch
    grad2 = []
    for i in range(iterations):
        batch = data[8 * i : 8 * (i + 1)]  # the global batch of 8 ...
        # ... this rank's part (the outputs are the losses: the inputs stand in for targets)
        part = md.Batch.split(batch, batch, mesh.sample_index, mesh.samples)
        x = part.x
        opt.zero_grad()
        w = md.functional.params_of(net.module)
        l1 = md.share(net(x), part)        # this rank's share of the mean over the global batch
        # The gradient of the global l1 (autograd.grad, then a differentiable SUM over ranks).
        # First order must keep l1's graph: it is backpropagated again below.
        g = net.grad(l1, w, create_graph=second_order, retain_graph=True)
        fast = {k: p - 1.0 * g[k] for k, p in w.items()}           # functional fast weights
        l2 = md.share(md.functional.call(net.module, fast, x), part)
        (l1 + l2).backward()
        net.sync_grads()                   # SUM of shares = the gradient of the global loss
        grad2.append(float(net.module.conv[0].weight.grad[0, 0]))
        opt.step()
    return grad2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--world-sizes", default="1,2,4")
    p.add_argument("--here", action="store_true", help="run as one rank under torchrun")
    args = p.parse_args()
    if args.here:
        md.init()
        for order in (False, True):
            print(f"rank {md.rank()}, {'2nd' if order else '1st'} order, grad2:",
                  " ".join(f"{g:.2f}" for g in train(order, args.iterations)))
        md.shutdown()
        return
    for order in (False, True):
        for ranks in map(int, args.world_sizes.split(",")):
            g = run_local(train, ranks, order, args.iterations)[0]
            print(f"metaddp, {'2nd' if order else '1st'} order, {ranks} rank(s): grad2 = "
                  + " ".join(f"{v:.2f}" for v in g))


if __name__ == "__main__":
    main()
