"""Bilevel problems: every hypergradient method at 1 to 4 processes against an independent
float64 reference (tests/reference_bilevel.py), and the engine's refusals.

The scenario is a data-reweighting lookahead (Meta-Weight-Net's weighting network, a learned
weight decay in the inner objective), 3 inner steps; 7 inner and 3 outer samples split over
the ranks, so 4 ranks hold shards of 2, 2, 2, 1 and 1, 1, 1, 0 samples (uneven and empty).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metaddp as md
import reference_bilevel as R
from metaddp.distributed.launch import run_local
from metaddp.testing import scenarios as S

# Float64. Between world sizes only the order of the partial sums changes: observed < 5e-13
# relative (the finite-difference methods divide a difference of two losses by 2e, which
# raises their rounding from ~1e-16 to ~1e-14 of the loss). Against the reference the
# arithmetic differs too (an explicit Hessian matrix in place of Hessian-vector products):
# observed < 1e-12. A missing reduction or a rank-local norm is an error of 1e-3 or more.
RTOL = 1e-10

METHODS = ("unrolled", "truncated", "implicit-cg", "neumann", "t1t2", "sama")


def problems() -> list[S.BilevelProblem]:
    out = [
        S.BilevelProblem(method=m, start=start, optimizer="adam" if m == "sama" else "sgd")
        for m in METHODS
        for start in ("current", "outer")
    ]
    out += [
        S.BilevelProblem(method="t1t2", optimizer="adam"),  # the optimizer's own Jacobian
        S.BilevelProblem(method="unrolled", n_problems=3, layout="hybrid"),
        S.BilevelProblem(method="neumann", n_problems=3, layout="task", start="outer"),
        S.BilevelProblem(method="implicit-cg", n_problems=2, layout="hybrid", start="outer"),
        S.BilevelProblem(method="unrolled", memory="low"),
        # Long inner runs through a replay tree (memory=Replay): SGD with momentum and Adam,
        # every layout, and a start that is the meta-parameters.
        S.BilevelProblem(method="unrolled", memory=md.Replay(k=2), steps=8, optimizer="momentum",
                         inner_lr=0.05),
        S.BilevelProblem(method="unrolled", memory=md.Replay(k=3), steps=13, optimizer="adam",
                         inner_lr=0.02, layout="hybrid", n_problems=3),
        S.BilevelProblem(method="unrolled", memory="replay", steps=64, optimizer="momentum",
                         inner_lr=0.02, layout="task", n_problems=2, start="outer"),
        S.BilevelProblem(method="unrolled", memory=md.Replay(k=4), steps=64, optimizer="adam",
                         inner_lr=0.01),
        # A training run: each inner step on its own minibatch (md.bilevel.Minibatches), so at
        # 3 and 4 ranks a step often finds none of its samples on some rank.
        S.BilevelProblem(method="unrolled", memory=md.Replay(k=3), steps=40, optimizer="momentum",
                         inner_lr=0.05, n_inner=23, minibatch=5),
        S.BilevelProblem(method="unrolled", steps=12, optimizer="adam", inner_lr=0.02, n_inner=17,
                         minibatch=4, layout="hybrid", n_problems=2),
        S.BilevelProblem(method="truncated", steps=10, n_inner=11, minibatch=3, start="outer"),
    ]
    return out


def _worker(probs: list[S.BilevelProblem]) -> list[dict]:
    return [S.run_bilevel(p) for p in probs]


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    probs = problems()
    out = {1: _worker(probs)}
    for w in (2, 3, 4):
        out[w] = run_local(_worker, w, probs)[0]
    return out


def reference(p: S.BilevelProblem) -> tuple[float, dict[str, torch.Tensor]]:
    algorithm = p.build_algorithm()
    params = dict(algorithm.named_parameters())
    theta = [params[f"model.{k}"] for k in ("0.weight", "0.bias", "2.weight", "2.bias")]
    omega = [params[f"outer.net.{k}"] for k in ("0.weight", "0.bias", "2.weight", "2.bias")]
    pb = R.Problem(
        theta,
        omega,
        params["outer.log_decay"],
        lr=p.inner_lr,
        optimizer=p.optimizer,
        start=p.start,
        proximal=S.PROXIMAL,
        minibatch=None if p.minibatch is None else (p.minibatch, p.seed),
    )
    tasks = [((t.support.x, t.support.y), (t.query.x, t.query.y)) for t in map(p.task, range(p.n_problems))]
    loss, grads = R.hypergradient(pb, tasks, p.method, p.steps, p.method_options())
    names = [f"outer.net.{k}" for k in ("0.weight", "0.bias", "2.weight", "2.bias")] + ["outer.log_decay"]
    if p.start == "outer":
        names += [f"model.{k}" for k in ("0.weight", "0.bias", "2.weight", "2.bias")]
    return loss, dict(zip(names, grads))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("index", range(len(problems())), ids=lambda i: _name(problems()[i]))
def test_hypergradient_equals_reference(results, world, index):
    p = problems()[index]
    loss, ref = reference(p)
    got = results[world][index]
    assert set(got["grads"]) == set(ref), "the outer variables that got a gradient"
    scale = max(float(g.abs().max()) for g in ref.values())
    assert scale > 1e-6, "a hypergradient that vanishes would compare nothing"
    # Unrolled and truncated steps (replayed or not, on minibatches or not) are the reference's
    # own arithmetic in another order: observed <= 4.5e-15 relative, held to 1e-12.
    tol = 1e-12 if p.method in ("unrolled", "truncated") else RTOL
    for k, g in ref.items():
        err = float((got["grads"][k] - g).abs().max()) / scale
        assert err < tol, f"{k}: {err:.3g}"
    assert got["loss"] == pytest.approx(loss, rel=1e-12)  # one loss: rounding of a mean


def _name(p: S.BilevelProblem) -> str:
    batches = "" if p.minibatch is None else f"-minibatch{p.minibatch}"
    return f"{p.method}-{p.start}-{p.optimizer}-{p.layout}-x{p.n_problems}-{p.memory}{batches}"


def test_methods_differ_from_each_other(results):
    """The references are not all one number: each method's hypergradient is its own."""
    firsts = [r["grads"]["outer.log_decay"].item() for r in results[1][:12:2]]
    assert len({round(v, 9) for v in firsts}) == len(firsts)


# --- one engine: MAML and iMAML are instances -----------------------------------------------


def _sinusoid_tasks(n: int = 3) -> list[md.Task]:
    p = S.Problem(n_tasks=n)
    return [p.task(i) for i in range(n)]


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


def test_bilevel_from_the_start_is_maml():
    p = S.Problem(steps=2)
    maml = md.MAML(p.build_model(), inner_lr=p.inner_lr, steps=2, batched=False)
    bilevel = md.Bilevel(p.build_model(), start="outer", inner_lr=p.inner_lr, steps=2)
    maml.meta_loss(_sinusoid_tasks(), S.mse_per_sample).backward()
    bilevel.meta_loss(_sinusoid_tasks(), S.mse_per_sample).backward()
    a, b = _grads(maml), _grads(bilevel)
    # The same operations in the same order: identical bits.
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_implicit_cg_with_a_proximal_term_is_imaml():
    p = S.Problem(steps=3)
    lam, iters = 5.0, 40
    imaml = md.IMAML(p.build_model(), lam=lam, inner_lr=p.inner_lr, steps=3, cg_steps=iters, cg_tol=1e-12)
    net = p.build_model()
    theta = dict(net.named_parameters())

    def proximal(fast):
        return 0.5 * lam * sum(((fast[k] - theta[k]) ** 2).sum() for k in theta)

    bilevel = md.Bilevel(
        net,
        start="outer",
        penalty=proximal,
        inner_lr=p.inner_lr,
        steps=3,
        method=md.ImplicitCG(iterations=iters, tol=1e-12),
    )
    imaml.meta_loss(_sinusoid_tasks(), S.mse_per_sample).backward()
    bilevel.meta_loss(_sinusoid_tasks(), S.mse_per_sample).backward()
    a, b = _grads(imaml), _grads(bilevel)
    # iMAML solves (I + H/lam) v = g, the engine (H + lam I) v' = g and takes lam v': CG's
    # iterates on a matrix scaled by a constant are the same up to rounding, converged to
    # 1e-12; the inner steps differ in where the proximal gradient is added (1 ulp).
    scale = max(float(g.abs().max()) for g in a.values())
    assert max(float((a[k] - b[k]).abs().max()) for k in a) / scale < 1e-9


def test_t1t2_is_truncated_backprop_through_one_step():
    """T1T2's central differences approximate the mixed second derivative of Truncated(1)
    to O(r^2): at r = 1e-4 the two agree to ~1e-8 relative; a sign or scale error would be
    order one. (The weighting scenario's inner loss detaches the losses its weights are
    computed from; differences see that part of the value too, so it is left out here.)"""
    p = S.Problem(steps=3, n_tasks=2)
    outs = {}
    for method in (md.Truncated(last=1), md.T1T2(r=1e-4)):
        hyper = nn.ParameterDict({"log_decay": nn.Parameter(torch.tensor(-2.0, dtype=torch.float64))})

        def decay(fast, hyper=hyper):
            return 0.5 * hyper["log_decay"].exp() * sum((w * w).sum() for w in fast.values())

        bilevel = md.Bilevel(
            p.build_model(), outer=hyper, penalty=decay, start="current", steps=3, inner_lr=p.inner_lr, method=method
        )
        bilevel.meta_loss(_sinusoid_tasks(2), S.mse_per_sample).backward()
        outs[type(method).__name__] = float(hyper["log_decay"].grad)
    a, b = outs["Truncated"], outs["T1T2"]
    assert abs(a) > 1e-4
    assert abs(a - b) / abs(a) < 1e-6, outs


# --- refusals ------------------------------------------------------------------------------


def test_refusals():
    net = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="no path to the inner steps' start"):
        md.Bilevel(net, start="outer", method=md.ImplicitCG())
    with pytest.raises(ValueError, match="start must be one of"):
        md.Bilevel(net, start="init")
    with pytest.raises(TypeError, match="hypergradient method"):
        md.Bilevel(net, method="cg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory='low'"):
        md.Bilevel(net, start="current", memory="low", method=md.Neumann())
    with pytest.raises(ValueError, match="whole number"):
        md.Truncated(last=0)
    with pytest.raises(ValueError, match="positive"):
        md.Neumann(alpha=0)
    with pytest.raises(ValueError, match="nothing for the hypergradient to reach"):
        md.Bilevel(net, start="current")  # a lookahead with no outer variable
    with pytest.raises(ValueError, match="train_inner .* needs start='current'"):
        md.Bilevel(net, train_inner=True)
    with pytest.raises(TypeError, match="no clone"):
        md.Bilevel(net, penalty=lambda fast: fast["weight"].sum()).clone()
    # Rates computed from outer parameters once, not by a function that builds the optimizer:
    # the error names the function form, even where the parameters are given as outer=.
    hp = nn.ParameterDict({k: nn.Parameter(torch.tensor(-2.0)) for k in ("weight", "bias")})
    with pytest.raises(ValueError, match=r"computed tensors.*optimizer=lambda: md\.inner\.sgd"):
        md.Bilevel(net, outer=hp, optimizer=md.inner.sgd({k: hp[k].exp() for k in hp}), start="outer")


def test_minibatch_refusals_name_the_mistake():
    net = nn.Linear(3, 2).double()
    mb = md.bilevel.Minibatches(4)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="Minibatches"):
            md.bilevel.Minibatches(bad)
    with pytest.raises(ValueError, match="use Unrolled or Truncated"):
        md.Bilevel(net, start="current", weights=md.bilevel.WeightNet(), minibatches=mb,
                   method=md.bilevel.ImplicitCG())
    with pytest.raises(ValueError, match="drop one of them"):
        md.Bilevel(net, start="current", train_inner=True, minibatches=mb)
    with pytest.raises(TypeError, match="Minibatches"):
        md.Bilevel(net, minibatches=4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="minibatches="):
        md.Bilevel(net, minibatches=mb).clone()
    p = S.BilevelProblem(minibatch=9)  # more than the 7 inner samples
    with pytest.raises(ValueError, match="minibatches of 9 samples from a support of 7"):
        p.build_algorithm().meta_loss([p.task(0)])
    # A rank's part cut by hand without its start: which of its samples a step takes is unknown.
    t = S.BilevelProblem().task(0)
    part = md.Task(md.Batch.local(t.support.x[:3], t.support.y[:3], 7), t.query)
    with pytest.raises(ValueError, match="start=") as e:
        md.bilevel.Minibatches(2).pick(part.support, 0)
    assert "learner.shard" in str(e.value)


def test_minibatches_split_over_ranks_are_the_minibatch():
    # Step k's samples, cut at every split of a batch of 11, are the minibatch's, in order,
    # and each part starts where the parts before it end.
    mb, x = md.bilevel.Minibatches(5, seed=3), torch.arange(11.0)[:, None]
    for k in range(4):
        want = mb.indices(11, k)
        assert len(set(want.tolist())) == 5
        for world in (1, 2, 3, 4):
            parts = [mb.pick(md.Batch.split(x, x[:, 0], r, world), k) for r in range(world)]
            assert torch.equal(torch.cat([b.x[:, 0] for b in parts]), want.double().float())
            assert [b.start for b in parts] == [sum(len(q.x) for q in parts[:r]) for r in range(world)]
            assert all(b.n == 5 for b in parts)
    assert not torch.equal(mb.indices(11, 0), mb.indices(11, 1))  # each step its own


def test_truncating_more_steps_than_taken_is_an_error():
    p = S.BilevelProblem(method="truncated", steps=1)
    with pytest.raises(ValueError, match="more steps than the 1 inner steps"):
        p.build_algorithm().meta_loss([p.task(0)])


def test_learned_rates_need_a_method_that_sees_the_steps():
    net = nn.Linear(2, 2)
    rates = nn.ParameterDict({"lr": nn.Parameter(torch.tensor(0.1))})
    bilevel = md.Bilevel(net, outer=rates, start="current", optimizer=md.sgd(rates["lr"]), method=md.ImplicitCG())
    x = torch.randn(4, 2)
    task = md.Task(md.Batch(x, x, 4), md.Batch(x, x, 4))
    with pytest.raises(ValueError, match="learning rates that require grad would get no gradient"):
        bilevel.meta_loss([task], lambda p, y: F.mse_loss(p, y, reduction="none"))


def test_an_outer_network_not_given_as_outer_is_refused():
    """A weighting network the inner loss reads by closure, not registered with outer=: its
    gradient would stay each rank's own, so the wrapper refuses the meta-loss."""
    p = S.BilevelProblem()
    net, weighting = p.build_model()

    def weighted(pred, y):
        losses = F.cross_entropy(pred, y, reduction="none")
        return weighting(losses) * losses

    # From the start: nothing is refused when the problem is built (the model's weights are
    # outer variables), so the wrapper's search of the meta-loss finds the network.
    learner = md.MetaDDP(md.Bilevel(net, inner_loss=weighted, outer_loss=S.ce_per_sample, start="outer"))
    with pytest.raises(ValueError, match="not parameters of the wrapped module"):
        learner.meta_loss(learner.shard(1, p.task))


def test_a_mean_inner_loss_is_refused():
    p = S.BilevelProblem()
    net, weighting = p.build_model()
    learner = md.MetaDDP(
        md.Bilevel(net, outer=weighting, inner_loss=F.cross_entropy, outer_loss=S.ce_per_sample, start="current")
    )
    with pytest.raises(ValueError, match="one loss per sample"):
        learner.meta_loss(learner.shard(1, p.task))


def test_the_lookahead_leaves_the_model_to_the_callers_step():
    """start='current': the meta-loss reaches the outer variables only; sync_grads accepts
    the model's missing gradients, and a step of the caller's own trains the model."""
    p = S.BilevelProblem()
    learner = md.MetaDDP(p.build_algorithm())
    model = learner.module.model
    learner.meta_loss(learner.shard(1, p.task)).backward()
    learner.sync_grads()
    assert all(q.grad is None for q in model.parameters())
    assert learner.module.outer.log_decay.grad is not None


def test_optimizer_forms():
    """A built optimizer, a factory of the rate (md.adam, as MAML takes it) and a function of
    nothing built at every meta-loss give the same problem."""
    p = S.Problem(steps=2)
    outs = []
    for optimizer in (md.adam(0.05), md.adam, lambda: md.adam(0.05)):
        bilevel = md.Bilevel(p.build_model(), start="outer", steps=2, inner_lr=0.05, optimizer=optimizer)
        bilevel.meta_loss(_sinusoid_tasks(2), S.mse_per_sample).backward()
        outs.append(_grads(bilevel))
    assert all(torch.equal(outs[0][k], o[k]) for o in outs[1:] for k in outs[0])
    with pytest.raises(TypeError, match="nn.Module"):
        md.Bilevel(nn.Linear(2, 2), outer={"w": torch.zeros(2)}, start="current")


@pytest.mark.parametrize("memory", ["default", "low"])
def test_rates_computed_once_and_returned_again_are_refused(memory):
    # The factory's rates must be built at every call: one computed once has its graph spent
    # by the first backward through it, which PyTorch would report in its own words.
    torch.manual_seed(0)
    net = nn.Linear(3, 1).double()
    hp = nn.ParameterDict({k: nn.Parameter(torch.tensor(-2.0, dtype=torch.float64)) for k in ("weight", "bias")})
    once = {k: hp[k].exp() for k in hp}
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    task = md.Task(md.Batch(x[:4], y[:4], 4), md.Batch(x[4:], y[4:], 4))
    loss_fn = lambda p, t: (p - t) ** 2  # noqa: E731
    fresh = md.Bilevel(net, outer=hp, optimizer=lambda: md.inner.sgd({k: hp[k].exp() for k in hp}),
                       start="outer", steps=2, memory=memory)
    for _ in range(2):  # the documented form: every call builds its rates
        fresh.meta_loss([task], loss_fn).backward()
    assert all(p.grad is not None and p.grad.abs() > 0 for p in hp.values())
    reused = md.Bilevel(net, outer=hp, optimizer=lambda: md.inner.sgd(once), start="outer", steps=2, memory=memory)
    with pytest.raises(ValueError, match="returned a learned rate it had returned before"):
        for _ in range(2):
            reused.meta_loss([task], loss_fn).backward()


def _train_inner_step(algorithm: md.Bilevel, task: md.Task, keep: bool) -> tuple[dict, int]:
    """One meta-loss and backward of ``algorithm`` (``keep``: the first inner step's gradient
    kept where the problem allows it; else computed again), its gradients and the forwards
    its model ran."""
    forwards = []
    hook = algorithm.model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    same = algorithm._same_objective
    if not keep:
        algorithm._same_objective = lambda: False  # the gradient computed again
    try:
        torch.manual_seed(1)  # a loss that draws draws alike in both runs
        algorithm.draw_step = 0  # and so does keyed dropout
        loss = algorithm.meta_loss([task])
        loss.backward()
    finally:
        hook.remove()
        algorithm._same_objective = same
    grads = {k: q.grad.clone() for k, q in algorithm.named_parameters() if q.grad is not None}
    algorithm.zero_grad(set_to_none=True)
    return {"loss": loss.detach(), **grads}, len(forwards)


@pytest.mark.parametrize("method", [*METHODS, "low"])
def test_plain_training_takes_the_first_steps_gradient_to_the_bit(method):
    # train_inner's gradient at the model's weights is the first inner step's, computed at
    # held copies of the same weights: kept from that step, one forward and backward fewer,
    # to the same bits; memory="low" rebuilds its steps and computes it again.
    low = method == "low"
    p = S.BilevelProblem(method="unrolled" if low else method, memory="low" if low else "default",
                         optimizer="adam" if method == "sama" else "sgd")
    algorithm = p.build_algorithm()
    algorithm.train_inner = True
    kept, fewer = _train_inner_step(algorithm, p.task(0), keep=True)
    again, more = _train_inner_step(algorithm, p.task(0), keep=False)
    assert kept.keys() == again.keys() and any(k.startswith("model.") for k in kept)
    assert all(torch.equal(kept[k], again[k]) for k in kept), method
    assert fewer == more - (0 if low else 1)


@pytest.mark.parametrize("draws", ["dropout", "running statistics", "loss"])
def test_plain_training_computes_the_gradient_again_where_a_forward_differs(draws):
    # Keyed dropout differs by the forward's number, running statistics move at every
    # forward, and a loss may draw from torch's generator: the gradient is computed again.
    torch.manual_seed(0)
    mid = {"dropout": nn.Dropout(0.3), "running statistics": nn.BatchNorm1d(5)}.get(draws, nn.Identity())
    net = nn.Sequential(nn.Linear(3, 5), mid, nn.Tanh(), nn.Linear(5, 2)).double()
    p = S.BilevelProblem(method="t1t2")
    weighting = md.bilevel.WeightNet(6).double()

    def noisy(pred, y):
        losses = S.ce_per_sample(pred, y)
        return losses * (1 + 1e-3 * torch.rand_like(losses)) if draws == "loss" else losses

    algorithm = md.Bilevel(net, weights=weighting, inner_loss=noisy, outer_loss=S.ce_per_sample,
                           start="current", method=md.bilevel.T1T2(), train_inner=True)
    kept, fewer = _train_inner_step(algorithm, p.task(0), keep=True)
    again, more = _train_inner_step(algorithm, p.task(0), keep=False)
    assert all(torch.equal(kept[k], again[k]) for k in kept)
    assert fewer == more


def test_plain_training_refuses_a_weighting_read_by_closure_after_inner_steps():
    # The search of the kept objective's graph finds what the search of a new one found.
    p = S.BilevelProblem(method="t1t2")
    net, weighting = p.build_model()

    def weighted(pred, y):
        losses = S.ce_per_sample(pred, y)
        return weighting(losses) * losses

    decay = nn.ParameterDict({"d": nn.Parameter(torch.tensor(0.1, dtype=torch.float64))})
    algorithm = md.Bilevel(net, outer=decay, inner_loss=weighted, outer_loss=S.ce_per_sample,
                           penalty=lambda fast: decay["d"] * sum((w * w).sum() for w in fast.values()),
                           start="current", method=md.bilevel.T1T2(), train_inner=True)
    with pytest.raises(ValueError, match="reads 4 trained tensor") as kept:
        algorithm.meta_loss([p.task(0)])
    algorithm._same_objective = lambda: False  # the objective computed again
    with pytest.raises(ValueError) as again:
        algorithm.meta_loss([p.task(0)])
    assert str(kept.value) == str(again.value)
