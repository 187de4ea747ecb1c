"""The question's recipe, as the user wrote it, on CPU with gloo: DistributedDataParallel plus
a second DDP module whose ``_parameters`` are overwritten with ``w - lr * w.grad``.

It prints the gradient after the meta step on 1, 2 and 4 ranks: 7.02, 6.52, 5.52. The second
backward runs through tensors DDP has no hooks on, so each rank keeps its own shard's gradient
(7.02 = 3.51 + 3.51; 6.52 = 3.51 + 3.01; 5.52 = 3.51 + 2.01). Compare ``seed_metaddp.py``.

    python examples/seed_ddp.py
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from metaddp.distributed.launch import run_local


def put_theta(model, theta):  # the user's helper, unchanged
    def k_param_fn(tmp_model, name=None):
        if len(tmp_model._modules) != 0:
            for k, v in tmp_model._modules.items():
                k_param_fn(v, name=str(k) if name is None else str(name + "." + k))
        else:
            for k, v in tmp_model._parameters.items():
                if isinstance(v, torch.Tensor):
                    tmp_model._parameters[k] = theta[str(name + "." + k)]

    k_param_fn(model)
    return model


def get_updated_network(old, new, lr):  # the user's helper, unchanged (load=False path)
    updated_theta = {}
    state_dicts = old.state_dict()
    param_dicts = dict(old.named_parameters())
    for k, _v in state_dicts.items():
        if k in param_dicts and param_dicts[k].grad is not None:
            updated_theta[k] = param_dicts[k] - lr * param_dicts[k].grad
        else:
            updated_theta[k] = state_dicts[k]
    return put_theta(new, updated_theta)


class Datax(Dataset):
    def __getitem__(self, item):
        return torch.tensor([0.01, 10, 0.4, 33]).view(4).float() + item

    def __len__(self):
        return 100


class Net2(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Linear(4, 1, bias=False))

    def forward(self, x):
        return self.conv(x).mean()


def train() -> float:
    """One meta step of the user's code on this rank; returns rank 0's ``grad2``."""
    torch.manual_seed(1234)
    world = dist.get_world_size()
    net = DistributedDataParallel(Net2(), find_unused_parameters=True)
    net2 = DistributedDataParallel(Net2(), find_unused_parameters=True)
    sampler = DistributedSampler(Datax(), shuffle=False)
    loader = DataLoader(Datax(), batch_size=8 // world, shuffle=False, sampler=sampler)
    data = next(iter(loader))
    l1 = net(data).mean()
    net.zero_grad()
    l1.backward(retain_graph=True)
    net2 = get_updated_network(net, net2, 1)
    l2 = net2(data).mean()
    l2.backward()
    grad2 = float(net.module.conv[0].weight.grad[0, 0])
    # The recipe leaves net2's reducer waiting for a gradient reduction that never comes;
    # release both modules on every rank before the process group goes away, or gloo can
    # abort at exit ("terminate called without an active exception").
    del net, net2
    gc.collect()
    dist.barrier()
    return grad2


def refuse_launcher() -> None:
    """This script starts its own processes: under torchrun each of them would start more."""
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        sys.exit("seed_ddp.py starts its own 1, 2 and 4 processes: run it with plain python "
                 "(python examples/seed_ddp.py), not under torchrun")


if __name__ == "__main__":
    refuse_launcher()
    for ranks in (1, 2, 4):
        print(f"plain DDP, {ranks} rank(s): grad2 = {run_local(train, ranks)[0]:.2f}")
