"""Collectives per meta-step: K forward + K backward + 1 sample-parallel, 1 task-parallel,
whatever the number of parameter tensors; and exactly the elements the derivation needs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metaddp
from metaddp.distributed.launch import run_local

N_TASKS, N_SUPPORT, N_QUERY = 3, 6, 5


def mlp(depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(2, 8), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    layers.append(nn.Linear(8, 1))
    return nn.Sequential(*layers).double()


def task(i: int) -> metaddp.Task:
    g = metaddp.generator_for(7, i)
    x = torch.randn(N_SUPPORT + N_QUERY, 2, generator=g, dtype=torch.float64)
    y = x.sum(1, keepdim=True).sin()
    return metaddp.Task(metaddp.Batch(x[:N_SUPPORT], y[:N_SUPPORT], N_SUPPORT),
                        metaddp.Batch(x[N_SUPPORT:], y[N_SUPPORT:], N_QUERY))


def loss_fn(pred, y):
    return F.mse_loss(pred, y, reduction="none")


CONFIGS = [
    (layout, steps, depth, batched)
    for layout in ("sample", "task")
    for steps in (1, 3)
    for depth in (2, 6)
    for batched in (True, False)
]


def count_worker(configs):
    world = metaddp.world_size()
    out = []
    for layout, steps, depth, batched in configs:
        mesh = metaddp.Mesh.create(tasks=1 if layout == "sample" else world)
        net = mlp(depth)
        m = metaddp.MetaDDP(metaddp.MAML(net, inner_lr=0.1, steps=steps, batched=batched), mesh)
        made = []
        for _ in range(3):  # steps 0 and 1 are checked, step 2 is not
            tasks = m.shard(N_TASKS, task)  # a MetaBatch knows the global task count: no collective
            with metaddp.counting() as stats:
                loss = m.meta_loss(tasks, loss_fn)
                loss.backward()
                m.sync_grads()
            made.append(stats)
            net.zero_grad(set_to_none=True)
        n_params = sum(p.numel() for p in net.parameters())
        stats = made[-1]
        out.append(dict(calls=stats.calls, elements=stats.elements, bytes=stats.bytes, checked=made[0].calls,
                        n_local=len(tasks.tasks), P=n_params, tensors=len(list(net.parameters()))))
    return out


@pytest.fixture(scope="module")
def counts():
    return run_local(count_worker, 2, CONFIGS, threads=1)


def test_collectives_per_meta_step(counts):
    assert not metaddp.distributed._collectives.strict()  # the header exchange of strict mode adds calls
    for rank, per_rank in enumerate(counts):
        for (layout, steps, _depth, batched), c in zip(CONFIGS, per_rank):
            where = f"rank {rank}: {layout}-parallel, K={steps}, {c['tensors']} tensors, batched={batched}"
            # Final reduction: every gradient, one has-gradient flag per tensor, the
            # single-backward vote that decides when sums may start early, the meta-loss
            # share (the guards' finiteness check rides along), the guards' verdicts (one
            # loss per sample? a draw from a generator of its own, numpy's or Python's? a
            # finite meta-gradient?), one tag.
            final = c["P"] + c["tensors"] + 6
            # A checked step (the first) adds one small collective: the ranks' agreement on
            # the work the step did (its loss function, the caller's shares).
            assert c["checked"] == c["calls"] + 1, where
            if layout == "task":
                assert c["calls"] == 1, where
                assert c["elements"] == final, where
                continue
            # Sample-parallel: every rank adapts all 3 tasks. Stacked, one inner all-reduce per
            # step carries every task's gradient (3P values + tag), forward and backward;
            # looped, each task has its own.
            per_step = 1 if batched else N_TASKS
            assert c["calls"] == 2 * steps * per_step + 1, where
            assert c["elements"] == 2 * steps * (N_TASKS * c["P"] + per_step) + final, where
            assert c["bytes"] == 8 * c["elements"], where  # float64


def test_call_count_independent_of_tensor_count(counts):
    by_config = dict(zip(CONFIGS, counts[0]))
    for layout in ("sample", "task"):
        for steps in (1, 3):
            shallow, deep = by_config[(layout, steps, 2, True)], by_config[(layout, steps, 6, True)]
            assert deep["tensors"] > 2 * shallow["tensors"]
            assert deep["calls"] == shallow["calls"] == (2 * steps + 1 if layout == "sample" else 1)
