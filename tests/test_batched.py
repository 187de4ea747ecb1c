"""Stacked (vmap) MAML gives the meta-gradient of the per-task loop, on one and many processes."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

import metaddp
from metaddp.algorithms._stacked import batchable, per_task, use_batched
from metaddp.distributed.launch import run_local
from metaddp.testing import scenarios as S

# Float64 throughout. Stacked and looped runs do the same arithmetic except for how sums are
# grouped (vmap's batched kernels vs one task at a time, and the order tasks are summed), so
# they differ by rounding only: a few hundred ulps (~1e-14 relative) over 3 inner steps of
# second-order MAML. A real error (a lost second-order term, a task's gradient leaking into
# another's) is 1e-3 or more.
RTOL = 1e-12
WORLDS = (2, 4)


def reference_meta_grad(net: nn.Module, tasks, loss_fn, lr: float, steps: int, first_order: bool):
    """Plain single-process MAML: adapt every whole task in turn, average query losses."""
    names = [n for n, _ in net.named_parameters()]
    theta = [p for _, p in net.named_parameters()]
    total = 0.0
    for t in tasks:
        fast = list(theta)
        for _ in range(steps):
            out = torch.func.functional_call(net, dict(zip(names, fast)), (t.support.x,))
            loss = loss_fn(out, t.support.y).reshape(len(t.support.x), -1).mean(1).mean()
            grads = torch.autograd.grad(loss, fast, create_graph=not first_order)
            fast = [w - lr * g for w, g in zip(fast, grads)]
        out = torch.func.functional_call(net, dict(zip(names, fast)), (t.query.x,))
        total = total + loss_fn(out, t.query.y).reshape(len(t.query.x), -1).mean(1).mean()
    loss = total / len(tasks)
    grads = torch.autograd.grad(loss, theta)
    return float(loss.detach()), {n: g.detach() for n, g in zip(names, grads)}


def meta_step(problem: S.Problem, batched: bool | None, tasks=None, mesh=None):
    """One meta-step with metaddp; returns (this rank's loss share, {name: meta-gradient})."""
    net = problem.build_model()
    maml = metaddp.MAML(net, inner_lr=problem.inner_lr, steps=problem.steps,
                        first_order=problem.first_order, batched=batched)
    if mesh is None:
        tasks = problem.tasks() if tasks is None else tasks
        loss = maml.meta_loss(tasks, problem.loss_fn)
        loss.backward()
    else:
        m = metaddp.MetaDDP(maml, mesh)
        loss = m.meta_loss(m.shard(problem.n_tasks, problem.task), problem.loss_fn)
        loss.backward()
        m.sync_grads()
        loss = metaddp.global_value(loss, mesh.group)
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in net.named_parameters()}


def rel_diff(a: dict, b: dict) -> float:
    scale = max(float(v.abs().max()) for v in b.values())
    return max(float((a[k] - b[k]).abs().max()) for k in b) / scale


CASES = [
    S.Problem(model=m, steps=k, first_order=fo)
    for m in ("mlp", "conv") for k in (1, 3) for fo in (False, True)
]


@pytest.mark.parametrize("problem", CASES, ids=lambda p: f"{p.model}-K{p.steps}-{'fo' if p.first_order else 'so'}")
def test_batched_equals_loop_and_reference(problem):
    loss_b, g_b = meta_step(problem, batched=True)
    loss_l, g_l = meta_step(problem, batched=False)
    loss_r, g_r = reference_meta_grad(problem.build_model(), problem.tasks(), problem.loss_fn,
                                      problem.inner_lr, problem.steps, problem.first_order)
    assert loss_b == pytest.approx(loss_r, rel=RTOL) and loss_l == pytest.approx(loss_r, rel=RTOL)
    assert rel_diff(g_b, g_l) < RTOL
    assert rel_diff(g_b, g_r) < RTOL
    # The second-order terms are really there: first-order MAML differs at 1e-3 or more.
    if not problem.first_order:
        _, g_fo = meta_step(dataclasses.replace(problem, first_order=True), batched=True)
        assert rel_diff(g_fo, g_b) > 1e-4


def test_per_parameter_learning_rates_and_learnable_lr():
    problem = S.Problem(model="mlp", steps=2)
    net = problem.build_model()
    lrs = {n: torch.tensor(0.05 * (i + 1), dtype=torch.float64, requires_grad=True)
           for i, (n, _) in enumerate(net.named_parameters())}
    out = {}
    for batched in (True, False):
        for v in lrs.values():
            v.grad = None
        net.zero_grad()
        maml = metaddp.MAML(net, steps=2, optimizer=metaddp.sgd(lrs), batched=batched)
        maml.meta_loss(problem.tasks(), problem.loss_fn).backward()
        out[batched] = {**{n: p.grad.clone() for n, p in net.named_parameters()},
                        **{"lr:" + n: v.grad.clone() for n, v in lrs.items()}}
    assert rel_diff(out[True], out[False]) < RTOL
    assert all(float(out[True]["lr:" + n].abs()) > 0 for n in lrs)


def test_uneven_tasks_fall_back_or_explain():
    problem = S.Problem(model="mlp", steps=2)
    tasks = problem.tasks()
    t0 = tasks[0]
    short = metaddp.Task(metaddp.Batch(t0.support.x[:7], t0.support.y[:7], 7), t0.query)
    uneven = [short] + tasks[1:]
    assert "support" in batchable(uneven)
    assert not use_batched(None, uneven, problem.build_model())
    with pytest.raises(ValueError, match="cannot be stacked"):
        meta_step(problem, batched=True, tasks=uneven)
    loss_a, g_a = meta_step(problem, batched=None, tasks=uneven)
    loss_r, g_r = reference_meta_grad(problem.build_model(), uneven, problem.loss_fn,
                                      problem.inner_lr, problem.steps, problem.first_order)
    assert loss_a == pytest.approx(loss_r, rel=RTOL)
    assert rel_diff(g_a, g_r) < RTOL


def test_automatic_choice_on_cpu():
    # Measured on CPU (BENCHMARKS.md): stacking wins for MLPs, the loop for convolutions.
    conv, mlp = S.Problem(model="conv"), S.Problem(model="mlp")
    assert not use_batched(None, conv.tasks(), conv.build_model())
    assert use_batched(True, conv.tasks(), conv.build_model())
    assert use_batched(None, mlp.tasks(), mlp.build_model())
    assert not use_batched(False, mlp.tasks(), mlp.build_model())
    bn = nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4))
    assert not use_batched(None, mlp.tasks(), bn)


def test_a_rank_without_tasks_contributes_nothing():
    problem = S.Problem(model="mlp")
    # A rank that holds none of the meta-batch's 5 tasks (as in task layouts with few tasks).
    net = problem.build_model()
    maml = metaddp.MAML(net, inner_lr=problem.inner_lr, steps=problem.steps, batched=True)
    loss = maml.meta_loss(metaddp.MetaBatch([], 5, range(0)), problem.loss_fn)
    loss.backward()  # a zero that backward() accepts ...
    assert float(loss.detach()) == 0.0 and loss.dtype == torch.float64  # (the parameters' dtype)
    # ... and that reaches no parameter: MetaDDP's SUM counts the missing gradients as zeros
    # (tests/test_batched.py's task-parallel cases hold ranks without tasks).
    assert all(p.grad is None for p in net.parameters())


# --- Across world sizes: one spawned group per world size runs every case. ---------------

# 5 tasks of 13/11 samples: uneven shards and task counts; 3 tasks of 3/2 samples: on 4 ranks
# some sample shards are empty, and task-parallel ranks hold no task.
SIZES = ((5, 13, 11), (3, 3, 2))
DIST_CASES = [
    (S.Problem(model="mlp", steps=3, layout=layout, n_tasks=nt, n_support=ns, n_query=nq), batched)
    for layout in ("sample", "task", "hybrid") for (nt, ns, nq) in SIZES for batched in (True, False)
] + [
    (S.Problem(model="conv", steps=1, layout=layout), True) for layout in ("sample", "hybrid")
] + [
    (S.Problem(model="mlp", steps=2, first_order=True, layout="sample", n_tasks=3, n_support=3, n_query=2), True)
] + [
    # MAML's BatchNorm (batch statistics, no running ones), synchronized over the ranks that
    # split a task: stacked, one SUM per layer per forward carries every task's statistics.
    # Second order, uneven shards, and empty ones at 4 ranks.
    (S.Problem(model="conv", batchnorm=True, running_stats=False, steps=2, inner_lr=0.3,
               layout=layout, n_tasks=nt, n_support=ns, n_query=nq), True)
    for layout in ("sample", "hybrid") for (nt, ns, nq) in SIZES
]


@pytest.fixture(scope="module")
def references():
    return [reference_meta_grad(p.build_model(), p.tasks(), p.loss_fn, p.inner_lr, p.steps, p.first_order)
            for p, _ in DIST_CASES]


def dist_worker(cases):
    return [meta_step(p, batched, mesh=S.mesh_for(p.layout)) for p, batched in cases]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def dist_results(request):
    return request.param, run_local(dist_worker, request.param, DIST_CASES, threads=1)


def test_batched_across_world_sizes(dist_results, references):
    world, per_rank = dist_results
    for i, (problem, batched) in enumerate(DIST_CASES):
        loss_r, g_r = references[i]
        for rank in range(world):
            loss, grads = per_rank[rank][i]
            where = f"world {world} rank {rank} {problem} batched={batched}"
            # Float64; the world size only regroups sums (see RTOL).
            assert loss == pytest.approx(loss_r, rel=RTOL), where
            assert rel_diff(grads, g_r) < RTOL, where


class _DoubledTaskLoss(metaddp.MAML):
    """A subclass with its own task loss: stacking MAML's loss would silently change it."""

    def task_loss(self, task, loss_fn, *, reduce):
        return 2.0 * super().task_loss(task, loss_fn, reduce=reduce)


def test_subclasses_with_their_own_task_loss_keep_the_loop():
    problem = S.Problem(model="mlp", steps=2)
    loss_ref, _ = reference_meta_grad(problem.build_model(), problem.tasks(), problem.loss_fn,
                                      problem.inner_lr, problem.steps, problem.first_order)
    m = _DoubledTaskLoss(problem.build_model(), inner_lr=problem.inner_lr, steps=problem.steps)  # automatic choice
    loss = float(m.meta_loss(problem.tasks(), problem.loss_fn).detach())
    assert loss == pytest.approx(2.0 * loss_ref, rel=RTOL)  # the subclass's loss, not MAML's
    # batched=True on such a subclass is refused when it is built (or set), before any work.
    with pytest.raises(ValueError, match="overrides"):
        _DoubledTaskLoss(problem.build_model(), inner_lr=problem.inner_lr, steps=problem.steps, batched=True)
    with pytest.raises(ValueError, match="overrides"):
        m.batched = True


def test_batch_norm_stacks_unless_it_tracks_running_statistics():
    mlp = S.Problem(model="mlp")
    bn = nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 1))
    assert not any(True for _ in bn.buffers())
    assert use_batched(None, mlp.tasks(), bn)  # batch statistics per task: stacked
    # Running statistics are updated in place, per task, which vmap cannot do: the loop.
    tracked = nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    assert not use_batched(None, mlp.tasks(), tracked)


def _collectives_per_step(n_tasks_list):
    out = []
    for n_tasks in n_tasks_list:
        p = S.Problem(model="conv", batchnorm=True, running_stats=False, steps=2, n_tasks=n_tasks)
        for batched in (True, False):
            maml = metaddp.MAML(p.build_model(), inner_lr=p.inner_lr, steps=p.steps, batched=batched)
            m = metaddp.MetaDDP(maml, S.mesh_for("sample"))
            # The second step counted: the first checks the loss function (one loss per
            # sample?), which a stacked model with BatchNorm does one task at a time.
            for _ in range(2):
                m.module.zero_grad()
                with metaddp.counting() as c:
                    m.meta_loss(m.shard(p.n_tasks, p.task), p.loss_fn).backward()
                    m.sync_grads()
            out.append(c.calls)
            m.release()
    return out


def test_stacked_batch_norm_needs_no_more_collectives_for_more_tasks():
    (stacked_2, loop_2, stacked_4, loop_4), _ = run_local(_collectives_per_step, 2, [2, 4])
    # Stacked, one task's collectives (per BatchNorm layer and forward, per inner gradient,
    # and their adjoints) carry every task: P + F for any number of tasks, F being the
    # step's fixed ones (the gradient SUM...). The loop pays P per task: n P + F.
    assert stacked_2 == stacked_4
    per_task = loop_2 - stacked_2
    assert per_task > 0 and loop_4 - loop_2 == 2 * per_task, (stacked_2, loop_2, loop_4)


def _normalized_sgd_with_counter(lr: float) -> metaddp.InnerOptimizer:
    """Per-tensor normalised steps shrinking with a step counter: state with an int and a
    tensor, and an update that is not elementwise (a norm over the whole tensor)."""

    def init(params):
        return {"t": 0, "last": {k: torch.zeros_like(p) for k, p in params.items()}}

    def update(grads, state, params):
        t = state["t"] + 1
        ups = {k: -lr / t * g / (g.norm() + 1e-12) + 0.5 * state["last"][k] for k, g in grads.items()}
        return ups, {"t": t, "last": ups}

    return metaddp.InnerOptimizer(init, update)


def test_optimizer_state_and_whole_tensor_updates_stay_per_task():
    problem = S.Problem(model="mlp", steps=3)
    out = {}
    for batched in (True, False):
        net = problem.build_model()
        maml = metaddp.MAML(net, steps=3, optimizer=_normalized_sgd_with_counter(0.3), batched=batched)
        maml.meta_loss(problem.tasks(), problem.loss_fn).backward()
        out[batched] = {n: p.grad.clone() for n, p in net.named_parameters()}
    assert rel_diff(out[True], out[False]) < RTOL


def test_rowwise_optimizers_are_their_own_per_task_form():
    # Only the library's own updates with plain Python rates are rowwise: a tensor rate may be
    # learned (its gradient sums over tasks) or per entry, and any other function (a wrapper
    # of a rowwise update included) may look across entries.
    assert metaddp.sgd(0.1).rowwise and metaddp.sgd(0.1, momentum=0.9).rowwise
    assert metaddp.adam(0.01).rowwise and metaddp.sgd({"w": 0.1, "b": 0.2}).rowwise
    assert not metaddp.sgd(torch.tensor(0.1)).rowwise
    assert not metaddp.sgd({"w": torch.tensor(0.1)}).rowwise
    assert not _normalized_sgd_with_counter(0.3).rowwise
    plain = metaddp.sgd(0.1)
    wrapped = functools.wraps(plain.update)(lambda *a: plain.update(*a))
    assert not plain._replace(update=wrapped).rowwise
    assert not metaddp.InnerOptimizer(plain.init, len).rowwise  # not weakly referable
    init, update = plain  # still a pair
    problem = S.Problem(model="mlp", steps=3)
    for opt in (metaddp.sgd(0.3, momentum=0.9, nesterov=True), metaddp.adam(0.05)):
        vmapped = metaddp.InnerOptimizer(opt.init, functools.partial(opt.update))
        assert per_task(opt, 4) is opt and per_task(vmapped, 4) is not vmapped
        for memory in ("default", "low"):
            grads = []
            for o in (opt, vmapped):  # without vmap, and under it
                net = problem.build_model()
                maml = metaddp.MAML(net, steps=3, optimizer=o, batched=True, memory=memory)
                maml.meta_loss(problem.tasks(), problem.loss_fn).backward()
                grads.append([p.grad for p in net.parameters()])
            # The same elementwise kernels on the same values, only without vmap: equal bits.
            diffs = [(a - b).abs().max().item() for a, b in zip(*grads, strict=True)]
            assert diffs == [0.0] * len(diffs), (opt, memory, diffs)
