"""The question's own recipe, for ``metaddp verify --scenario seed``: one meta-step of a
one-weight model with torch's ``DistributedDataParallel`` (``examples/seed_ddp.py``), whose
meta-gradient changes with the number of ranks, beside metaddp's (:func:`scenarios.run_seed`),
which does not. Runs on real processes: every rank calls :func:`run_seed_ddp`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclasses.dataclass(frozen=True)
class SeedDDPProblem:
    """The user's own recipe for the same meta-step (``examples/seed_ddp.py``): torch's
    ``DistributedDataParallel``, a ``DistributedSampler`` cutting the batch of 8 over the
    ranks, and ``w - lr * w.grad`` written into a second DDP module's parameters. Its
    meta-gradient changes with the number of ranks: what metaddp is measured against."""

    batch_size: int = 8
    inner_lr: float = 1.0


class _Items(Dataset[Tensor]):
    """The user's ``Datax``, as a dataset (the rows of :func:`scenarios.seed_data`)."""

    def __getitem__(self, item: int) -> Tensor:
        return torch.tensor([0.01, 10, 0.4, 33]).view(4).float() + item

    def __len__(self) -> int:
        return 100


def _put_theta(model: nn.Module, theta: dict[str, Tensor]) -> nn.Module:
    """The user's helper: ``theta``'s tensors written into the modules' ``_parameters``."""

    def visit(module: nn.Module, name: str | None = None) -> None:
        if module._modules:
            for k, child in module._modules.items():
                assert child is not None
                visit(child, k if name is None else f"{name}.{k}")
        else:
            for k, v in module._parameters.items():
                if isinstance(v, Tensor):
                    module._parameters[k] = theta[f"{name}.{k}"]  # type: ignore[assignment]

    visit(model)
    return model


def run_seed_ddp(problem: SeedDDPProblem) -> dict:
    """One meta-step of the user's DDP recipe on this rank (every rank must call it): returns
    rank-local ``grad2`` (the [0, 0] entry of the first module's gradient after the second
    backward), and the two losses of this rank's shard.

    The second backward runs through tensors DDP has no hooks on, so nothing reduces it:
    each rank keeps its own shard's gradient (7.02 on one rank, 6.52 on rank 0 of two).
    """
    with _no_reducer_notes():
        return _recipe(problem)


def _recipe(problem: SeedDDPProblem) -> dict:
    torch.manual_seed(1234)
    world = dist.get_world_size() if dist.is_initialized() else 1
    net = DistributedDataParallel(Net2(), find_unused_parameters=True)
    net2 = DistributedDataParallel(Net2(), find_unused_parameters=True)
    items = _Items()
    sampler: DistributedSampler[Tensor] = DistributedSampler(items, shuffle=False)
    loader = DataLoader(items, batch_size=problem.batch_size // world, sampler=sampler)
    data = next(iter(loader))
    l1 = net(data).mean()
    net.zero_grad()
    l1.backward(retain_graph=True)
    # The user's get_updated_network: every parameter with a gradient takes its step.
    grads = {k: p.grad for k, p in net.named_parameters() if p.grad is not None}
    params = dict(net.named_parameters())
    theta = {
        k: params[k] - problem.inner_lr * grads[k] if k in grads else v
        for k, v in net.state_dict().items()
    }
    l2 = _put_theta(net2, theta)(data).mean()
    l2.backward()
    grad = net.module.conv[0].weight.grad
    assert grad is not None
    out = {"grad2": float(grad[0, 0]), "loss1": float(l1.detach()), "loss2": float(l2.detach())}
    # The recipe leaves net2's reducer waiting for a gradient reduction that never comes:
    # release both modules on every rank before anything else runs on the group.
    del net, net2, l1, l2
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
    return out


@contextlib.contextmanager
def _no_reducer_notes() -> Iterator[None]:
    """The standard error stream sent to /dev/null while the recipe runs: its
    ``find_unused_parameters=True`` makes DDP's reducer print, from C++ where Python's
    warnings filters do not reach, a note on every rank that the flag costs time. It says
    nothing of the numbers; an error still raises, and its traceback prints after."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Net2(nn.Module):
    """The user's ``Net2`` as they wrote it: the forward returns the batch mean."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Linear(4, 1, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x).mean()
