"""Bad input fails loudly and early, naming the problem; ranks out of step never hang silently."""

import pytest
import torch
from torch import nn

import metaddp as md
import workers
from metaddp.distributed.launch import run_local


def test_strict_mode_names_a_size_mismatch_instead_of_aborting():
    for msg in run_local(workers.strict_size_mismatch, 2):
        assert "ranks are out of step" in msg and "the size 3..5" in msg


def test_sequence_tag_catches_ranks_out_of_step():
    for msg in run_local(workers.out_of_step_tag, 2):
        assert "ranks are out of step" in msg and "sequence tag" in msg


def test_a_rank_that_leaves_gives_an_explanation_not_a_hang():
    msg = run_local(workers.rank_one_leaves, 2, timeout_s=10)[0]
    assert "ranks disagree on how many collectives" in msg


def test_share_wants_one_loss_per_sample():
    with pytest.raises(ValueError, match="reduction='none'"):
        md.share(torch.tensor(1.0), 4)
    with pytest.raises(ValueError, match="cannot be a share of 2"):
        md.share(torch.ones(3), 2)


@pytest.fixture
def onednn_kept():
    # Deterministic mode turns oneDNN off for the process: back as it was for later tests.
    was = torch.backends.mkldnn.enabled
    yield
    torch.backends.mkldnn.enabled = was


def _one_task(n=6):
    x = torch.linspace(-1, 1, 2 * n, dtype=torch.float64)[:, None]
    return md.Task(md.Batch(x[:n], x[:n] ** 2, n), md.Batch(x[n:], x[n:] ** 3, n))


@pytest.mark.parametrize("path", ["loop", "stacked", "low", "deterministic"])
def test_a_loss_averaged_over_the_batch_is_refused_on_every_path(path, onednn_kept):
    # mean(0) keeps a dimension of one: taken as one sample, its weight (and the meta-
    # gradient) would change with the number of processes.
    mean_loss = lambda p, y: ((p - y) ** 2).mean(0)  # noqa: E731
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    alg = md.MAML(net, inner_lr=0.1, batched={"stacked": True, "loop": False}.get(path),
                  memory="low" if path == "low" else "default")
    with pytest.raises(ValueError, match=r"returned shape \(1,\) for \d+ samples"):
        if path == "deterministic":
            # 16 samples in 8 chunks of 2 (a chunk of one sample is its own mean).
            learner = md.MetaDDP(alg, deterministic=True, chunks=8)
            learner.meta_loss(learner.shard([_one_task(16)]), mean_loss)
        else:
            alg.meta_loss([_one_task()], mean_loss)
    with pytest.raises(ValueError, match="one loss per sample"):
        md.share(torch.ones(1), _one_task().support)


def test_deterministic_mode_refuses_gradients_it_would_not_sum(onednn_kept):
    # Its meta-gradient is summed inside meta_loss's backward and sync_grads() sums nothing:
    # a query loss through adapt() or clone() would leave every rank its own gradient.
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1), deterministic=True)
    support = _one_task().support
    loss_fn = lambda p, y: (p - y) ** 2  # noqa: E731
    for call in (lambda: learner.adapt(support, loss_fn),
                 lambda: learner.module.adapt(support, loss_fn),
                 lambda: learner.module.clone()):
        with pytest.raises(TypeError, match="not available in deterministic mode"):
            call()
    with learner.local():  # on this process alone (evaluation, plots): allowed
        assert set(learner.module.adapt(support, loss_fn)) == {k for k, _ in net.named_parameters()}


def test_sharding_a_ranks_part_again_is_refused():
    tasks = md.MetaBatch.shard([_one_task(), _one_task()], task_index=0, task_parts=2)
    with pytest.raises(ValueError, match="already this rank's part"):
        md.MetaBatch.shard(tasks, task_index=0, task_parts=2)


@pytest.mark.parametrize("overlap", [False, True])
def test_gradients_summed_once_are_not_summed_again(overlap):
    got = run_local(workers.summed_gradients_twice, 2, overlap)
    assert got[0] == got[1]  # every rank the same, refusals included
    g = got[0]
    # The meta-gradient, whatever zeroing preceded it; two backwards give twice it (the same
    # float64 sum of two equal terms, exact).
    assert g["zeroed in place"] == g["once"] == g["after the refusals"]
    assert g["two backwards, one sync"] == 2 * g["once"]
    assert "no backward has added to them since" in g["sync twice"]
    assert "this backward would add to them" in g["not zeroed"]


def test_rates_learned_outside_the_algorithm_are_refused_by_the_wrapper(onednn_kept):
    # sync_grads() sums the algorithm's parameters: a rate tensor elsewhere would be trained
    # by every rank on its own gradient.
    net = nn.Linear(1, 1).double()
    rate = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="1 learning rate.*not parameters of the wrapped"):
        md.MetaDDP(md.MAML(net, optimizer=md.sgd(rate)))
    # Registered on the algorithm, it is summed like any parameter; deterministic mode, which
    # spreads only learn_lr's rates to the tasks, refuses it still.
    param = nn.Parameter(torch.tensor(0.1, dtype=torch.float64))
    alg = md.MAML(net, optimizer=md.adam(param))
    alg.register_parameter("rate", param)
    md.MetaDDP(alg).release()
    with pytest.raises(ValueError, match="through learn_lr only"):
        md.MetaDDP(alg, deterministic=True)
    md.MetaDDP(md.MAML(net, optimizer=md.sgd(0.1)), deterministic=True).release()


def test_the_free_gradient_needs_its_reduction_on_several_processes():
    # Unwrapped, it cannot know which ranks split the samples: a rank's own gradient, given
    # silently, was the question's failure. Asked for explicitly, it is given.
    for got in run_local(workers.free_grad_without_reduce, 2):
        assert all("without reduce=: pass learner.reduce" in m for m in got[:2]), got
        assert got[2] is True  # identity_reduce: exactly this rank's autograd gradient


def test_shard_lengths_must_agree():
    with pytest.raises(ValueError, match="3 inputs, 2 targets"):
        md.Batch.local(torch.ones(3, 1), torch.ones(2), n=8)
    with pytest.raises(ValueError, match="3 inputs, 2 targets"):
        md.Batch.split(torch.ones(3, 1), torch.ones(2), 0, 2)


def test_non_finite_inner_gradient_is_an_error():
    net = nn.Linear(1, 1).double()
    task = md.Task(md.Batch(torch.tensor([[float("inf")]], dtype=torch.float64),
                            torch.zeros(1, 1, dtype=torch.float64), 1),
                   md.Batch(torch.ones(1, 1, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64), 1))
    maml = md.MAML(net, inner_lr=0.1)
    with pytest.raises(FloatingPointError, match="inner step 0.*not finite"):
        maml.meta_loss([task], lambda p, y: (p - y) ** 2)


def test_wrapping_a_ddp_module_says_what_to_do():
    with pytest.raises(TypeError, match="pass the bare module"):
        md.MetaDDP(nn.DataParallel(nn.Linear(2, 1)))


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(1, 1).double(), nn.Linear(1, 1).double()

    def forward(self, x):
        return self.used(x)


def unused_parameter(allow: bool) -> str:
    """Task layout, every rank with a task: a layer the model never runs."""
    learner = md.MetaDDP(md.MAML(WithUnused(), inner_lr=0.1), md.Mesh.create(tasks=md.world_size()),
                         allow_unused=allow)
    x = torch.linspace(-1, 1, 6, dtype=torch.float64).unsqueeze(1)
    task = md.Task(md.Batch(x[:3], x[:3] ** 2, 3), md.Batch(x[3:], x[3:] ** 2, 3))
    learner.meta_loss(learner.shard([task] * md.world_size()),
                      lambda p, y: (p - y).pow(2).flatten()).backward()
    try:
        learner.sync_grads()
    except ValueError as e:
        return str(e)
    return f"grad {learner.module.model.unused.weight.grad}"


@pytest.mark.parametrize("world", [1, 2])
def test_a_parameter_no_rank_reaches_is_an_error_unless_allowed(world):
    for msg in run_local(unused_parameter, world, False):
        assert msg.startswith("no rank produced a gradient for: "), msg
        named = msg.split(": ", 1)[1].split(". ")[0].split(", ")
        assert sorted(named) == ["model.unused.bias", "model.unused.weight"], msg
        assert "allow_unused=True" in msg
    for msg in run_local(unused_parameter, world, True):
        assert msg == "grad None"  # left as it was: nothing to sum


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_buckets_carry_a_tag_too(dtype):
    for ok, caught in run_local(workers.half_precision_tags, 2, dtype):
        assert ok == "sum [2.0, 2.0, 2.0]"  # 0.5 + 1.5: exact in either format
        assert "ranks are out of step" in caught, caught


def test_a_loss_reading_a_trained_tensor_outside_the_module_is_refused():
    # Its gradient would be each rank's own shard's: sync_grads() sums the module's
    # parameters only. The float64 reference below is the meta-gradient by hand.
    got = {n: run_local(workers.captured_leaf, n) for n in (1, 2)}
    for n, outs in got.items():
        for out in outs:
            # Through the wrapper, or the algorithm it binds (learner.module.meta_loss).
            for case in ("captured", "captured again", "captured module"):
                assert "1 tensor(s) of shape ()" in out[case], (n, case, out[case])
                assert "not parameters of the wrapped module" in out[case]
    one, two = got[1][0], got[2]
    # Registered, it trains like any parameter: the same at 1 and 2 processes (float64 sums
    # of two halves against one whole: a few ulps).
    for out in two:
        assert out["scale grad"] == pytest.approx(one["scale grad"], rel=1e-13)
        assert out["loss"] == pytest.approx(one["loss"], rel=1e-13)
    # By hand, without metaddp: f(x) = w x + b from nn.Linear(1, 1) seeded 0, one inner
    # step on s * mean (f - 2x)^2, the query loss s * mean (f' - 3x)^2, and its derivative
    # by s through the step.
    torch.manual_seed(0)
    net = nn.Linear(1, 1).double()
    s = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    x = torch.linspace(-1, 1, 8, dtype=torch.float64)
    w, b = net.weight.detach().reshape(()), net.bias.detach().reshape(())
    w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
    inner = s * ((w * x + b - 2 * x) ** 2).mean()
    gw, gb = torch.autograd.grad(inner, (w, b), create_graph=True)
    w2, b2 = w - 0.1 * gw, b - 0.1 * gb
    query = s * ((w2 * x + b2 - 3 * x) ** 2).mean()
    (ds,) = torch.autograd.grad(query, s)
    # One process's float64 meta-step against the hand-written one: rounding only.
    assert one["scale grad"] == pytest.approx(ds.item(), rel=1e-12)
    assert one["loss"] == pytest.approx(query.item(), rel=1e-12)


def test_dropout_in_training_mode_draws_the_one_process_masks_on_two():
    # Masks keyed by the samples' global indices (metaddp.forward): the same meta-steps on one
    # process and on two that split every batch.
    got = {n: run_local(workers.dropout_keyed, n) for n in (1, 2)}
    one = got[1][0]
    # The masks move with the meta-step: a second step differs from the first.
    assert one["step 1"]["loss"] != one["step 0"]["loss"]
    for out in got[2]:
        # Float64 sums of halves against the whole: a few ulps.
        for case in ("step 0", "step 1", "eval"):
            assert out[case]["loss"] == pytest.approx(one[case]["loss"], rel=1e-13), case
            assert out[case]["grad"] == pytest.approx(one[case]["grad"], rel=1e-12, abs=1e-15), case
        assert out["adapt"] == pytest.approx(one["adapt"], rel=1e-12, abs=1e-15)
    for outs in got.values():
        for out in outs:
            # clone()'s forwards say nothing of their samples, and RReLU's random slopes are not
            # keyed: refused under MetaDDP at any size.
            assert "clone()'s learner runs forwards whose samples metaddp is not" in out["clone"]
            assert "a forward you run yourself (learner(x, fast))" in out["own forward"]
            assert out["local forward"] == "accepted"
            assert "RReLU's random slopes are not keyed" in out["rrelu"], out["rrelu"]
    assert got[1][0]["steps differ"] == "accepted"
    for out in got[2]:  # the masks' meta-step is a setting: ranks that differ fail at the SUM
        assert "settings" in out["steps differ"], out["steps differ"]


def test_dropout_keeps_a_single_process_to_the_task_loop():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 1)).double()
    x = torch.linspace(-1, 1, 6, dtype=torch.float64)[:, None]
    tasks = [md.Task(md.Batch(x, 2 * x, 6), md.Batch(x, 3 * x, 6)) for _ in range(3)]
    mse = lambda p, y: (p - y) ** 2  # noqa: E731
    # Stacking would draw no masks (vmap refuses random operations): the loop runs instead,
    # with keyed masks (no generator is read), the same ones as batched=False.
    torch.manual_seed(5)
    auto = md.MAML(net, inner_lr=0.1, steps=1).meta_loss(tasks, mse)
    torch.manual_seed(6)
    loop = md.MAML(net, inner_lr=0.1, steps=1, batched=False).meta_loss(tasks, mse)
    assert auto.item() == loop.item()
    assert md.MAML(net, inner_lr=0.1, steps=1).eval().meta_loss(tasks, mse).item() != auto.item()
    net.train()
    # Stacked, each task draws its own keyed masks under vmap: the loop's numbers.
    stacked = md.MAML(net, inner_lr=0.1, steps=1, batched=True).meta_loss(tasks, mse)
    assert stacked.item() == pytest.approx(loop.item(), rel=1e-14)  # float64 regrouped sums

    class Drops(nn.Module):  # dropout called in the forward, not as a layer
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(1, 1).double()

        def forward(self, x):
            return torch.nn.functional.dropout(self.layer(x), 0.5, training=True)

    # F.dropout in the forward is keyed too; the loop runs it (the routing is seen in the
    # forward's source), and stacked tasks draw the same masks.
    drops = md.MAML(Drops(), inner_lr=0.1, steps=1)
    first, second = drops.meta_loss(tasks, mse).item(), drops.meta_loss(tasks, mse).item()
    assert first != second  # each meta-step draws its own masks
    drops.at_step(0)
    assert drops.meta_loss(tasks, mse).item() == first  # the same step, the same masks
    stacked = md.MAML(drops.model, inner_lr=0.1, steps=1, batched=True).meta_loss(tasks, mse)
    assert stacked.item() == pytest.approx(first, rel=1e-14)


def test_mistakes_that_would_change_the_numbers_with_the_world_size_are_errors():
    got = {n: run_local(workers.user_mistakes, n) for n in (1, 2)}
    (one,) = got[1]
    # On one process there is nothing to split: each of these gives the right number.
    cases = ("whole", "whole adapt", "clip at once", "clip later", "replaced later", "clip sharded",
             "clip not overlapped")
    for case in cases:
        assert one[case] == "accepted", (case, one[case])
    assert one["unsummed"] == ["accepted"] * 2
    # Random draws metaddp cannot key are refused under MetaDDP at any size: the model that
    # debugs on one process is the one that trains on many. F.dropout is keyed.
    assert "drew random numbers" in one["randn"], one["randn"]
    for case in ("F.dropout", "F.dropout module", "F.dropout adapt"):
        assert isinstance(one[case], float), (case, one[case])
    for out in got[2]:
        # Whole tasks where the samples are split: each rank would add the whole batch.
        assert "holds all 8 of its samples on this rank" in out["whole"], out["whole"]
        assert "holds all 8 of its samples" in out["whole adapt"], out["whole adapt"]
        # A gradient edited between backward() and sync_grads(): before sums start during
        # the backward (each rank would clip its own part) and after (the edit was lost);
        # with sharded weights (each rank would clip its own rows) and without overlap.
        for case in ("clip at once", "clip later", "replaced later", "clip sharded",
                     "clip not overlapped"):
            assert "was changed between backward() and sync_grads()" in out[case], (case, out)
        for text in out["unsummed"]:
            assert "but sync_grads() never summed" in text, text
        # The sample layout gives every rank a part of every task: each adapts and draws the
        # masks of its own samples, the one-process ones (float64 sums of halves: a few ulps).
        assert "drew random numbers" in out["randn"], out["randn"]
        for case in ("F.dropout", "F.dropout module", "F.dropout adapt"):
            assert out[case] == pytest.approx(one[case], rel=1e-12), case
        assert out["F.dropout eval"] == "accepted"


def test_a_clone_loop_whose_task_count_grows_gives_the_one_process_weights():
    # One backward per task, 1 task per rank for three steps and then 3: the sums start in
    # sync_grads() once clone() has run, so the longer loop is not refused.
    got = {n: run_local(workers.clone_loop_growing, n) for n in (1, 2)}
    # By hand, float64, without metaddp: MAML, one inner step of 0.1, the meta-step of SGD 0.05.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    params = [p.detach().clone().requires_grad_() for p in net.parameters()]
    names = [n for n, _ in net.named_parameters()]
    x = torch.linspace(-1, 1, 6, dtype=torch.float64)[:, None]

    def f(ws, xs):
        return torch.func.functional_call(net, dict(zip(names, ws)), (xs,))

    want = []
    for t, count in enumerate([2, 2, 2, 6, 6]):
        total = 0
        for i in range(count):
            sy, qy = (1 + i + t) * x.sin(), (2 + i) * x
            inner = ((f(params, x) - sy) ** 2).mean()
            grads = torch.autograd.grad(inner, params, create_graph=True)
            fast = [p - 0.1 * g for p, g in zip(params, grads)]
            total = total + ((f(fast, x) - qy) ** 2).mean() / count
        grads = torch.autograd.grad(total, params)
        params = [(p - 0.05 * g).detach().requires_grad_() for p, g in zip(params, grads)]
        want.append(torch.cat([p.reshape(-1) for p in params]))
    for outs in got.values():
        for out in outs:
            for step, (w, ref) in enumerate(zip(out["weights"], want)):
                # float64 sums of per-task gradients in another order: a few ulps per step.
                assert torch.allclose(torch.tensor(w, dtype=torch.float64), ref,
                                      rtol=1e-12, atol=1e-14), step


def test_stacking_a_batchnorm_that_tracks_running_statistics_moves_them_as_the_loop():
    # Each task runs on its own copy of the statistics, folded in the loop's order after.
    def make(momentum=0.1):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4, momentum=momentum),
                             nn.Linear(4, 1)).double()

    x = torch.linspace(-1, 1, 6, dtype=torch.float64)[:, None]
    tasks = [md.Task(md.Batch(x, k * x, 6), md.Batch(x, 3 * x, 6)) for k in (2, -1)]
    mse = lambda p, y: (p - y).squeeze(-1) ** 2  # noqa: E731
    nets = {b: make() for b in (True, False)}
    losses = {b: md.MAML(nets[b], inner_lr=0.1, batched=b).meta_loss(tasks, mse) for b in nets}
    # float64, the same operations per task, the fold's sums in another order: a few ulps.
    assert losses[True].item() == pytest.approx(losses[False].item(), rel=1e-13)
    for (k, a), b in zip(nets[True].named_buffers(), nets[False].buffers()):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), k
    assert int(nets[True][1].num_batches_tracked) == 4  # 2 tasks x (1 support + 1 query)
    # What the fold cannot do is refused with the way out.
    with pytest.raises(ValueError, match="cumulative average.*momentum=None"):
        md.MAML(make(momentum=None), inner_lr=0.1, batched=True).meta_loss(tasks, mse)
    with pytest.raises(ValueError, match="memory='low' with stacked tasks.*batched=False"):
        md.MAML(make(), inner_lr=0.1, batched=True, memory="low").meta_loss(tasks, mse)
    # In eval mode the statistics are read, not written: stacking runs, and gives the loop's
    # meta-loss (float64, the same operations per task: equal to a few ulps).
    net = make().eval()
    stacked = md.MAML(net, inner_lr=0.1, batched=True).meta_loss(tasks, mse)
    loop = md.MAML(net, inner_lr=0.1, batched=False).meta_loss(tasks, mse)
    assert stacked.item() == pytest.approx(loop.item(), rel=1e-13)
