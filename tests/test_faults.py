"""Faults between ranks end in a clear error on every rank, within a bounded time.

Real processes (gloo on CPU) and real signals: a rank stopped with SIGSTOP, ranks running
different inner-step counts, ranks with different settings.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

import metaddp as md
from metaddp.distributed.launch import run_local
from metaddp.testing import scenarios as S


def one_step(problem: S.Problem, steps: int) -> str:
    """The third meta-step of ``problem`` with ``steps`` inner steps on this rank (the first
    two, checked, with the problem's own: a checked step compares the settings before any
    work); the error, if any."""
    learner = md.MetaDDP(problem.build_algorithm(), S.mesh_for(problem.layout))
    for _ in range(2):
        learner.zero_grad(set_to_none=True)
        learner.meta_loss(learner.shard(problem.n_tasks, problem.task), problem.loss_fn).backward()
        learner.sync_grads()
    learner.module.steps = steps
    learner.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    try:
        learner.meta_loss(learner.shard(problem.n_tasks, problem.task), problem.loss_fn).backward()
        learner.sync_grads()
    except md.CollectiveError as e:
        return f"CollectiveError after {time.perf_counter() - t0:.1f} s: {e}"
    return "no error"


def mixed_steps(layout: str) -> str:
    """Rank 0 adapts with one inner step, the others with two."""
    return one_step(S.Problem("mlp", layout=layout), 1 if md.rank() == 0 else 2)


# The group's timeout: far longer than detection should take, so an error that arrives
# before it was found by the tags, not by waiting.
TIMEOUT_S = 60.0


@pytest.mark.parametrize("layout", ["sample", "task", "hybrid"])
def test_ranks_with_different_inner_step_counts_fail_at_once(layout):
    world = 4 if layout == "hybrid" else 2
    errors = run_local(mixed_steps, world, layout, timeout_s=TIMEOUT_S)
    for rank, e in enumerate(errors):
        assert e.startswith("CollectiveError"), f"rank {rank}: {e}"
        # The ranks that split a task with the odd rank find it in their own collective;
        # in the hybrid layout the other task group learns of it when its partners stop.
        assert "ranks are out of step" in e or "another rank raised" in e, f"rank {rank}: {e}"
        if layout != "hybrid" or rank < 2:
            assert "ranks are out of step" in e, f"rank {rank}: {e}"
        seconds = float(e.split(" after ")[1].split(" s")[0])
        assert seconds < TIMEOUT_S / 2, f"rank {rank} waited {seconds} s: found by timeout"
        if layout == "task":  # no inner-loop collective: the settings in the final sum
            assert "meta-gradient all-reduce" in e and "settings" in e


def stall_one_rank(timeout_s: float) -> dict:
    """Rank 1 stops itself (SIGSTOP) before a sample-parallel meta-step; rank 0 must fail
    within the timeout, then wake rank 1, which fails the same way."""
    p = S.Problem("mlp", layout="sample")
    learner = md.MetaDDP(p.build_algorithm(), S.mesh_for("sample"))  # creates the subgroups
    pids = [None] * md.world_size()
    dist.all_gather_object(pids, os.getpid())
    if md.rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    t0 = time.perf_counter()
    try:
        learner.meta_loss(learner.shard(p.n_tasks, p.task), p.loss_fn).backward()
        learner.sync_grads()
        error = "no error"
    except md.CollectiveError as e:
        error = str(e)
    waited = time.perf_counter() - t0
    if md.rank() == 0:
        os.kill(pids[1], signal.SIGCONT)
    return {"error": error, "waited": waited}


def test_a_stalled_rank_ends_in_an_error_within_the_timeout():
    timeout_s = 5.0
    t0 = time.perf_counter()
    results = run_local(stall_one_rank, 2, timeout_s, timeout_s=timeout_s)
    total = time.perf_counter() - t0
    first = results[0]
    # The waiting process says that it waited, and that another one stalled (it is not the
    # one at fault).
    assert "timed out on rank 0" in first["error"], first["error"]
    assert "a process stalled" in first["error"]
    # The inner loop's all-reduce runs on the sample subgroup, which must wait no longer than
    # the timeout given to init(): 5 s, plus scheduling on a busy 2-core machine (not torch's
    # 30-minute default for groups made without one).
    assert timeout_s <= first["waited"] < timeout_s + 20, first["waited"]
    assert results[1]["error"] != "no error"
    assert total < 120  # spawning, the stall and rank 1's own timeout; never a hang
