"""A meta-step reads device values on the host once, at its end (``sync_grads``): no check
inside it waits for the device. CPU values are made to behave as a GPU's (deferred and
counted), and every dispatched operation is watched for ``.item()``-like reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import metaddp as md
from metaddp import _host
from metaddp.distributed import Mesh
from metaddp.distributed.launch import run_local
from metaddp.testing import scenarios as S
from metaddp.testing.dispatch import DispatchCounter

# The loop (a BatchNorm conv net: synchronized statistics, 2 inner steps) and the stacked
# path (the MLP), first and second order, and the low-memory mode.
PROBLEMS = [
    S.Problem("conv", batchnorm=True, steps=2, n_tasks=3, inner_lr=0.3, dtype=torch.float32),
    S.Problem("mlp", steps=3, dtype=torch.float32),
    S.Problem("mlp", steps=3, first_order=True, dtype=torch.float32),
    S.Problem("mlp", steps=3, memory="low", dtype=torch.float32),
]


def reads_per_step(problems, steps=3, overlap=True):
    out = []
    for p in problems:
        learner = md.MetaDDP(p.build_algorithm(), Mesh.for_layout(p.layout), overlap=overlap)
        counts = []
        for _ in range(steps):
            learner.module.zero_grad(set_to_none=True)
            tasks = learner.shard(p.n_tasks, p.task)
            with _host.as_on_a_device(), _host.counting() as reads, DispatchCounter() as ops:
                learner.meta_loss(tasks, p.loss_fn).backward()
                learner.sync_grads()
            counts.append((reads.reads, ops.host_reads))
        out.append(counts)
    return out


def test_one_host_read_per_meta_step_on_one_process():
    for p, counts in zip(PROBLEMS, reads_per_step(PROBLEMS), strict=True):
        # Every step: the finite checks of every inner step, read once, in sync_grads; no
        # .item()-like read anywhere in the step (the user's code included).
        assert counts == [(1, 0)] * 3, (p, counts)


def _worker():
    return [reads_per_step(PROBLEMS, overlap=overlap) for overlap in (True, False)]


def test_one_host_read_per_meta_step_across_ranks():
    # Two ranks split every task's samples: per step, the inner gradients' SUMs (each with a
    # sequence tag to check), BatchNorm's statistics, the gradient buckets (launched during the
    # backward once the ranks agree they may, with overlap) and their has-gradient flags.
    for rank, result in enumerate(run_local(_worker, 2)):
        for overlap, per_problem in zip((True, False), result, strict=True):
            for p, counts in zip(PROBLEMS, per_problem, strict=True):
                assert counts == [(1, 0)] * 3, (rank, overlap, p, counts)


def test_a_non_finite_inner_gradient_is_still_named_at_the_step_end():
    p = dataclasses.replace(PROBLEMS[1], inner_lr=1e30)  # the second step's gradient overflows
    learner = md.MetaDDP(p.build_algorithm(), Mesh.for_layout(p.layout))
    with _host.as_on_a_device():
        loss = learner.meta_loss(learner.shard(p.n_tasks, p.task), p.loss_fn)  # no error yet
        loss.backward()
        with pytest.raises(FloatingPointError, match=r"inner step 1: the gradient of '0\.weight'"):
            learner.sync_grads()
    # Outside a meta-step, the same check raises at once.
    with pytest.raises(FloatingPointError, match="inner step 1"):
        learner.module.adapt(p.tasks()[0].support, p.loss_fn)


def test_an_algorithm_alone_reads_once_at_the_end_of_meta_loss():
    for p in PROBLEMS:
        alg = p.build_algorithm()  # one process, no MetaDDP
        with _host.as_on_a_device(), _host.counting() as reads, DispatchCounter() as ops:
            alg.meta_loss(p.tasks(), p.loss_fn).backward()
        assert (reads.reads, ops.host_reads) == (1, 0), p
    bad = dataclasses.replace(PROBLEMS[1], inner_lr=1e30)
    with _host.as_on_a_device(), pytest.raises(FloatingPointError, match="inner step 1"):
        bad.build_algorithm().meta_loss(bad.tasks(), bad.loss_fn)
    assert not _host.in_step()  # the failed step ended: later checks are judged at once
