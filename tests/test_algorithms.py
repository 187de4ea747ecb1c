"""Every algorithm's meta-gradient at world sizes 1, 2 and 4 against a float64 single process.

The references below are written independently of metaddp: a hand-written MLP (or, for the
BatchNorm model, ``torch.func.functional_call`` with PyTorch's own BatchNorm on the whole
batch), plain autograd loops, and for iMAML an explicit Hessian and a direct linear solve.
Layouts: sample-parallel (13 support / 11 query samples split unevenly over 2 and 4 ranks),
task-parallel (5 tasks over 2 and 4 ranks: uneven, some ranks hold one task) and hybrid.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metaddp.distributed.launch import run_local
from metaddp.testing import scenarios as S

# Float64 throughout. Between world sizes only the order of floating-point sums changes
# (partial sums per rank), which moves results by a few ulps per operation: observed <1e-15
# relative. Against the references the arithmetic differs too (hand-written layers, a direct
# solve instead of CG for iMAML with CG stopped at 1e-13 relative residual): observed <1e-12.
# 1e-10 leaves margin, while a missing reduction or a wrong weighting is an error of 1e-3 or more.
RTOL = 1e-10

STEPS = 2
ALGOS = ("maml", "fomaml", "metasgd", "anil", "reptile", "imaml")


def problems() -> list[S.Problem]:
    out = [S.Problem(algorithm=a, layout=l, steps=STEPS) for a in ALGOS for l in S.LAYOUTS]
    out += [S.Problem(model="conv", batchnorm=True, layout=l, steps=STEPS, n_tasks=3, inner_lr=0.3)
            for l in S.LAYOUTS]
    return out


def _worker(probs: list[S.Problem]) -> list[dict]:
    return [S.run(p) for p in probs] + [learner_run(LEARNER_PROBLEM)]


LEARNER_PROBLEM = S.Problem(algorithm="maml", layout="hybrid", steps=STEPS)


def learner_run(p: S.Problem) -> dict:
    """MAML written learn2learn-style with clone()/adapt(), on this rank's shards."""
    import metaddp

    alg = metaddp.MetaDDP(metaddp.MAML(p.build_model(), inner_lr=p.inner_lr), S.mesh_for(p.layout))
    batch = alg.shard(p.n_tasks, p.task)
    for t in batch:
        learner = alg.clone()  # reduces over the sample axis without being told
        for _ in range(p.steps):
            learner.adapt(metaddp.share(p.loss_fn(learner(t.support.x), t.support.y), t.support))
        loss = metaddp.share(p.loss_fn(learner(t.query.x), t.query.y), t.query)
        (loss / batch.n).backward()
    alg.sync_grads()
    return {"grads": S.meta_gradient(alg.module)}


@pytest.fixture(scope="module")
def results() -> dict[int, list[list[dict]]]:
    probs = problems()
    # World size 1 runs in this process (every collective is the identity); 2 and 4 spawn
    # one process group each that runs every problem.
    return {1: [_worker(probs)], 2: run_local(_worker, 2, probs), 4: run_local(_worker, 4, probs)}


# ---------------------------------------------------------------- independent references


def mlp(theta: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w0, b0, w1, b1, w2, b2 = theta
    h = torch.tanh(x @ w0.T + b0)
    h = torch.tanh(h @ w1.T + b1)
    return h @ w2.T + b2


def mse(theta, x, y) -> torch.Tensor:
    return ((mlp(theta, x) - y) ** 2).mean()


def reference(p: S.Problem) -> dict[str, torch.Tensor]:
    """The meta-gradient one float64 process computes, by name of the algorithm's parameters."""
    net = p.build_model()
    names = [k for k, _ in net.named_parameters()]
    theta = [t.detach().clone().requires_grad_() for t in net.parameters()]
    tasks = p.tasks()
    a = p.algorithm
    if a in ("maml", "fomaml", "metasgd"):
        alphas = [torch.full_like(t, p.inner_lr).requires_grad_() for t in theta]
        total = 0.0
        for t in tasks:
            fast = theta
            for _ in range(p.steps):
                g = torch.autograd.grad(mse(fast, t.support.x, t.support.y), fast,
                                        create_graph=(a != "fomaml"))
                lrs = alphas if a == "metasgd" else [p.inner_lr] * len(fast)
                fast = [f - lr * gi for f, lr, gi in zip(fast, lrs, g)]
            total = total + mse(fast, t.query.x, t.query.y)
        leaves = theta + alphas if a == "metasgd" else theta
        grads = torch.autograd.grad(total / p.n_tasks, leaves)
        out = dict(zip(names, grads[: len(theta)]))
        if a == "metasgd":
            out.update({f"lr.rates.{i}": g for i, g in enumerate(grads[len(theta):])})
        return out
    if a == "anil":
        body, head = theta[:4], theta[4:]
        total = 0.0
        for t in tasks:
            def feats(x):
                return torch.tanh(torch.tanh(x @ body[0].T + body[1]) @ body[2].T + body[3])
            fs, fq = feats(t.support.x), feats(t.query.x)
            fast = head
            for _ in range(p.steps):
                loss = ((fs @ fast[0].T + fast[1] - t.support.y) ** 2).mean()
                g = torch.autograd.grad(loss, fast, create_graph=True)
                fast = [f - p.inner_lr * gi for f, gi in zip(fast, g)]
            total = total + ((fq @ fast[0].T + fast[1] - t.query.y) ** 2).mean()
        grads = torch.autograd.grad(total / p.n_tasks, theta)
        # ANIL's body is net[:-1] (keys kept: 0, 2), its head net[-1].
        out = {f"body.{n}": g for n, g in zip(names[:4], grads[:4])}
        out.update({f"head.{n.split('.', 1)[1]}": g for n, g in zip(names[4:], grads[4:])})
        return out
    if a == "reptile":
        acc = [torch.zeros_like(t) for t in theta]
        for t in tasks:
            phi = [x.detach().clone().requires_grad_() for x in theta]
            for _ in range(p.steps):
                g = torch.autograd.grad(mse(phi, t.support.x, t.support.y), phi)
                phi = [(f - p.inner_lr * gi).detach().requires_grad_() for f, gi in zip(phi, g)]
            acc = [s + (th.detach() - f.detach()) / p.n_tasks for s, th, f in zip(acc, theta, phi)]
        return dict(zip(names, acc))
    if a == "imaml":
        shapes = [t.shape for t in theta]
        sizes = [t.numel() for t in theta]
        th = torch.cat([t.detach().flatten() for t in theta])

        def unflat(v):
            return [c.view(s) for c, s in zip(torch.split(v, sizes), shapes)]

        acc = torch.zeros_like(th)
        for t in tasks:
            phi = th.clone()
            for _ in range(p.steps):
                phi_ = phi.clone().requires_grad_()
                (g,) = torch.autograd.grad(mse(unflat(phi_), t.support.x, t.support.y), phi_)
                phi = phi - p.inner_lr * (g + p.lam * (phi - th))
            hess = torch.autograd.functional.hessian(
                lambda v, t=t: mse(unflat(v), t.support.x, t.support.y), phi)
            phi_ = phi.clone().requires_grad_()
            (gq,) = torch.autograd.grad(mse(unflat(phi_), t.query.x, t.query.y), phi_)
            acc += torch.linalg.solve(torch.eye(len(th), dtype=th.dtype) + hess / p.lam, gq)
        return dict(zip(names, unflat(acc / p.n_tasks)))
    raise AssertionError(a)



def unrolled_maml(p: S.Problem, theta, loss) -> tuple[torch.Tensor, ...]:
    """Second-order MAML meta-gradient w.r.t. ``theta`` with ``loss(params, batch)``."""
    total = 0.0
    for t in p.tasks():
        fast = theta
        for _ in range(p.steps):
            g = torch.autograd.grad(loss(fast, t.support), fast, create_graph=True)
            fast = [f - p.inner_lr * gi for f, gi in zip(fast, g)]
        total = total + loss(fast, t.query)
    return torch.autograd.grad(total / p.n_tasks, theta)

def reference_bn(p: S.Problem) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """MAML on the BatchNorm conv model, PyTorch's BatchNorm on each whole batch."""
    net = p.build_model().train()
    names = [k for k, _ in net.named_parameters()]
    theta = [t.detach().clone().requires_grad_() for t in net.parameters()]

    def loss(params, b):
        out = torch.func.functional_call(net, dict(zip(names, params)), (b.x,))
        return F.cross_entropy(out, b.y)

    grads = unrolled_maml(p, theta, loss)
    bufs = {k: b.detach().clone() for k, b in net.named_buffers()}
    return dict(zip(names, grads)), bufs


def flat(d: dict[str, torch.Tensor], keys) -> torch.Tensor:
    return torch.cat([d[k].flatten() for k in keys])


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("index", range(len(problems())),
                         ids=[f"{p.algorithm}{'-bn' if p.batchnorm else ''}-{p.layout}" for p in problems()])
def test_meta_gradient_matches_single_process(results, index):
    p = problems()[index]
    if p.batchnorm:
        ref, ref_bufs = reference_bn(p)
    else:
        ref, ref_bufs = reference(p), None
    keys = sorted(ref)
    want = flat(ref, keys)
    scale = float(want.abs().max())
    assert scale > 1e-3  # a meaningful gradient, not an all-zero comparison
    for world, per_rank in results.items():
        for rank, everything in enumerate(per_rank):
            r = everything[index]
            assert sorted(r["grads"]) == keys
            got = flat(r["grads"], keys)
            err = float((got - want).abs().max()) / scale
            assert err < RTOL, f"{p.algorithm}/{p.layout} world {world} rank {rank}: rel err {err:.3g}"
            if ref_bufs is not None and p.layout == "sample":
                # Running statistics come from global batch statistics: the same on every
                # rank and equal to one process's (same tolerance, same reasons).
                for k, b in ref_bufs.items():
                    d = float((r["buffers"][k].double() - b.double()).abs().max())
                    assert d < RTOL * max(1.0, float(b.abs().max())), f"{k} world {world} rank {rank}: {d:.3g}"


def test_unsynchronized_batchnorm_would_differ():
    """The BatchNorm check can fail: per-shard statistics give a different gradient."""
    p = S.Problem(model="conv", batchnorm=True, layout="sample", steps=STEPS, n_tasks=3, inner_lr=0.3)
    ref, _ = reference_bn(p)
    half = half_batch_statistics(p)
    keys = sorted(ref)
    err = float((flat(half, keys) - flat(ref, keys)).abs().max() / flat(ref, keys).abs().max())
    assert err > 1e-3


def half_batch_statistics(p: S.Problem) -> dict[str, torch.Tensor]:
    """MAML where BatchNorm sees only half of each batch at a time (as an unsynced rank would)."""
    net = p.build_model().train()
    names = [k for k, _ in net.named_parameters()]
    theta = [t.detach().clone().requires_grad_() for t in net.parameters()]

    def loss(params, b):
        m = b.x.shape[0] // 2
        parts = [torch.func.functional_call(net, dict(zip(names, params)), (x,))
                 for x in (b.x[:m], b.x[m:])]
        return F.cross_entropy(torch.cat(parts), b.y)

    return dict(zip(names, unrolled_maml(p, theta, loss)))


def test_clone_adapt_on_many_ranks_matches_single_process(results):
    ref = reference(LEARNER_PROBLEM)
    keys = sorted(ref)
    want = flat(ref, keys)
    for world, per_rank in results.items():
        for rank, everything in enumerate(per_rank):
            got = flat(everything[-1]["grads"], keys)
            err = float((got - want).abs().max() / want.abs().max())
            assert err < RTOL, f"world {world} rank {rank}: rel err {err:.3g}"  # RTOL: see top
