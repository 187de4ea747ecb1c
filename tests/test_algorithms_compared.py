"""The algorithms researchers compare against (BOIL, prototypical networks, ProtoMAML, MAML++)
CAVIA and the inner optimizers beyond SGD and Adam, at world sizes 1 to 3 in every layout and
at 4 in the hybrid one (the shared process groups of tests/conftest.py; the problems are
tests/compared_workers.py's, run where its ``runs_at`` says) against float64 single-process
references written here with plain autograd.

The references share nothing with metaddp: a hand-written MLP, PyTorch's own layers through
``torch.func.functional_call`` for the convolutional model, class means by boolean masks,
and the optimizers' formulas as ``torch.optim`` documents them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import metaddp as md
from compared_workers import USER_PROBLEM, name, problems, runs_at, worlds_of
from metaddp.algorithms._mamlpp import step_weights
from metaddp.testing import scenarios as S

# Float64. Between world sizes only the order of floating-point sums changes; against the
# references the arithmetic is grouped differently too. Observed: < 1e-13 relative, except
# the adaptive optimizers on split samples (up to 1e-11): their step g / sqrt(v) amplifies
# a gradient entry's rounding by 1 / |g| where |g| is small. 1e-9 leaves margin; a missing
# reduction, a rank's own prototypes or a wrong step weight is off by 1e-3 or more.
RTOL = 1e-9
EPS_ROOT = 1e-16  # metaddp's default inside the square roots (metaddp.adam's docstring)


@pytest.fixture(scope="module")
def results(worlds) -> dict[int, list[list[dict]]]:
    # Run in the shared process groups of tests/conftest.py (world sizes 1 to 4).
    return {w: [rank["compared"] for rank in worlds[w]] for w in (1, 2, 3, 4)}


# ---------------------------------------------------------------- independent references


def mlp(theta, x):
    w0, b0, w1, b1, w2, b2 = theta
    return torch.tanh(torch.tanh(x @ w0.T + b0) @ w1.T + b1) @ w2.T + b2


def mse(theta, x, y):
    return ((mlp(theta, x) - y) ** 2).mean()


def sgd_steps(loss, fast, support, steps, lr, create_graph=True):
    for _ in range(steps):
        g = torch.autograd.grad(loss(fast, support), fast, create_graph=create_graph)
        fast = [f - lr * gi for f, gi in zip(fast, g)]
    return fast


def optimizer_step(p: S.Problem):
    """One step of ``p.optimizer`` as ``torch.optim`` defines it, out of place."""
    lr = p.inner_lr

    def clip(g):
        if p.clip is None:
            return g
        norm = torch.sqrt(sum((gi**2).sum() for gi in g))
        return [gi * torch.clamp(p.clip / (norm + 1e-6), max=1.0) for gi in g]

    def step(t, f, g, s):  # t: 1-based step; s: per-tensor state lists
        g = clip(g)
        if p.optimizer == "adamw":  # betas 0.9, 0.999, eps 1e-8, weight decay 0.01 decoupled
            m = [0.9 * a + 0.1 * gi for a, gi in zip(s[0], g)]
            v = [0.999 * a + 0.001 * gi * gi for a, gi in zip(s[1], g)]
            new = [fi - lr * ((mi / (1 - 0.9**t)) / (torch.sqrt(vi / (1 - 0.999**t) + EPS_ROOT)
                                                    + 1e-8) + 0.01 * fi)
                   for fi, mi, vi in zip(f, m, v)]
            return new, [m, v]
        if p.optimizer == "rmsprop":  # alpha 0.99, eps 1e-8
            sq = [0.99 * a + 0.01 * gi * gi for a, gi in zip(s[0], g)]
            return [fi - lr * gi / (torch.sqrt(si + EPS_ROOT) + 1e-8)
                    for fi, gi, si in zip(f, g, sq)], [sq, s[1]]
        if p.optimizer == "adagrad":  # eps 1e-10, accumulator from 0
            acc = [a + gi * gi for a, gi in zip(s[0], g)]
            return [fi - lr * gi / (torch.sqrt(ai + EPS_ROOT) + 1e-10)
                    for fi, gi, ai in zip(f, g, acc)], [acc, s[1]]
        raise AssertionError(p.optimizer)

    return step


def msl_weights(k: int, epoch: int, msl_epochs: int) -> list[float]:
    """MAML++'s per-step loss importance, as in its authors' code (epochs here: meta-steps)."""
    if epoch >= msl_epochs:
        return [0.0] * (k - 1) + [1.0]
    w = [1.0 / k] * k
    decay, floor = 1.0 / k / msl_epochs, 0.03 / k
    for i in range(k - 1):
        w[i] = max(w[i] - epoch * decay, floor)
    w[-1] = min(w[-1] + epoch * (k - 1) * decay, 1.0 - (k - 1) * floor)
    return w


def reference(p: S.Problem) -> dict[str, torch.Tensor]:
    """The meta-gradient one float64 process computes, by the algorithm's parameter names."""
    net = p.build_model()
    names = [k for k, _ in net.named_parameters()]
    theta = [t.detach().clone().requires_grad_() for t in net.parameters()]
    tasks = p.tasks()
    if p.model == "conv":
        body = net.split_head()[0]
        bnames = [k for k, _ in body.named_parameters()]
        nb = len(bnames)

        def emb(params, x):
            return functional_call(body, dict(zip(bnames, params)), (x,))

        def protos(params, b):
            f = emb(params, b.x)
            return torch.stack([f[b.y == k].mean(0) for k in range(3)])

        total = 0.0
        if p.algorithm == "protonet":
            for t in tasks:
                c = protos(theta[:nb], t.support)
                logits = -((emb(theta[:nb], t.query.x)[:, None] - c[None]) ** 2).sum(-1)
                total = total + F.cross_entropy(logits, t.query.y)
            grads = torch.autograd.grad(total / p.n_tasks, theta[:nb])
            return dict(zip(bnames, grads))
        if p.algorithm == "protomaml":
            def loss(params, b):
                return F.cross_entropy(F.linear(emb(params[:nb], b.x), *params[nb:]), b.y)

            for t in tasks:
                c = protos(theta[:nb], t.support)
                fast = sgd_steps(loss, theta[:nb] + [2 * c, -(c * c).sum(1)], t.support,
                                 p.steps, p.inner_lr)
                total = total + loss(fast, t.query)
            grads = torch.autograd.grad(total / p.n_tasks, theta[:nb])
            return {f"body.{k}": g for k, g in zip(bnames, grads)}
        if p.algorithm == "mamlpp":  # per-step BatchNorm weights and running statistics
            return reference_mamlpp_bn(p)[0]
        if p.algorithm == "maml":  # BatchNorm with running statistics, tasks one by one
            return reference_maml_bn(p)[0]
        if p.algorithm == "boil":  # the head (last two tensors) held in the inner loop
            def loss(params, b):
                return F.cross_entropy(functional_call(net, dict(zip(names, params)), (b.x,)), b.y)

            for t in tasks:
                fast = theta[:-2]
                for _ in range(p.steps):
                    g = torch.autograd.grad(loss(fast + theta[-2:], t.support), fast,
                                            create_graph=True)
                    fast = [f - p.inner_lr * gi for f, gi in zip(fast, g)]
                total = total + loss(fast + theta[-2:], t.query)
            grads = torch.autograd.grad(total / p.n_tasks, theta)
            return {**{f"body.{k}": g for k, g in zip(names[:-2], grads[:-2])},
                    "head.weight": grads[-2], "head.bias": grads[-1]}
        raise AssertionError(p.algorithm)
    total = 0.0
    if p.algorithm == "boil":  # the MLP's body: its first four tensors
        for t in tasks:
            fast = theta[:4]
            for _ in range(p.steps):
                g = torch.autograd.grad(mse(fast + theta[4:], t.support.x, t.support.y), fast,
                                        create_graph=True)
                fast = [f - p.inner_lr * gi for f, gi in zip(fast, g)]
            total = total + mse(fast + theta[4:], t.query.x, t.query.y)
        grads = torch.autograd.grad(total / p.n_tasks, theta)
        return {**{f"body.{k}": g for k, g in zip(names[:4], grads[:4])},
                "head.weight": grads[4], "head.bias": grads[5]}
    if p.algorithm == "cavia":  # the context, from zero, is all that adapts
        def ctx(th, c, x):
            h = torch.cat([x, c.expand(x.shape[0], -1)], dim=1)
            return mlp(th, h)

        for t in tasks:
            c = torch.zeros(2, dtype=p.dtype, requires_grad=True)
            for _ in range(p.steps):
                ls = ((ctx(theta, c, t.support.x) - t.support.y) ** 2).mean()
                (g,) = torch.autograd.grad(ls, c, create_graph=True)
                c = c - p.inner_lr * g
            total = total + ((ctx(theta, c, t.query.x) - t.query.y) ** 2).mean()
        grads = torch.autograd.grad(total / p.n_tasks, theta)
        return {f"model.{k}": g for k, g in zip(names, grads)}  # CAVIA wraps the network
    if p.algorithm == "mamlpp":
        rates = [torch.full((p.steps,), p.inner_lr, dtype=p.dtype, requires_grad=True)
                 for _ in theta]
        assert p.schedule_steps is not None
        w = msl_weights(p.steps, p.meta_step, p.schedule_steps // 15)
        second = p.meta_step >= p.schedule_steps // 3
        for t in tasks:
            fast = theta
            for i in range(p.steps):
                g = torch.autograd.grad(mse(fast, t.support.x, t.support.y), fast,
                                        create_graph=second)
                fast = [f - r[i] * gi for f, r, gi in zip(fast, rates, g)]
                total = total + w[i] * mse(fast, t.query.x, t.query.y)
        grads = torch.autograd.grad(total / p.n_tasks, theta + rates)
        out = dict(zip(names, grads[: len(theta)]))
        out.update({f"lslr.{i}": g for i, g in enumerate(grads[len(theta):])})
        return out
    assert p.algorithm == "maml"
    step = optimizer_step(p)
    for t in tasks:
        fast = theta
        state = [[torch.zeros_like(x) for x in theta], [torch.zeros_like(x) for x in theta]]
        for i in range(p.steps):
            g = torch.autograd.grad(mse(fast, t.support.x, t.support.y), fast, create_graph=True)
            fast, state = step(i + 1, fast, list(g), state)
        total = total + mse(fast, t.query.x, t.query.y)
    return dict(zip(names, torch.autograd.grad(total / p.n_tasks, theta)))


def reference_mamlpp_bn(p: S.Problem) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """MAML++ on the BatchNorm conv model: row i of every per-step tensor at inner step i,
    PyTorch's BatchNorm on each whole batch updating row i of the running statistics."""
    net = p.build_model().train()
    own = dict(net.named_parameters())
    norms = [n for n, m in net.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    bn_keys = [f"{n}.{k}" for n in norms for k in ("weight", "bias")]
    adapted = [k for k in own if k not in bn_keys]
    theta = [own[k].detach().clone().requires_grad_() for k in adapted]
    rows = [own[k].detach().unsqueeze(0).repeat(p.steps, 1).requires_grad_() for k in bn_keys]
    rates = [torch.full((p.steps,), p.inner_lr, dtype=p.dtype, requires_grad=True) for _ in theta]
    stats = {f"{n}.{k}": getattr(net, n).__getattr__(k).detach().unsqueeze(0).repeat(p.steps, 1)
             for n in norms for k in ("running_mean", "running_var")}
    assert p.schedule_steps is not None
    w = msl_weights(p.steps, p.meta_step, p.schedule_steps // 15)
    second = p.meta_step >= p.schedule_steps // 3

    def loss(fast, i, b):
        weights = {**dict(zip(adapted, fast)), **{k: r[i] for k, r in zip(bn_keys, rows)},
                   **{k: v[i] for k, v in stats.items()}}
        return F.cross_entropy(functional_call(net, weights, (b.x,)), b.y)

    total = 0.0
    for t in p.tasks():
        fast = theta
        for i in range(p.steps):
            g = torch.autograd.grad(loss(fast, i, t.support), fast, create_graph=second)
            fast = [f - r[i] * gi for f, r, gi in zip(fast, rates, g)]
            total = total + w[i] * loss(fast, i, t.query)
    grads = torch.autograd.grad(total / p.n_tasks, theta + rows + rates)
    out = dict(zip(adapted, grads[: len(theta)]))
    out.update({f"bn_steps.{j}": g for j, g in enumerate(grads[len(theta): len(theta) + len(rows)])})
    out.update({f"lslr.{j}": g for j, g in enumerate(grads[len(theta) + len(rows):])})
    names = {f"{n}.running_mean": f"step_mean_{j}" for j, n in enumerate(norms)}
    names.update({f"{n}.running_var": f"step_var_{j}" for j, n in enumerate(norms)})
    return out, {names[k]: v for k, v in stats.items()}


def reference_maml_bn(p: S.Problem) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """MAML on the BatchNorm conv model, PyTorch's layer on each whole batch, task after task,
    moving its running statistics at every forward."""
    net = p.build_model().train()
    names = [k for k, _ in net.named_parameters()]
    theta = [t.detach().clone().requires_grad_() for t in net.parameters()]

    def loss(params, b):
        return F.cross_entropy(functional_call(net, dict(zip(names, params)), (b.x,)), b.y)

    total = 0.0
    for t in p.tasks():
        fast = sgd_steps(loss, theta, t.support, p.steps, p.inner_lr)
        total = total + loss(fast, t.query)
    grads = torch.autograd.grad(total / p.n_tasks, theta)
    return dict(zip(names, grads)), {k: b.detach().clone() for k, b in net.named_buffers()}


def test_stacked_running_statistics_move_as_the_loop_moves_them(results):
    # Sample layout: every rank runs every task, so every rank holds the one-process values.
    index = next(i for i, p in enumerate(problems()) if p.batched and p.layout == "sample")
    _, want = reference_maml_bn(problems()[index])
    for world, per_rank in results.items():
        for rank, everything in enumerate(per_rank):
            if not runs_at(problems()[index], world):
                continue
            got = everything[index]["buffers"]
            assert sorted(got) == sorted(want)
            for k, v in want.items():
                d = float((got[k].double() - v.double()).abs().max())
                # same tolerance; counts are integers and must be equal
                assert d < RTOL * max(1.0, float(v.double().abs().max())), (
                    f"{k} world {world} rank {rank}: {d:.3g}")


def test_mamlpp_per_step_running_statistics_match_one_process(results):
    # Sample layout: every rank runs every task on its part of the samples, so every rank
    # holds every row of the statistics, updated from the global batch statistics.
    index = next(i for i, p in enumerate(problems())
                 if p.algorithm == "mamlpp" and p.batchnorm and p.layout == "sample")
    _, want = reference_mamlpp_bn(problems()[index])
    for world, per_rank in results.items():
        for rank, everything in enumerate(per_rank):
            if not runs_at(problems()[index], world):
                continue
            got = everything[index]["own_buffers"]
            assert sorted(got) == sorted(want)
            for k, v in want.items():
                d = float((got[k] - v).abs().max())
                assert d < RTOL * max(1.0, float(v.abs().max())), f"{k} world {world} rank {rank}: {d:.3g}"
            # rows of steps taken moved; they are not all the start's (1 for the variance)
            assert not torch.equal(got["step_var_0"], torch.ones_like(got["step_var_0"]))


def flat(d, keys):
    return torch.cat([d[k].flatten() for k in keys])


# The transformer problems have their own reference (tests/test_transformer.py).
COMPARED = [i for i, p in enumerate(problems()) if p.model != "transformer"]


@pytest.mark.parametrize("index", COMPARED, ids=[name(problems()[i]) for i in COMPARED])
def test_meta_gradient_matches_single_process(results, index):
    p = problems()[index]
    ref = reference(p)
    keys = sorted(ref)
    want = flat(ref, keys)
    scale = float(want.abs().max())
    assert scale > 1e-3  # a meaningful gradient, not an all-zero comparison
    for world in worlds_of(p, results):
        for rank, everything in enumerate(results[world]):
            r = everything[index]
            assert sorted(r["grads"]) == keys
            err = float((flat(r["grads"], keys) - want).abs().max()) / scale
            assert err < RTOL, f"{name(p)} world {world} rank {rank}: rel err {err:.3g}"


def test_prototypes_by_hand_match_one_process(results):
    want = reference(USER_PROBLEM)
    keys = sorted(want)
    first = results[1][0][-1]["prototypes"]
    for world, per_rank in results.items():
        for rank, everything in enumerate(per_rank):
            r = everything[-1]
            err = float((flat(r["grads"], keys) - flat(want, keys)).abs().max()
                        / flat(want, keys).abs().max())
            assert err < RTOL, f"world {world} rank {rank}: rel err {err:.3g}"
            # Every rank's prototypes are the one-process ones (same tolerance).
            assert float((r["prototypes"] - first).abs().max()) < RTOL * float(first.abs().max())


def test_a_ranks_own_prototypes_would_differ():
    """The prototype check can fail: class means of half the support set (what one of two
    ranks holds) give another meta-gradient."""
    p = S.Problem(algorithm="protonet", model="conv", n_tasks=3)
    body = p.build_model().split_head()[0]
    bnames = [k for k, _ in body.named_parameters()]
    theta = [t.detach().clone().requires_grad_() for t in body.parameters()]

    def meta(half: bool):
        total = 0.0
        for t in p.tasks():
            xs, ys = (t.support.x[::2], t.support.y[::2]) if half else (t.support.x, t.support.y)
            f = functional_call(body, dict(zip(bnames, theta)), (xs,))
            c = torch.stack([f[ys == k].mean(0) for k in range(3)])
            q = functional_call(body, dict(zip(bnames, theta)), (t.query.x,))
            total = total + F.cross_entropy(-((q[:, None] - c[None]) ** 2).sum(-1), t.query.y)
        return torch.cat([g.flatten() for g in torch.autograd.grad(total, theta)])

    whole, half = meta(False), meta(True)
    assert float((half - whole).abs().max() / whole.abs().max()) > 1e-3


# ---------------------------------------------------------------- schedules and bad input


def test_msl_weights_anneal_to_the_last_step():
    # Equal at the start, the paper code's values on the way, the last step alone after.
    assert step_weights(5, 0, 10) == pytest.approx([0.2] * 5)
    assert step_weights(5, 4, 10) == pytest.approx(msl_weights(5, 4, 10))
    # At 9 of 10: each non-final 0.2 - 9 * 0.02, the last 0.2 + 9 * 4 * 0.02.
    assert step_weights(5, 9, 10) == pytest.approx([0.02] * 4 + [0.92])
    assert sum(step_weights(5, 7, 10)) == pytest.approx(1.0)
    assert step_weights(5, 10, 10) == [0.0] * 4 + [1.0]
    assert step_weights(3, 0, 0) == [0.0, 0.0, 1.0]  # msl_steps 0: no multi-step loss


def test_mamlpp_schedule_is_the_meta_step_it_is_told():
    alg = md.MAMLPlusPlus(torch.nn.Linear(2, 1), steps=3, msl_steps=4, first_order_steps=2)
    b = md.Batch(torch.randn(4, 2), torch.randn(4, 1), 4)
    mse = lambda p, y: F.mse_loss(p, y, reduction="none")  # noqa: E731
    with pytest.raises(RuntimeError, match="never told: call learner.module.at_step"):
        alg.meta_loss([md.Task(b, b)], mse)
    alg.at_step(0)
    assert torch.isfinite(alg.meta_loss([md.Task(b, b)], mse))
    assert not alg.second_order_now() and alg.weights_now() == pytest.approx([1 / 3] * 3)
    alg.at_step(2)
    assert alg.second_order_now()
    before = alg.signature()
    alg.at_step(3)
    assert alg.signature() != before  # ranks told different steps fail at the gradient SUM
    with pytest.raises(ValueError, match="meta-step"):
        alg.at_step(-1)
    with pytest.raises(ValueError, match="msl_steps"):
        md.MAMLPlusPlus(torch.nn.Linear(2, 1), msl_steps=-1)


def test_class_means_refuse_a_missing_class_and_stray_labels():
    x = torch.randn(4, 3, dtype=torch.float64)
    means, counts = md.class_means(x, torch.tensor([0, 1, 1, 2]), 3)
    torch.testing.assert_close(means[1], x[1:3].mean(0))  # one float64 mean: ulps
    assert counts.tolist() == [1.0, 2.0, 1.0]
    with pytest.raises(ValueError, match=r"classes \[2\] have no sample"):
        md.class_means(x, torch.tensor([0, 1, 1, 0]), 3)
    with pytest.raises(ValueError, match="1 labels are outside 0 .. 2"):
        md.class_means(x, torch.tensor([0, 1, 2, 3]), 3)
    with pytest.raises(TypeError, match="integer classes"):
        md.class_means(x, torch.zeros(4), 3)


def test_prototype_algorithms_say_what_they_need():
    net = torch.nn.Linear(3, 4)
    proto = md.ProtoNet(net, ways=2)
    with pytest.raises(TypeError, match="prototypes"):
        proto(torch.randn(2, 3))
    with pytest.raises(TypeError, match="no inner steps"):
        proto.clone()
    with pytest.raises(ValueError, match="ways"):
        md.ProtoNet(net, ways=0)
    with pytest.raises(ValueError, match="ways"):
        md.ProtoMAML(net, ways=1.5)  # type: ignore[arg-type]
    b = md.Batch(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), 4)
    fast = md.ProtoMAML(net, ways=2, steps=1).adapt(b, lambda p, y: F.cross_entropy(p, y, reduction="none"))
    assert fast["weight"].shape == (2, 4) and fast["bias"].shape == (2,)


def test_per_step_rates_refuse_bad_input():
    with pytest.raises(ValueError, match="per-step rates"):
        md.inner.per_step_sgd({"w": torch.tensor(0.1)})
    with pytest.raises(ValueError, match="same number"):
        md.inner.per_step_sgd({"w": torch.ones(2), "b": torch.ones(3)})
    with pytest.raises(KeyError, match="no rates for 'b'"):
        md.inner.per_step_sgd({"w": torch.ones(2)}).init({"b": torch.zeros(1)})
