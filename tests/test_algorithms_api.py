"""The algorithms' single-process behaviour beyond the exactness tests: the clone()/adapt()
layer, ANIL's one body pass, learned rates with other optimizers, CG budgets and bad input."""

from __future__ import annotations

import copy
import functools
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metaddp
from metaddp import ANIL, IMAML, MAML, ConvergenceWarning, MetaSGD, Reptile, share
from metaddp.testing.scenarios import Problem


def mse(pred, y):
    return F.mse_loss(pred, y, reduction="none")


def problem_tasks(n=3):
    return Problem(n_tasks=n).tasks()


def fresh():
    return Problem().build_model()


def test_clone_adapt_equals_meta_loss_and_leaves_module_alone():
    tasks = problem_tasks()
    m_a, m_b = MAML(fresh(), inner_lr=0.1, steps=2, batched=False), MAML(fresh(), inner_lr=0.1, steps=2)
    before = {k: v.detach().clone() for k, v in m_b.model.named_parameters()}
    ref = m_a.meta_loss(tasks, mse)
    ref.backward()
    total = 0.0
    for t in tasks:  # written the way learn2learn users write it
        learner = m_b.clone()
        for _ in range(2):
            learner.adapt(share(mse(learner(t.support.x), t.support.y), t.support.n))
        total = total + share(mse(learner(t.query.x), t.query.y), t.query.n)
    (total / len(tasks)).backward()
    for (k, a), (_, b) in zip(m_a.model.named_parameters(), m_b.model.named_parameters()):
        # The same operations in the same order: bitwise equal.
        assert torch.equal(a.grad, b.grad), k
        assert torch.equal(b.detach(), before[k]), f"{k} was modified"
    assert all(isinstance(p, nn.Parameter) for p in m_b.model.parameters())


def test_clone_rejects_non_scalar_loss():
    learner = MAML(fresh(), inner_lr=0.1).clone()
    with pytest.raises(ValueError, match="scalar loss"):
        learner.adapt(torch.ones(3, requires_grad=True))


def test_anil_runs_the_body_once_per_batch():
    body = nn.Sequential(nn.Linear(1, 8), nn.Tanh()).double()
    calls = []
    body.register_forward_hook(lambda *a: calls.append(1))
    anil = ANIL(body, nn.Linear(8, 1).double(), inner_lr=0.1, steps=5)
    tasks = problem_tasks(2)
    anil.meta_loss(tasks, mse).backward()
    assert len(calls) == 2 * 2  # support and query, per task; not once per inner step
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in body.parameters())


def test_metasgd_with_adam_and_scalar_rates_trains_the_rates():
    tasks = problem_tasks(2)
    for per, shape in (("scalar", ()), ("tensor", ()), ("parameter", None)):
        alg = MetaSGD(fresh(), inner_lr=0.05, steps=2, optimizer=functools.partial(metaddp.adam, b1=0.5), per=per)
        alg.meta_loss(tasks, mse).backward()
        rates = list(alg.lr.parameters())
        assert len(rates) == (1 if per == "scalar" else len(list(alg.model.parameters())))
        for r, p in zip(rates, alg.model.parameters()):
            assert r.shape == (p.shape if shape is None else shape)
            assert r.grad is not None and torch.isfinite(r.grad).all() and r.grad.abs().sum() > 0


def test_learn_lr_needs_a_factory():
    with pytest.raises(TypeError, match="factory"):
        MAML(fresh(), inner_lr=0.1, learn_lr="tensor", optimizer=metaddp.sgd(0.1))


def test_reptile_gradient_is_the_displacement_and_works_with_torch_optim():
    tasks = problem_tasks(2)
    alg = Reptile(fresh(), inner_lr=0.1, steps=3)
    theta = {k: v.detach().clone() for k, v in alg.model.named_parameters()}
    loss = alg.meta_loss(tasks, mse)
    loss.backward()
    disp = {k: torch.zeros_like(v) for k, v in theta.items()}
    for t in tasks:
        phi = alg.adapt(t.support, mse)
        for k in disp:
            disp[k] += (theta[k] - phi[k].detach()) / 2
    for k, p in alg.model.named_parameters():
        # The same float64 numbers summed in another order: a few ulps apart.
        torch.testing.assert_close(p.grad, disp[k], rtol=1e-12, atol=1e-14)
    # The value is half the mean squared distance moved.
    want = sum(0.5 * sum(((theta[k] - alg.adapt(t.support, mse)[k].detach()) ** 2).sum() for k in theta)
               for t in tasks) / 2
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-12, atol=0)  # as above
    opt = torch.optim.SGD(alg.parameters(), lr=0.5)
    opt.step()
    for k, p in alg.model.named_parameters():
        torch.testing.assert_close(p.detach(), theta[k] - 0.5 * disp[k], rtol=1e-12, atol=1e-14)  # as above


def test_imaml_cg_budget_warns_with_the_residual():
    tasks = problem_tasks(1)
    alg = IMAML(fresh(), lam=20.0, inner_lr=0.1, steps=2, cg_steps=1, cg_tol=1e-12)
    with pytest.warns(ConvergenceWarning, match=r"did not converge in 1 iterations: relative residual [0-9.e-]+"):
        alg.meta_loss(tasks, mse)
    residual, iters = alg.last_cg
    assert iters == 1 and residual > 1e-12


def test_imaml_converged_solution_satisfies_the_system():
    t = problem_tasks(1)[0]
    alg = IMAML(fresh(), lam=20.0, inner_lr=0.1, steps=2, cg_steps=100, cg_tol=1e-13)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v, _ = alg.solve(t, mse)
    assert alg.last_cg[0] <= 1e-13


def test_imaml_indefinite_system_is_an_error():
    t = problem_tasks(1)[0]
    alg = IMAML(fresh(), lam=0.01, inner_lr=0.01, steps=1, cg_steps=50)
    with pytest.raises(FloatingPointError, match="not positive definite"):
        alg.solve(t, mse)


def test_imaml_adapt_and_clone_step_on_the_proximal_objective():
    # The weights iMAML's meta-gradient is taken at: inner steps on L_s + lam/2 ||phi - theta||^2.
    # By hand, in float64, with torch.func alone.
    t = problem_tasks(1)[0]
    lam, lr, steps = 10.0, 0.05, 3
    alg = IMAML(fresh(), lam=lam, inner_lr=lr, steps=steps)
    theta = {k: p.detach() for k, p in alg.model.named_parameters()}
    phi = dict(theta)
    for _ in range(steps):
        ps = {k: v.clone().requires_grad_() for k, v in phi.items()}
        loss = mse(torch.func.functional_call(alg.model, ps, (t.support.x,)), t.support.y).mean()
        g = dict(zip(ps, torch.autograd.grad(loss, list(ps.values())), strict=True))
        phi = {k: (v - lr * (g[k] + lam * (v - theta[k]))).detach() for k, v in ps.items()}
    adapted = alg.adapt(t.support, mse)
    learner = alg.clone()
    for _ in range(steps):
        learner.adapt(share(mse(learner(t.support.x), t.support.y), t.support))
    for k in phi:
        # The same operations as the hand-written loop, in another grouping (the proximal
        # term added after the gradient's): float64 rounding, a few ulps of 1e-16.
        torch.testing.assert_close(adapted[k], phi[k], rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(learner.params[k].detach(), phi[k], rtol=1e-13, atol=1e-15)
    # Without the proximal term the weights move elsewhere: the test can tell them apart.
    plain = MAML(fresh(), inner_lr=lr, steps=steps, first_order=True).adapt(t.support, mse)
    assert max(float((plain[k].detach() - phi[k]).abs().max()) for k in phi) > 1e-3


class _Fixed(nn.Module):
    """A linear layer whose weights are constants (buffers): what a frozen layer must be."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", layer.weight.detach().clone())
        self.register_buffer("bias", layer.bias.detach().clone())

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


@pytest.mark.parametrize("make", [
    lambda m: MAML(m, inner_lr=0.1, steps=2),
    lambda m: MAML(m, inner_lr=0.1, steps=2, memory="low"),
    lambda m: MetaSGD(m, inner_lr=0.1, steps=2),
    lambda m: Reptile(m, inner_lr=0.1, steps=3),
    lambda m: IMAML(m, lam=20.0, inner_lr=0.1, steps=2),
], ids=["maml", "maml-low", "metasgd", "reptile", "imaml"])
def test_a_frozen_layer_stays_fixed_in_the_inner_loop(make):
    # requires_grad=False: neither trained nor adapted, exactly as a layer of constants.
    tasks = problem_tasks(2)
    torch.manual_seed(0)
    first, last = nn.Linear(1, 8).double(), nn.Linear(8, 1).double()
    frozen = nn.Sequential(first, nn.Tanh(), last)
    first.requires_grad_(False)
    constant = nn.Sequential(_Fixed(first), nn.Tanh(), copy.deepcopy(last))
    a, b = make(frozen), make(constant)
    a.meta_loss(tasks, mse).backward()
    b.meta_loss(tasks, mse).backward()
    assert first.weight.grad is None and first.bias.grad is None
    got = {k: p.grad for k, p in a.named_parameters() if p.requires_grad}
    want = {k: p.grad for k, p in b.named_parameters()}
    assert set(got) == set(want) and got
    for k in want:
        # The same operations on the same float64 numbers: equal to rounding, or exactly.
        torch.testing.assert_close(got[k], want[k], rtol=1e-14, atol=1e-16)


def test_bad_algorithm_arguments():
    with pytest.raises(ValueError, match="lam"):
        IMAML(fresh(), lam=0.0)
    with pytest.raises(ValueError, match="learn_lr"):
        Reptile(fresh(), learn_lr="scalar")
    with pytest.raises(ValueError, match="steps"):
        MAML(fresh(), steps=-1)
    with pytest.raises(TypeError):
        MAML(fresh(), 0.1)  # options are keyword-only
    with pytest.raises(TypeError, match="per="):
        MetaSGD(fresh(), learn_lr="scalar")
    with pytest.raises(TypeError, match="inner_rate"):
        metaddp.BOIL(nn.Linear(1, 2), nn.Linear(2, 1), inner_rate=0.1)  # a misspelt setting


def test_the_inner_settings_are_named_once():
    """The algorithms that pass ``**settings`` on take what ``Algorithm`` takes, whose
    signature holds the defaults: the settings type and that signature agree."""
    import inspect

    from metaddp.algorithms._base import Algorithm, InnerSettings
    from metaddp.algorithms._maml import MAMLSettings

    def keywords(f):
        return {n for n, p in inspect.signature(f).parameters.items() if p.kind is p.KEYWORD_ONLY}

    assert set(InnerSettings.__annotations__) == keywords(Algorithm.__init__)
    assert set(MAMLSettings.__annotations__) == keywords(Algorithm.__init__) | keywords(MAML.__init__)
    cavia = metaddp.CAVIA(nn.Linear(3, 1), context=2)
    assert cavia.inner_lr == 1.0 and metaddp.CAVIA(nn.Linear(3, 1), context=2, inner_lr=0.5).inner_lr == 0.5


def test_anil_clone_adapts_the_head_and_equals_meta_loss():
    tasks = problem_tasks(2)

    def anil():
        torch.manual_seed(3)
        return ANIL(nn.Sequential(nn.Linear(1, 8), nn.Tanh()).double(), nn.Linear(8, 1).double(),
                    inner_lr=0.1, steps=2)

    a, b = anil(), anil()
    a.meta_loss(tasks, mse).backward()
    total = 0.0
    for t in tasks:
        learner = b.clone()
        assert sorted(learner.params) == ["bias", "weight"]  # the head's fast weights only
        for _ in range(2):
            learner.adapt(share(mse(learner(t.support.x), t.support.y), t.support))
        total = total + share(mse(learner(t.query.x), t.query.y), t.query)
    (total / len(tasks)).backward()
    for (k, ga), (_, gb) in zip(a.named_parameters(), b.named_parameters()):
        # The clone runs the body once per call, ANIL's meta_loss once per batch: the same
        # numbers, summed in a different order on the body's gradient (float64): a few ulps.
        torch.testing.assert_close(ga.grad, gb.grad, rtol=1e-12, atol=1e-14, msg=k)


def test_tied_weights_are_replaced_together_inside_a_meta_loss():
    # Inside a meta-loss the module's tree is walked at its first forward only; one whose
    # weights are tied keeps functional_call's tying, and a new meta-loss walks it again.
    from metaddp._functional import call, ties_weights, walked_once

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)).double()
    x = torch.randn(3, 2, dtype=torch.float64)
    w = torch.randn(2, 2, dtype=torch.float64)
    assert not ties_weights(net)
    with walked_once():
        untied = call(net, {"0.weight": w}, x)
    assert torch.equal(untied, x @ w.T @ net[1].weight.detach().T)
    net[1].weight = net[0].weight  # tied between two meta-losses
    assert ties_weights(net)
    with walked_once():
        tied = call(net, {"0.weight": w}, x)
        assert torch.equal(call(net, {"0.weight": w}, x), tied)  # the kept walk
    assert torch.equal(tied, x @ w.T @ w.T)
    assert torch.equal(call(net, {"0.weight": w}, x), tied)  # outside: torch's own search


@pytest.mark.parametrize("make", [MAML, Reptile, functools.partial(metaddp.Bilevel, start="outer")])
def test_setting_inner_lr_after_construction_takes_effect(make):
    # A schedule that sets algorithm.inner_lr must step at the new rate: the same loss and
    # gradient, to the bit, as an algorithm built with it (the same operations on the same values).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.randn(8, 2, dtype=torch.float64)
    task = metaddp.Task(metaddp.Batch(x[:4], x[:4, :1].sin(), 4), metaddp.Batch(x[4:], x[4:, :1].sin(), 4))

    def run(alg):
        loss = alg.meta_loss([task], lambda p, y: ((p - y) ** 2).mean(1))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in alg.parameters()]

    built = make(copy.deepcopy(net), inner_lr=0.2, steps=2)
    later = make(copy.deepcopy(net), inner_lr=0.1, steps=2)
    later.inner_lr = 0.2
    assert later.inner_lr == 0.2
    (l1, g1), (l2, g2) = run(built), run(later)
    assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


def test_inner_lr_that_nothing_reads_is_refused_when_set():
    net = nn.Linear(2, 1)
    own = MAML(net, optimizer=metaddp.inner.sgd(0.3))  # the optimizer holds its own rate
    with pytest.raises(AttributeError, match="its own rate"):
        own.inner_lr = 0.2
    for learned in (MAML(net, learn_lr="scalar"), metaddp.MAMLPlusPlus(net)):
        with pytest.raises(AttributeError, match="learns its inner rates"):
            learned.inner_lr = 0.2
    with pytest.raises(ValueError, match="inner_lr"):
        MAML(net).inner_lr = -1.0


@pytest.mark.parametrize("make", [
    lambda m, memory: Reptile(m, inner_lr=0.1, steps=3, memory=memory),
    lambda m, memory: IMAML(m, inner_lr=0.1, steps=3, lam=10.0, cg_steps=40, memory=memory),  # converged
    lambda m, memory: metaddp.ProtoNet(m, ways=2, memory=memory),
], ids=["reptile", "imaml", "protonet"])
def test_memory_modes_of_first_order_and_stepless_algorithms_run_the_default_loop(make):
    # These refused memory= (a TypeError) though their memory does not grow with the steps:
    # first-order steps free each graph, and ProtoNet takes none. Every mode is the default
    # loop: the same operations, so the same bits.
    tasks = problem_tasks(2)
    grads = {}
    for memory in ("default", "low", metaddp.Replay(k=2)):
        torch.manual_seed(0)
        alg = make(nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double(), memory)
        if isinstance(alg, metaddp.ProtoNet):
            tasks = [t._replace(support=t.support._replace(y=torch.arange(len(t.support.y)) % 2),
                                query=t.query._replace(y=torch.arange(len(t.query.y)) % 2))
                     for t in problem_tasks(2)]
            loss_fn = functools.partial(F.cross_entropy, reduction="none")
        else:
            loss_fn = mse
        alg.meta_loss([t for t in tasks], loss_fn).backward()
        grads[str(memory)] = [p.grad.clone() for p in alg.parameters()]
    first = grads.pop("default")
    for memory, got in grads.items():
        assert all(torch.equal(a, b) for a, b in zip(first, got, strict=True)), memory


@pytest.mark.parametrize("make, words", [
    (lambda: metaddp.ANIL(nn.Linear(1, 4), nn.Linear(4, 1), batched=True), "ANIL's (the body once per task"),
    (lambda: Reptile(fresh(), batched=True), "Reptile's displacement is a loss of its own"),
    (lambda: IMAML(fresh(), batched=True), "iMAML's (a proximal loop"),
    (lambda: metaddp.ProtoNet(fresh(), ways=2, batched=True), "class means, no inner step"),
    (lambda: metaddp.MAMLPlusPlus(fresh(), memory="low"), "multi-step loss scores the query at every"),
    (lambda: metaddp.ProtoMAML(fresh(), ways=2, memory="low"), "starts its head at the support's prototypes"),
])
def test_a_mode_a_class_lacks_is_refused_when_built_with_its_reason(make, words):
    # Before, these were Python's "unexpected keyword argument" (or a reason naming no limit).
    with pytest.raises(ValueError, match=re.escape(words)):
        make()


def test_batched_set_later_on_a_class_without_stacking_is_refused_not_ignored():
    anil = metaddp.ANIL(nn.Linear(1, 4), nn.Linear(4, 1))
    anil.batched = False  # tasks one by one: what it does anyway
    with pytest.raises(ValueError, match="has no stacked tasks"):
        anil.batched = True  # was an attribute nothing read: the loop ran, silently
    assert anil.batched is None


def test_memory_set_later_is_checked_as_at_construction():
    # Was an attribute: MAML++ and ProtoMAML ignored memory="low" set after building (their
    # constructors refuse it), and any typo was accepted by every class.
    for alg, words in ((metaddp.MAMLPlusPlus(fresh()), "multi-step loss scores the query"),
                       (metaddp.ProtoMAML(fresh(), ways=2), "starts its head at the support's prototypes")):
        with pytest.raises(ValueError, match=re.escape(words)):
            alg.memory = "low"
        with pytest.raises(ValueError, match=r"has no memory=Replay\(k=2"):
            alg.memory = metaddp.Replay(k=2)  # named as given
        assert alg.memory == "default"
    maml = MAML(fresh())
    with pytest.raises(ValueError, match="memory must be one of"):
        maml.memory = "lowest"
    maml.memory = "replay"
    assert maml.memory == metaddp.Replay()
    cg = metaddp.Bilevel(fresh(), start="current", train_inner=True, method=metaddp.bilevel.ImplicitCG())
    with pytest.raises(ValueError, match="ImplicitCG has none"):
        cg.memory = "low"  # was ignored: its hypergradient has no unrolled steps to rebuild


def test_bilevel_takes_batched_as_every_algorithm_does():
    assert metaddp.Bilevel(fresh(), batched=None).batched is None  # was an unexpected keyword
    with pytest.raises(ValueError, match="Bilevel's hypergradient .* is a loss of its own"):
        metaddp.Bilevel(fresh(), batched=True)
