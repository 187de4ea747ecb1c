"""Single-process float64 references for the bilevel scenarios, written without metaddp.

Plain autograd on whole batches with mean losses, the model and the weighting network as
hand-written functions of their weight lists, SGD and Adam written out, and for the implicit
methods the inner objective's Hessian built explicitly and solved by a textbook conjugate
gradient (or summed as a Neumann series) on that matrix. One thing comes from metaddp: which
samples a minibatch step takes, a definition (``metaddp.generator_for(seed, step)``), not a
computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metaddp import generator_for


def net(theta, x):
    w0, b0, w1, b1 = theta
    return torch.tanh(x @ w0.T + b0) @ w1.T + b1


def weights_of(omega, losses):
    v0, c0, v1, c1 = omega
    h = torch.tanh(losses.detach()[:, None] @ v0.T + c0)
    return torch.sigmoid(h @ v1.T + c1).squeeze(1)


class Problem:
    """One scenario's functions: inner and outer losses, the optimizer, the outer variables."""

    def __init__(self, theta, omega, log_decay, *, lr, optimizer, start, proximal, minibatch=None):
        self.theta, self.omega, self.log_decay = theta, omega, log_decay
        self.minibatch = minibatch
        self.lr, self.optimizer, self.start, self.proximal = lr, optimizer, start, proximal

    def outer_vars(self):
        own = list(self.omega) + [self.log_decay]
        return own + list(self.theta) if self.start == "outer" else own

    def inner(self, phi, xs, ys):
        ce = F.cross_entropy(net(phi, xs), ys, reduction="none")
        loss = (weights_of(self.omega, ce) * ce).mean()
        loss = loss + 0.5 * self.log_decay.exp() * sum((w * w).sum() for w in phi)
        if self.start == "outer":
            loss = loss + 0.5 * self.proximal * sum(((p - t) ** 2).sum() for p, t in zip(phi, self.theta))
        return loss

    def outer(self, phi, xq, yq):
        return F.cross_entropy(net(phi, xq), yq)

    def init(self, phi):
        return (0, [torch.zeros_like(p) for p in phi], [torch.zeros_like(p) for p in phi])

    def update(self, g, state):
        """The step (to add to the weights) and the next state."""
        if self.optimizer == "sgd":
            return [-self.lr * gi for gi in g], state
        if self.optimizer == "momentum":  # torch.optim.SGD's: b_1 = g_1, b_t = 0.9 b_(t-1) + g_t
            t, bs, vs = state
            bs = [gi if t == 0 else 0.9 * b + gi for b, gi in zip(bs, g)]
            return [-self.lr * b for b in bs], (t + 1, bs, vs)
        t, ms, vs = state
        t += 1
        b1, b2 = 0.9, 0.999
        ms = [b1 * m + (1 - b1) * gi for m, gi in zip(ms, g)]
        vs = [b2 * v + (1 - b2) * gi * gi for v, gi in zip(vs, g)]
        c1, c2 = 1 - b1**t, 1 - b2**t
        step = [-self.lr * (m / c1) / (torch.sqrt(v / c2 + 1e-16) + 1e-8) for m, v in zip(ms, vs)]
        return step, (t, ms, vs)


def _minibatch(pb, i, xs, ys):
    """Step i's samples: ``pb.minibatch`` = (size, seed) drawn from (seed, i) without
    replacement, as md.bilevel.Minibatches defines the sequence; all samples without it."""
    if pb.minibatch is None:
        return xs, ys
    size, seed = pb.minibatch
    rows = torch.randperm(len(ys), generator=generator_for(seed, i))[:size]
    return xs[rows], ys[rows]


def _steps(pb, phi, state, k, xs, ys, graph, first=0):
    for i in range(first, first + k):
        g = torch.autograd.grad(pb.inner(phi, *_minibatch(pb, i, xs, ys)), phi, create_graph=graph)
        step, state = pb.update(g, state)
        phi = [p + s for p, s in zip(phi, step)]
        if not graph:
            phi = [p.detach().requires_grad_() for p in phi]
            state = (state[0], [m.detach() for m in state[1]], [v.detach() for v in state[2]])
    return phi, state


def _start(pb):
    if pb.start == "outer":
        return list(pb.theta)
    return [t.detach().requires_grad_() for t in pb.theta]


def _flat_hessian(pb, phi, xs, ys):
    shapes = [p.shape for p in phi]
    sizes = [p.numel() for p in phi]
    flat = torch.cat([p.detach().reshape(-1) for p in phi])

    def f(v):
        parts = [c.reshape(s) for c, s in zip(torch.split(v, sizes), shapes)]
        return pb.inner(parts, xs, ys)

    return torch.autograd.functional.hessian(f, flat), sizes, shapes


def _cg(a, b, iterations, damping):
    a = a + damping * torch.eye(len(b), dtype=b.dtype)
    x, r = torch.zeros_like(b), b.clone()
    p, rr = r.clone(), r @ r
    for _ in range(iterations):
        ap = a @ p
        alpha = rr / (p @ ap)
        x, r = x + alpha * p, r - alpha * ap
        rr_new = r @ r
        p, rr = r + (rr_new / rr) * p, rr_new
    return x


def _neumann(a, b, iterations, alpha):
    term, total = b.clone(), b.clone()
    for _ in range(iterations):
        term = term - alpha * (a @ term)
        total = total + term
    return alpha * total


def task_loss(pb, task, method, steps, opts):
    """One problem's outer loss, whose gradient in the outer variables is the method's."""
    (xs, ys), (xq, yq) = task
    phi0 = _start(pb)
    if method == "unrolled":
        phi, _ = _steps(pb, phi0, pb.init(phi0), steps, xs, ys, True)
        return pb.outer(phi, xq, yq)
    if method == "truncated":
        last = opts["last"]
        phi, state = _steps(
            pb,
            [p.detach().requires_grad_() for p in phi0] if last < steps else phi0,
            pb.init(phi0),
            steps - last,
            xs,
            ys,
            False,
        )
        phi, _ = _steps(pb, phi, state, last, xs, ys, True, first=steps - last)
        return pb.outer(phi, xq, yq)
    phi_start = [p.detach().requires_grad_() for p in phi0]
    if method in ("implicit-cg", "neumann"):
        phi, _ = _steps(pb, phi_start, pb.init(phi_start), steps, xs, ys, False)
        q = pb.outer(phi, xq, yq)
        b = torch.cat([g.reshape(-1) for g in torch.autograd.grad(q, phi, retain_graph=True)])
        h, sizes, shapes = _flat_hessian(pb, phi, xs, ys)
        if method == "implicit-cg":
            v = _cg(h, b, opts["iterations"], opts["damping"])
        else:
            v = _neumann(h, b, opts["iterations"], opts["alpha"])
        vs = [c.reshape(s) for c, s in zip(torch.split(v, sizes), shapes)]
        g_in = torch.autograd.grad(pb.inner(phi, xs, ys), phi, create_graph=True)
        mixed = -sum((g * w).sum() for g, w in zip(g_in, vs))
        return q + (mixed - mixed.detach())
    # t1t2 / sama: central differences of the last step's Jacobian.
    phi, state = _steps(pb, phi_start, pb.init(phi_start), steps - 1, xs, ys, False)
    g = [t.detach().requires_grad_() for t in torch.autograd.grad(pb.inner(phi, xs, ys), phi)]
    step, _ = pb.update(g, state)
    after = [(p + s).detach().requires_grad_() for p, s in zip(phi, step)]
    q = pb.outer(after, xq, yq)
    v = torch.autograd.grad(q, after, retain_graph=True)
    p_dir = torch.autograd.grad(step, g, grad_outputs=v)
    point = after if method == "sama" else phi
    e = opts["r"] / torch.sqrt(sum((d * d).sum() for d in p_dir))
    plus = [(w + e * d).detach() for w, d in zip(point, p_dir)]
    minus = [(w - e * d).detach() for w, d in zip(point, p_dir)]
    mixed = (pb.inner(plus, xs, ys) - pb.inner(minus, xs, ys)) / (2 * e)
    return q + (mixed - mixed.detach())


def hypergradient(pb, tasks, method, steps, opts):
    """The meta-loss (mean over problems) and its gradient in the outer variables."""
    loss = sum(task_loss(pb, t, method, steps, opts) for t in tasks) / len(tasks)
    return float(loss.detach()), torch.autograd.grad(loss, pb.outer_vars())
