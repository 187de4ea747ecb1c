"""The leaf-gradient sum overlapped with the backward: launched during it, same sums as after it,
and the behaviours of sync_grads kept (missing gradients, ranks without data, accumulation)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metaddp
from metaddp.distributed.launch import run_local

WORLDS = (2, 3)
N = 7
# Float64: the world size only regroups the sums of per-sample gradients (a few ulps); a
# missing or doubled contribution would be off by 1e-2 or more.
RTOL = 1e-12


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        # Registered first, so its bucket is the last to launch (reverse order, as in DDP).
        self.unused = nn.Linear(2, 2)  # never used
        self.body = nn.Linear(3, 4)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)
        self.extra = nn.Linear(4, 1)  # trained by rank 0's data only
        self.double()

    def features(self, x):
        return torch.tanh(self.mid(torch.tanh(self.body(x))))


def data(n: int = N, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).cos()


def loss_share(net: Net, x, y, n: int, extra: bool):
    h = net.features(x)
    loss = metaddp.share(F.mse_loss(net.out(h), y, reduction="none"), n)
    if extra:
        loss = loss + metaddp.share(net.extra(h).squeeze(1) ** 2, n)
    return loss


def reference(n: int, seed: int, extra_rows: range) -> dict:
    """Whole-batch gradient on one process; ``extra`` sees only ``extra_rows``."""
    net = Net()
    x, y = data(n, seed)
    h = net.features(x)
    loss = F.mse_loss(net.out(h), y) + (net.extra(h[extra_rows.start:extra_rows.stop]).squeeze(1) ** 2).sum() / n
    loss.backward()
    return {k: p.grad.clone() for k, p in net.named_parameters() if p.grad is not None}


WARMUP = 3  # steps of one backward each: after two agreed ones, sums start during backward


def one_step(overlap: bool, bucket_bytes: int, n: int, strict: bool = False, allow_unused: bool = True):
    """``WARMUP`` meta-steps, then one measured: backward + sync_grads; grads and call timing."""
    metaddp.set_strict(strict)
    try:
        net = Net()
        m = metaddp.MetaDDP(net, overlap=overlap, bucket_bytes=bucket_bytes, allow_unused=allow_unused)
        x, y = data(n)
        r = metaddp.shard_range(n, m.mesh.sample_index, m.mesh.samples)
        for _ in range(WARMUP + 1):
            net.zero_grad(set_to_none=True)
            loss = loss_share(net, x[r.start:r.stop], y[r.start:r.stop], n, extra=metaddp.rank() == 0)
            with metaddp.counting() as during:
                loss.backward()
            with metaddp.counting() as after:
                m.sync_grads()
        grads = {k: (p.grad.clone() if p.grad is not None else None) for k, p in net.named_parameters()}
        return dict(grads=grads, during=during.calls, after=after.calls)
    finally:
        metaddp.set_strict(False)


def accumulate(net, m, r, seeds, no_sync_first=False):
    """One step: a backward per seed (as code that calls backward once per task), one sync."""
    net.zero_grad(set_to_none=True)
    with metaddp.counting() as stats:
        for j, seed in enumerate(seeds):
            x, y = data(N, seed)
            ctx = m.no_sync() if (no_sync_first and j < len(seeds) - 1) else contextlib.nullcontext()
            with ctx:
                loss_share(net, x[r.start:r.stop], y[r.start:r.stop], N, extra=True).backward()
        during = stats.calls
        m.sync_grads()
    return {k: p.grad.clone() for k, p in net.named_parameters() if p.grad is not None}, during, stats.calls


def worker():
    res = {}
    tiny = 8  # bytes: every parameter tensor is a bucket of its own
    res["overlap_tiny"] = one_step(True, tiny, N)
    res["overlap_big"] = one_step(True, 25 * 2**20, N)
    res["plain_tiny"] = one_step(False, tiny, N)
    res["strict"] = one_step(True, tiny, N, strict=True)
    res["empty_shard"] = one_step(True, tiny, 2)  # on 3 ranks rank 2 holds no sample
    try:
        one_step(True, tiny, N, allow_unused=False)
        res["missing"] = None
    except ValueError as e:
        res["missing"] = str(e)

    r = metaddp.shard_range(N, metaddp.rank(), metaddp.world_size())
    # Several backward passes per step from the start (once per task): never launched early,
    # summed right, every step.
    net = Net()
    m = metaddp.MetaDDP(net, allow_unused=True, bucket_bytes=tiny)
    res["per_task"] = [accumulate(net, m, r, (0, 1)) for _ in range(WARMUP + 1)]
    # After single-pass steps, a second backward pass in one step: an error saying what to do.
    net = Net()
    m = metaddp.MetaDDP(net, allow_unused=True, bucket_bytes=tiny)
    for _ in range(WARMUP):
        accumulate(net, m, r, (0,))
    try:
        accumulate(net, m, r, (0, 1))
        res["twice"] = None
    except RuntimeError as e:
        res["twice"] = str(e)
    # ... and inside no_sync the gradients of two batches accumulate, then are summed once.
    net = Net()
    m = metaddp.MetaDDP(net, allow_unused=True, bucket_bytes=tiny)
    for _ in range(WARMUP):
        accumulate(net, m, r, (0,))
    res["accumulated"], res["accumulated_during"], res["accumulated_calls"] = accumulate(
        net, m, r, (0, 1), no_sync_first=True)
    return res


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_local(worker, request.param, threads=1)


def close(got: dict, want: dict) -> bool:
    scale = max(float(v.abs().max()) for v in want.values())
    return all(float((got[k] - want[k]).abs().max()) <= RTOL * scale for k in want)


def test_overlapped_sums_are_the_whole_batch_gradient(results):
    world, per_rank = results
    rank0 = metaddp.shard_range(N, 0, world)
    want = reference(N, 0, rank0)
    n_trained = 8  # body, mid, out, extra: weight and bias each (unused: no gradient anywhere)
    for rank, res in enumerate(per_rank):
        for key in ("overlap_tiny", "overlap_big", "plain_tiny", "strict"):
            got = res[key]["grads"]
            assert got["unused.weight"] is None and got["unused.bias"] is None, (rank, key)
            assert close(got, want), (world, rank, key)
        # Same numbers with and without overlap. Two ranks: a + b either way, bitwise. Three:
        # gloo's summation order follows the buckets' layout, so equal up to rounding.
        same, plain = res["overlap_tiny"]["grads"], res["plain_tiny"]["grads"]
        if world == 2:
            assert all(torch.equal(same[k], plain[k]) for k in want)
        else:
            assert close(same, {k: plain[k] for k in want})
        buckets = n_trained + 2  # one per tensor with 8-byte buckets, the unused ones included
        # Launch order is extra, out, mid, body, unused. Rank 0 has every trained gradient and
        # launches those 8 buckets during backward; the unused ones wait for sync_grads. The
        # other ranks never get a gradient for ``extra``, the first bucket, so to keep the
        # collectives in the same order on every rank they launch everything in sync_grads.
        if rank == 0:
            assert (res["overlap_tiny"]["during"], res["overlap_tiny"]["after"]) == (n_trained, 2)
        else:
            assert (res["overlap_tiny"]["during"], res["overlap_tiny"]["after"]) == (0, buckets)
        # Without overlap all flags travel together, in one more bucket of their own here.
        assert res["plain_tiny"]["during"] == 0 and res["plain_tiny"]["after"] == buckets + 1
        assert res["overlap_big"]["during"] + res["overlap_big"]["after"] == 1


def test_empty_shard_and_missing_gradients(results):
    world, per_rank = results
    want = reference(2, 0, metaddp.shard_range(2, 0, world))
    for rank, res in enumerate(per_rank):
        assert close(res["empty_shard"]["grads"], want), (world, rank)
        assert "unused.weight" in res["missing"] and "allow_unused=True" in res["missing"]


def test_per_task_backward_no_sync_and_a_late_second_pass(results):
    world, per_rank = results
    everyone = range(0, N)  # in this part every rank trains ``extra`` on its own rows
    a, b = reference(N, 0, everyone), reference(N, 1, everyone)
    want = {k: a[k] + b[k] for k in a}
    for rank, res in enumerate(per_rank):
        for step, (grads, during, calls) in enumerate(res["per_task"]):
            assert close(grads, want), (world, rank)
            # All 10 buckets in sync_grads, every step; on checked steps (0, 1, 4, 16, ...) one
            # collective gathers what the ranks computed (their md.share records, loss prints).
            assert during == 0 and calls == 10 + (1 if step in (0, 1) else 0), (step, calls)
        assert "no_sync" in res["twice"] and "overlap=False" in res["twice"]
        assert close(res["accumulated"], want), (world, rank)
        # Early launching was on: the 8 trained buckets went during the last backward.
        assert (res["accumulated_during"], res["accumulated_calls"]) == (8, 10)
