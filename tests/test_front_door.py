"""The mistakes a new user makes through the public API give the exact meta-gradient or an
error that says what to do, never a silently different number.

Each was a silent error before (relative error of the meta-gradient at 2 processes, sample
layout): ``module.meta_loss`` without ``reduce=`` 2.6; ``module.clone()`` without
``reduce=`` 1.75; BatchNorm statistics not synchronized 0.40; a rank's own task count in place
of the global one: loss and gradient doubled. Every case runs at 2 and 3 processes and is
compared with an independent float64 single-process reference (tests/reference.py).
"""

from __future__ import annotations

import os

import pytest
import torch

import metaddp as md
import reference
from metaddp.distributed.launch import run_local
from metaddp.testing import scenarios as S
from test_algorithms import reference_bn

WORLD_SIZES = (2, 3)
# Float64; against the reference only the order of floating-point sums differs (shares summed
# over ranks, rather than one mean): observed < 1e-15 relative. Every mistake above is an error
# of 0.4 or more, so 1e-10 separates right from wrong by nine orders of magnitude.
RTOL = 1e-10

MLP = S.Problem("mlp", steps=2, layout="sample")  # 13 / 11 samples: uneven shards at 2 and 3
TASKS = S.Problem("mlp", steps=2, layout="task")  # 5 tasks: 3+2 at 2 ranks, 2+2+1 at 3
BN = S.Problem("conv", batchnorm=True, steps=2, n_tasks=3, inner_lr=0.3, layout="sample")


def grads_of(learner: md.MetaDDP) -> dict[str, torch.Tensor]:
    return S.meta_gradient(learner.module)


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def mistakes() -> dict:
    """Every mistake of the module docstring, the way a user writes it, on this rank."""
    out: dict = {}

    # 1. meta_loss on the algorithm itself, no reduce= and no count.
    learner = md.MetaDDP(MLP.build_algorithm(), md.Mesh.for_layout("sample"))
    mine = md.shard_range(MLP.n_tasks, learner.mesh.task_index, learner.mesh.tasks)
    tasks = [MLP.task(i).split(learner.mesh.sample_index, learner.mesh.samples) for i in mine]
    learner.module.meta_loss(tasks, MLP.loss_fn).backward()
    learner.sync_grads()
    out["meta_loss"] = grads_of(learner)
    # The old signature with a count: refused, so no local count can be passed.
    out["count_refused"] = error_of(lambda: learner.module.meta_loss(tasks, MLP.loss_fn, 5))

    # 2. clone() without reduce=, learn2learn style.
    learner = md.MetaDDP(MLP.build_algorithm(), md.Mesh.for_layout("sample"))
    batch = learner.shard(MLP.n_tasks, MLP.task)
    for t in batch:
        fast = learner.module.clone()
        for _ in range(MLP.steps):
            fast.adapt(md.share(MLP.loss_fn(fast(t.support.x), t.support.y), t.support))
        (md.share(MLP.loss_fn(fast(t.query.x), t.query.y), t.query) / batch.n).backward()
    learner.sync_grads()
    out["clone"] = grads_of(learner)

    # 3. A BatchNorm model, nothing said about its statistics.
    learner = md.MetaDDP(BN.build_algorithm(), md.Mesh.for_layout("sample"))
    tasks = [BN.task(i).split(learner.mesh.sample_index, learner.mesh.samples)
             for i in range(BN.n_tasks)]
    learner.module.meta_loss(tasks, BN.loss_fn).backward()
    learner.sync_grads()
    out["batchnorm"] = grads_of(learner)

    # 4. Task layout, each rank with its own list of tasks: the global count is the library's.
    learner = md.MetaDDP(TASKS.build_algorithm(), md.Mesh.for_layout("task"))
    mine = md.shard_range(TASKS.n_tasks, learner.mesh.task_index, learner.mesh.tasks)
    loss = learner.meta_loss([TASKS.task(i) for i in mine], TASKS.loss_fn)
    loss.backward()
    learner.sync_grads()
    out["task_count"] = grads_of(learner)
    out["task_count_loss"] = float(learner.global_value(loss))

    # Work one rank does alone on a whole task (a figure after training): no collective runs,
    # and the wrapper's reductions are back afterwards.
    learner = md.MetaDDP(BN.build_algorithm(), md.Mesh.for_layout("sample"))
    if md.rank() == 0:
        with learner.local():
            fast = learner.module.adapt(BN.task(0).support, BN.loss_fn)
        out["local"] = {k: v.detach() for k, v in fast.items()}
    out["restored"] = learner.module.collectives().reduce == learner.reduce

    # An algorithm that was never wrapped refuses to run on several processes.
    bare = MLP.build_algorithm()
    out["unwrapped"] = error_of(lambda: bare.meta_loss([MLP.task(0)], MLP.loss_fn))
    return out


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    return {w: run_local(mistakes, w) for w in WORLD_SIZES}


def rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want)
    scale = max(float(v.abs().max()) for v in want.values())
    return max(float((got[k] - want[k]).abs().max()) for k in want) / scale


def maml_reference(p: S.Problem) -> tuple[float, dict[str, torch.Tensor]]:
    return reference.maml_meta_grad(p.build_model(), p.tasks(), steps=p.steps,
                                    inner_lr=p.inner_lr, first_order=False,
                                    classification=p.model == "conv")


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case,problem", [("meta_loss", MLP), ("clone", MLP),
                                          ("task_count", TASKS)])
def test_forgotten_keyword_or_local_count_gives_the_exact_meta_gradient(results, world, case,
                                                                        problem):
    loss, want = maml_reference(problem)
    for rank, r in enumerate(results[world]):
        assert rel_err(r[case], want) < RTOL, f"{case}, world {world}, rank {rank}"
        if case == "task_count":
            assert r["task_count_loss"] == pytest.approx(loss, rel=RTOL)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_batchnorm_is_synchronized_without_being_asked(results, world):
    want, _ = reference_bn(BN)
    for rank, r in enumerate(results[world]):
        assert rel_err(r["batchnorm"], want) < RTOL, f"world {world}, rank {rank}"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_one_rank_alone_adapts_a_whole_task_inside_local(results, world):
    want = BN.build_algorithm().adapt(BN.task(0).support, BN.loss_fn)  # one plain process
    got = results[world][0]["local"]
    for k in want:
        # The same float64 arithmetic but for the BatchNorm formula (shifted sums instead of
        # torch's kernel): a few ulps.
        torch.testing.assert_close(got[k], want[k].detach(), rtol=RTOL, atol=1e-13)
    assert all(r["restored"] for r in results[world])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_counts_cannot_be_passed_and_unwrapped_algorithms_refuse(results, world):
    for r in results[world]:
        assert r["count_refused"].startswith("TypeError")
        assert r["unwrapped"].startswith("RuntimeError")
        assert "not wrapped in metaddp.MetaDDP" in r["unwrapped"]


# ------------------------------------------------------------------------------ check mode


def hand_loop(check: bool | None, forget: bool) -> str:
    """The question's shape written by hand: one inner step, then the query loss."""
    learner = md.MetaDDP(MLP.build_algorithm(), md.Mesh.for_layout("sample"), check=check)
    net = learner.module.model
    t = MLP.task(0).split(learner.mesh.sample_index, learner.mesh.samples)
    params = md.params_of(net)

    def step() -> None:
        loss = md.share(MLP.loss_fn(md.call(net, params, t.support.x), t.support.y), t.support)
        if forget:  # autograd.grad alone: this rank's shard only
            g = dict(zip(params, torch.autograd.grad(loss, list(params.values()),
                                                     create_graph=True)))
        else:
            g = learner.grad(loss, params)
        fast = {k: p - 0.1 * g[k] for k, p in params.items()}
        md.share(MLP.loss_fn(md.call(net, fast, t.query.x), t.query.y), t.query).backward()
        learner.sync_grads()

    return error_of(step)


def size_mistake(through: str, local: bool = False) -> str:
    """A batch cut by hand with a wrong global size, given to meta_loss or to adapt (a
    hand-written query loss): one more than the task's (``Batch.local``, check mode finds it),
    or the shard's own length (``Batch``, refused without check mode)."""
    learner = md.MetaDDP(MLP.build_algorithm(), md.Mesh.for_layout("sample"), check=not local)
    m = learner.mesh
    t = MLP.task(0)
    x, y = md.shard(t.support.x, m.sample_index, m.samples), md.shard(t.support.y, m.sample_index, m.samples)
    support = md.Batch(x, y, len(x)) if local else md.Batch.local(x, y, t.support.n + 1)
    wrong = md.Task(support, md.Batch.split(t.query.x, t.query.y, m.sample_index, m.samples))
    if through == "adapt":
        return error_of(lambda: learner.adapt(wrong.support, MLP.loss_fn))
    return error_of(lambda: learner.meta_loss([wrong], MLP.loss_fn))


def check_worker() -> dict:
    out = {"forgot": hand_loop(True, True), "reduced": hand_loop(True, False),
           "off": hand_loop(False, True), "size": size_mistake("meta_loss"),
           "size through adapt": size_mistake("adapt"),
           "local size": size_mistake("meta_loss", local=True),
           "local size through adapt": size_mistake("adapt", local=True)}
    os.environ["METADDP_CHECK"] = "1"
    try:
        out["env"] = hand_loop(None, True)
    finally:
        del os.environ["METADDP_CHECK"]
    return out


@pytest.fixture(scope="module")
def checks() -> dict[int, list[dict]]:
    return {w: run_local(check_worker, w) for w in WORLD_SIZES}


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_check_mode_names_the_tensor_of_a_forgotten_reduction(checks, world):
    for r in checks[world]:
        for key in ("forgot", "env"):
            assert r[key].startswith("OutOfSyncError"), r[key]
            # The first layer run on fast weights after the rank-local step.
            assert "'model.0.weight' differs across the processes" in r[key]
            assert "learner.grad" in r[key]
        assert r["reduced"] == "no error"
        # Off: still caught, on the first meta-step, which is always checked.
        assert r["off"].startswith("OutOfSyncError"), r["off"]
        assert "learner.grad" in r["off"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_check_mode_catches_a_local_sample_count(checks, world):
    for r in checks[world]:
        for key in ("size", "size through adapt"):
            assert r[key].startswith("OutOfSyncError"), r[key]
            assert "support batch says it has" in r[key]
        # The shard's own length as n: every rank holds "all" of its batch, refused without
        # check mode and without a collective.
        for key in ("local size", "local size through adapt"):
            assert r[key].startswith("ValueError"), r[key]
            assert "holds all" in r[key] and "Batch.local(x, y, n)" in r[key], r[key]


def test_a_meta_batch_has_no_len_that_a_meta_loss_could_be_divided_by():
    # len() of a rank's part would be its own task count at several processes and the global
    # one at one: `loss / len(batch)` would change with the world size, so it is an error.
    tasks = [md.Task(md.Batch(torch.full((2, 1), float(i)), torch.zeros(2), 2),
                     md.Batch(torch.zeros(1, 1), torch.zeros(1), 1)) for i in range(5)]
    part = md.MetaBatch.shard(tasks, task_index=1, task_parts=2)
    with pytest.raises(TypeError, match=r"batch\.n is the number of tasks in the global"):
        len(part)
    assert part.n == 5 and len(part.tasks) == 3 and part.indices == range(2, 5)
    assert [t.support.x[0, 0].item() for t in part] == [2.0, 3.0, 4.0]
    assert [t.support.x[0, 0].item() for t in reversed(part)] == [4.0, 3.0, 2.0]
    assert list(part) == list(part.tasks) and bool(part) and part[1] is part.tasks[1]
