"""Correct by default: every mistake of docs/guarantees.md gives the exact meta-gradient or an
error that names the fix, on 2 and 3 real processes (tests/mistake_workers.py), and the entry
points refuse what they cannot run, in one line of metaddp's own."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metaddp as md
import mistake_workers as W
from metaddp.distributed._guards import Schedule
from metaddp.distributed.launch import oversubscribed, run_local

# What each case must end in: "exact", or the error's type and words of the fix it names.
EXPECTED = {
    "correct meta_loss": "exact",
    "correct clone": "exact",
    "correct hand loop": "exact",
    "clone plain mean": ("ValueError", ["md.share did not make", "md.share(per_sample_losses, batch)"]),
    "clone local count": ("ValueError", ["a share of a count", "md.share(per_sample_losses, batch)"]),
    "Batch.local own count": ("OutOfSyncError", ["Batch.local(x, y, n)", "never the part's own length"]),
    "own tasks to shard (task layout)": ("ValueError", ["whole meta-batch"]),
    "own tasks to shard (sample layout)": ("ValueError", ["whole meta-batch"]),
    "own tasks to MetaBatch.shard": ("ValueError", ["whole meta-batch"]),
    "hand loop with autograd.grad": ("OutOfSyncError", ["learner.grad(loss, params)"]),
    "rank-seeded sampler": ("ValueError", ["seeded with the rank", "md.generator_for"]),
    "rank-seeded sampler (task layout)": ("ValueError", ["seeded with the rank", "md.generator_for"]),
    "global generator in make_task": ("ValueError", ["built the same task twice", "md.generator_for"]),
    "DistributedSampler over tasks": ("ValueError", ["DistributedSampler", "learner.shard(n, make_task)"]),
    "clone plain mean, whole tasks": "exact",
    "task counts differ": ("OutOfSyncError", ["different numbers of tasks"]),
    "NaN query target": ("FloatingPointError", ["not finite", "NaN target"]),
    "DDP inside MAML": ("TypeError", ["DistributedDataParallel", "MetaDDP"]),
    "clone query own count": ("OutOfSyncError", ["md.share", "md.share(per_sample, batch)"]),
    "clone cut by rank (task layout)": ("ValueError", ["no other rank holds the rest", "never with md.rank()"]),
    "hand loop query cut by rank (task layout)": (
        "OutOfSyncError", ["no other rank holds the rest", "never with md.rank()"]
    ),
    "loss weight by rank": ("OutOfSyncError", ["loss functions compute different losses"]),
    "loss weight by rank (task layout)": ("OutOfSyncError", ["loss functions compute different losses"]),
    "another loss by rank": ("OutOfSyncError", ["loss functions compute different losses"]),
    # Correct programs the share records must not refuse: parts made by chunks, masks that
    # skip a term where a rank holds none of it, counts over the whole meta-batch, parts of a
    # task on one rank, two learners whose steps interleave.
    "clone query in chunks": "exact",
    "clone query, masked terms skipped": "exact",
    "clone query over all samples": "exact",
    "clone query split by Batch.split (task layout)": "exact",
    "two learners interleaved": "exact",
    "Bilevel outer loss weight by rank": ("OutOfSyncError", ["loss functions compute different losses"]),
    "loss weight by rank from step 3": ("OutOfSyncError", ["loss functions compute different losses"]),
    # Where ranks run other tasks, other loss functions are right: compared within a sample
    # group, or over the mesh only for one meta_loss over global tasks.
    "a loss per task (task layout)": "own",
    "a validation loss after training (task layout)": "own",
    "a local evaluation, then training and validation (task layout)": "exact",
    # A rank that skips a task's loss and backward: on a checked step the checks' collectives
    # meet at different places; on any step, an adjoint meets another task's adjoint.
    "query loss skipped where a rank keeps none": ("CollectiveError", ["still runs its loss and backward"]),
    "query losses skipped by rank on a later step": (
        "CollectiveError", ["adjoint", "still runs its loss and backward"]
    ),
}


@pytest.fixture(scope="module")
def reference():
    return torch.tensor(W.reference_grad())


@pytest.fixture(scope="module")
def one_process():
    return run_local(W.table, 1, timeout_s=120)[0]


@pytest.fixture(scope="module", params=[2, 3])
def table(request):
    return request.param, run_local(W.table, request.param, timeout_s=120)


def test_the_table_covers_every_case():
    assert set(EXPECTED) == set(W.CASES)


@pytest.mark.parametrize("case", list(EXPECTED))
def test_every_mistake_is_exact_or_an_error_naming_the_fix(table, reference, one_process, case):
    world, per_rank = table
    outcomes = [r[case] for r in per_rank]
    want = EXPECTED[case]
    if want == "own":  # the same program's one-process meta-gradient (tests/mistake_workers.py)
        assert one_process[case][0] == "grad", one_process[case]
        ref = one_process[case][1]
        for rank, got in enumerate(outcomes):
            assert got[0] == "grad", f"{world} ranks, rank {rank}: {got}"
            # float64 sums in another order, as below
            torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(ref), rtol=1e-12, atol=1e-12)
        return
    if want == "exact":
        for rank, got in enumerate(outcomes):
            assert got[0] == "grad", f"{world} ranks, rank {rank}: {got}"
            # float64 sums in another order: a few ulps of a gradient of norm ~3.
            torch.testing.assert_close(torch.tensor(got[1]), reference, rtol=1e-12, atol=1e-12)
        return
    kind, words = want
    for rank, got in enumerate(outcomes):
        # Every rank raises, not only the one that holds the cause: none is left waiting.
        assert got[0] == "error", f"{world} ranks, rank {rank} returned a gradient: {case}"
        assert got[1] == kind, f"{world} ranks, rank {rank}: {got}"
        for w in words:
            assert w in got[2], f"{world} ranks, rank {rank}: {got[2]!r} lacks {w!r}"


# --- the entry points, on one process --------------------------------------------------------


def net64() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def mse(p, y):
    return F.mse_loss(p, y, reduction="none")


def task(n_support: int = 5, *, y_support: int | None = None, dtype=torch.float64) -> md.Task:
    x = torch.linspace(-1, 1, n_support, dtype=dtype)[:, None]
    y = x.sin()[: y_support if y_support is not None else n_support]
    return md.Task(md.Batch(x, y, n_support), md.Batch(x, x.cos(), n_support))


@pytest.mark.parametrize(
    "options, error, words",
    [
        ({"inner_lr": -1.0}, ValueError, "inner_lr must be positive"),
        ({"inner_lr": float("nan")}, ValueError, "inner_lr must be positive"),
        ({"inner_lr": "fast"}, TypeError, "inner_lr must be a number"),
        ({"steps": 0}, ValueError, "steps (inner steps per task) must be positive"),
        ({"steps": 1.5}, TypeError, "must be a whole number"),
        ({"first_order": "yes"}, TypeError, "first_order must be True or False"),
    ],
)
def test_algorithm_options_are_checked(options, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        md.MAML(net64(), **options)


def test_imaml_options_are_checked():
    with pytest.raises(ValueError, match="lam must be positive"):
        md.IMAML(net64(), lam=-1.0)
    with pytest.raises(TypeError, match="cg_steps must be a whole number"):
        md.IMAML(net64(), cg_steps=2.5)


def test_a_make_task_that_returns_no_task_is_named():
    def make(i):
        t = task()
        return (t.support, t.query)  # a tuple, not an md.Task

    with pytest.raises(TypeError, match=r"make_task\(0\) is a tuple, not a metaddp.Task"):
        md.MetaBatch.shard(2, make)
    learner = md.MetaDDP(md.MAML(net64()))
    with pytest.raises(TypeError, match=r"task 0 of the meta-batch is a tuple"):
        learner.shard([tuple(task())])
    learner.release()


def test_a_model_with_nothing_to_train_is_refused():
    net = net64().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter .* requires a gradient"):
        md.MetaDDP(md.MAML(net))
    with pytest.raises(ValueError, match="no parameter .* requires a gradient"):
        md.MAML(net).meta_loss([task()], mse)


def test_batches_that_cannot_be_what_they_say_are_refused_on_one_process():
    maml = md.MAML(net64(), inner_lr=0.1)
    with pytest.raises(ValueError, match="5 inputs but 4 targets"):
        maml.meta_loss([task(y_support=4)], mse)
    s, q = task()
    seven = md.Task(md.Batch(s.x, s.y, 7), q)  # 5 samples that say 7: each would weigh 5/7
    with pytest.raises(ValueError, match="holds 5 samples but says it has n=7"):
        maml.meta_loss([seven], mse)
    learner = md.MetaDDP(md.MAML(net64(), inner_lr=0.1))
    with pytest.raises(ValueError, match="holds 5 samples but says it has n=7"):
        learner.meta_loss([seven], mse)
    with pytest.raises(ValueError, match="holds 5 samples but says it has n=7"):
        learner.adapt(seven.support, mse)
    learner.release()


def test_a_dtype_mismatch_names_both_sides():
    net32 = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    with pytest.raises(TypeError, match="inputs are torch.float64, the model's parameters torch.float32"):
        md.MAML(net32).meta_loss([task()], mse)


def test_a_device_mismatch_names_both_sides():
    s, q = task()
    elsewhere = md.Task(md.Batch(s.x.to("meta"), s.y.to("meta"), s.n), q)  # not the model's
    with pytest.raises(ValueError, match="task 0's support batch is on meta, the model on cpu"):
        md.MAML(net64()).meta_loss([elsewhere], mse)


def test_data_parallel_inside_the_model_is_named():
    model = nn.Sequential()
    model.add_module("inner", nn.DataParallel(nn.Linear(1, 1)))
    with pytest.raises(TypeError, match="holds a DataParallel at 'inner'"):
        md.MAML(model)


def test_a_non_finite_query_loss_stops_the_step():
    s, q = task()
    bad = md.Task(s, md.Batch(q.x, torch.full_like(q.y, math.nan), q.n))
    with pytest.raises(FloatingPointError, match="meta-loss is not finite"):
        md.MAML(net64()).meta_loss([bad], mse)
    learner = md.MetaDDP(md.MAML(net64()))
    learner.meta_loss([bad], mse).backward()
    with pytest.raises(FloatingPointError, match="meta-loss is not finite"):
        learner.sync_grads()
    learner.release()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_nccl_without_cuda_is_one_line():
    with pytest.raises(RuntimeError, match="backend='nccl' needs CUDA"):
        md.init(backend="nccl")


def test_more_processes_than_cores_are_warned_about():
    assert oversubscribed(2, 2) is None
    assert "64 processes on 2 core(s)" in oversubscribed(64, 2)


def test_the_first_step_and_a_sparse_sample_of_later_ones_are_checked():
    s = Schedule(every=False)
    due = []
    for step in range(1100):
        if s.due():
            due.append(step)
        s.advance()
    assert due == [0, 1, 4, 16, 64, 256, 1024]
    every = Schedule(every=True)
    every.advance()
    assert every.due()


def test_release_puts_back_what_deterministic_mode_changed_in_the_process():
    was = torch.backends.mkldnn.enabled
    learner = md.MetaDDP(md.MAML(net64()), deterministic=True)
    assert not torch.backends.mkldnn.enabled  # its CPU convolutions change with the batch's shape
    learner.release()
    assert torch.backends.mkldnn.enabled == was
    assert torch.are_deterministic_algorithms_enabled() is False


def test_a_copy_of_a_wrapped_algorithm_is_not_wrapped():
    import copy

    learner = md.MetaDDP(md.MAML(net64()))
    twin = copy.deepcopy(learner.module)  # an evaluation copy, an EMA of the weights...
    assert learner.module.metaddp_bound is not None and twin.metaddp_bound is None
    learner.release()
    assert learner.module.metaddp_bound is None
