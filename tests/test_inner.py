"""Inner optimizers: first-order trajectories against torch.optim, second order against
finite differences, and the errors bad input gets."""

from __future__ import annotations

import pytest
import torch

import metaddp
from metaddp import (
    Batch,
    LearnedLR,
    adagrad,
    adam,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    inner_loop,
    rmsprop,
    sgd,
)

D = torch.float64  # every tensor here is float64, given explicitly (no global default)


def objective(p: dict[str, torch.Tensor]) -> torch.Tensor:
    """A smooth non-quadratic function of two tensors (so Hessians vary along the path)."""
    w, b = p["w"], p["b"]
    return (torch.sin(w).sum() * 0.5 + (w**2).sum() * 0.3 + (torch.tanh(b) * w[0]).sum()
            + (b**4).sum() * 0.1)


def start() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 2, generator=g, dtype=D), "b": torch.randn(2, generator=g, dtype=D)}


OPTIMIZERS = [
    ("sgd", lambda: sgd(0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    ("momentum", lambda: sgd(0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    ("dampened", lambda: sgd(0.1, momentum=0.5, dampening=0.3),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.3)),
    ("nesterov", lambda: sgd(0.1, momentum=0.9, nesterov=True),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
    ("adam", lambda: adam(0.05, eps_root=0.0), lambda ps: torch.optim.Adam(ps, lr=0.05)),
    ("adam-betas", lambda: adam(0.05, b1=0.5, b2=0.9, eps=1e-6, eps_root=0.0),
     lambda ps: torch.optim.Adam(ps, lr=0.05, betas=(0.5, 0.9), eps=1e-6)),
    ("sgd-decay", lambda: sgd(0.1, momentum=0.5, weight_decay=0.2),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, weight_decay=0.2)),
    ("adam-decay", lambda: adam(0.05, eps_root=0.0, weight_decay=0.3),
     lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.3)),
    ("adamw", lambda: adamw(0.05, eps_root=0.0, weight_decay=0.3),
     lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.3)),
    ("rmsprop", lambda: rmsprop(0.01, eps_root=0.0), lambda ps: torch.optim.RMSprop(ps, lr=0.01)),
    ("rmsprop-centered", lambda: rmsprop(0.01, alpha=0.9, momentum=0.5, centered=True,
                                         weight_decay=0.1, eps_root=0.0),
     lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, momentum=0.5, centered=True,
                                    weight_decay=0.1)),
    ("adagrad", lambda: adagrad(0.1, eps_root=0.0), lambda ps: torch.optim.Adagrad(ps, lr=0.1)),
    ("adagrad-decay", lambda: adagrad(0.1, lr_decay=0.05, weight_decay=0.1,
                                      initial_accumulator_value=0.2, eps_root=0.0),
     lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.05, weight_decay=0.1,
                                    initial_accumulator_value=0.2)),
]


@pytest.mark.parametrize("name,ours,theirs", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_first_order_trajectory_matches_torch_optim(name, ours, theirs):
    opt = ours()
    params = start()
    state = opt.init(params)
    leaves = {k: v.clone().requires_grad_() for k, v in start().items()}
    ref = theirs(list(leaves.values()))
    for _ in range(8):
        p = {k: v.detach().requires_grad_() for k, v in params.items()}
        grads = dict(zip(p, torch.autograd.grad(objective(p), list(p.values()))))
        updates, state = opt.update(grads, state, params)
        params = apply_updates(params, updates)
        ref.zero_grad()
        objective(leaves).backward()
        ref.step()
        for k in params:
            # Same formulas, arithmetic grouped differently: a few ulps per step at float64.
            torch.testing.assert_close(params[k].detach(), leaves[k].detach(), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])  # clipping every step, and never
def test_global_norm_clipping_matches_clip_grad_norm(max_norm):
    opt = chain(clip_by_global_norm(max_norm), sgd(0.1, momentum=0.5))
    params = start()
    state = opt.init(params)
    leaves = {k: v.clone().requires_grad_() for k, v in start().items()}
    ref = torch.optim.SGD(list(leaves.values()), lr=0.1, momentum=0.5)
    for _ in range(6):
        p = {k: v.detach().requires_grad_() for k, v in params.items()}
        grads = dict(zip(p, torch.autograd.grad(objective(p), list(p.values()))))
        updates, state = opt.update(grads, state, params)
        params = apply_updates(params, updates)
        ref.zero_grad()
        objective(leaves).backward()
        torch.nn.utils.clip_grad_norm_(list(leaves.values()), max_norm)
        ref.step()
    for k in params:
        # The same formulas as torch's; the norm is summed in another order (ulps).
        torch.testing.assert_close(params[k].detach(), leaves[k].detach(), rtol=1e-13, atol=1e-14)


def unrolled(theta: dict[str, torch.Tensor], opt, steps: int = 4) -> torch.Tensor:
    """Outer objective: a different function evaluated after ``steps`` differentiable steps."""
    params, state = dict(theta), opt.init(theta)
    for _ in range(steps):
        grads = dict(zip(params, torch.autograd.grad(objective(params), list(params.values()),
                                                     create_graph=True)))
        updates, state = opt.update(grads, state, params)
        params = apply_updates(params, updates)
    return (params["w"] ** 3).sum() + torch.cos(params["b"]).sum()


def finite_difference(f, x: torch.Tensor, h: float = 1e-5) -> torch.Tensor:
    out = torch.zeros_like(x)
    flat = out.view(-1)
    for i in range(x.numel()):
        e = torch.zeros_like(x).view(-1)
        e[i] = h
        e = e.view(x.shape)
        flat[i] = (f(x + e) - f(x - e)) / (2 * h)
    return out


SECOND_ORDER = [
    ("sgd", lambda lr: sgd(lr)),
    ("nesterov", lambda lr: sgd(lr, momentum=0.9, nesterov=True)),
    ("adam", lambda lr: adam(lr)),
    ("adamw", lambda lr: adamw(lr, weight_decay=0.3)),
    ("rmsprop", lambda lr: rmsprop(lr, alpha=0.5, momentum=0.5, centered=True, weight_decay=0.1)),
    ("adagrad", lambda lr: adagrad(lr, lr_decay=0.1, weight_decay=0.1)),
    ("clipped", lambda lr: chain(clip_by_global_norm(0.3), sgd(lr, weight_decay=0.1))),
]


@pytest.mark.parametrize("name,make", SECOND_ORDER, ids=[s[0] for s in SECOND_ORDER])
@pytest.mark.parametrize("per", ["scalar", "tensor", "parameter"])
def test_second_order_gradient_matches_finite_differences(name, make, per):
    theta = {k: v.requires_grad_() for k, v in start().items()}
    rates = LearnedLR(theta, 0.05, per)
    out = unrolled(theta, make(rates.as_dict()))
    leaves = list(theta.values()) + list(rates.parameters())
    got = torch.autograd.grad(out, leaves)

    def f_theta(k):
        def f(x):
            t = {**{j: v.detach() for j, v in theta.items()}, k: x}
            with torch.enable_grad():
                t = {j: v.detach().requires_grad_() for j, v in t.items()}
                return float(unrolled(t, make({j: r.detach() for j, r in rates.as_dict().items()})).detach())
        return f

    # Central differences at h=1e-5: truncation error ~h^2 * f''' ~ 1e-9, rounding ~1e-16/h
    # ~1e-11, so 1e-6 relative is a safe bound (a missing second-order term is off by >1e-2).
    for (k, v), g in zip(theta.items(), got[: len(theta)]):
        fd = finite_difference(f_theta(k), v.detach())
        torch.testing.assert_close(g, fd, rtol=1e-6, atol=1e-7)
    for r, g in zip(rates.parameters(), got[len(theta):]):
        def f_rate(x, r=r):
            with torch.no_grad():
                old = r.detach().clone()
                r.copy_(x)
            try:
                t = {j: v.detach().requires_grad_() for j, v in theta.items()}
                return float(unrolled(t, make({j: q.detach() for j, q in rates.as_dict().items()})).detach())
            finally:
                with torch.no_grad():
                    r.copy_(old)
        torch.testing.assert_close(g, finite_difference(f_rate, r.detach()), rtol=1e-6, atol=1e-7)


def test_adam_eps_root_keeps_second_order_finite_at_zero_gradient():
    # b's inner gradient 2 * (b - 0.5) is exactly zero at b = 0.5, and on the graph.
    theta = {"w": torch.tensor([0.3, -0.2], dtype=D, requires_grad=True),
             "b": torch.tensor([0.5], dtype=D, requires_grad=True)}

    def inner(p):
        return (p["w"] ** 2).sum() + ((p["b"] - 0.5) ** 2).sum()

    def outer(opt):
        params, state = dict(theta), opt.init(theta)
        g = torch.autograd.grad(inner(params), list(params.values()), create_graph=True,
                                allow_unused=True, materialize_grads=True)
        updates, state = opt.update(dict(zip(params, g)), state, params)
        params = apply_updates(params, updates)
        return (params["w"] ** 3).sum() + params["b"].sum()

    finite = torch.autograd.grad(outer(adam(0.1)), list(theta.values()))
    assert all(torch.isfinite(g).all() for g in finite)
    nan = torch.autograd.grad(outer(adam(0.1, eps_root=0.0)), list(theta.values()))
    assert not torch.isfinite(nan[1]).all()  # why eps_root exists


# ---------------------------------------------------------------- bad input


def test_state_from_another_parameter_set_is_an_error():
    opt = adam(0.1)
    state = opt.init({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="another parameter set.*'v'"):
        opt.update({"v": torch.zeros(3)}, state, {"v": torch.zeros(3)})
    with pytest.raises(ValueError, match="another parameter set"):
        opt.update({"w": torch.zeros(4)}, state, {"w": torch.zeros(4)})
    with pytest.raises(TypeError, match="state returned by its init"):
        sgd(0.1, momentum=0.5).update({"w": torch.zeros(3)}, (), {"w": torch.zeros(3)})


def test_learning_rate_of_wrong_shape_is_an_error():
    opt = sgd({"w": torch.ones(3, dtype=D)})
    state = opt.init({"w": torch.zeros(3, 3, dtype=D)})
    with pytest.raises(ValueError, match=r"shape \(3,\).*shape \(3, 3\)"):
        opt.update({"w": torch.zeros(3, 3, dtype=D)}, state, {"w": torch.zeros(3, 3, dtype=D)})
    with pytest.raises(KeyError, match="no entry for parameter 'b'"):
        sgd({"w": 0.1}).update({"b": torch.zeros(1)}, sgd(0.1).init({"b": torch.zeros(1)}), {})


def test_bad_hyper_parameters_are_errors():
    with pytest.raises(ValueError, match="Nesterov"):
        sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="b1"):
        adam(0.1, b1=1.0)
    with pytest.raises(ValueError, match="granularity"):
        LearnedLR({"w": torch.zeros(2)}, 0.1, "row")


def test_non_finite_inner_gradient_is_an_error():
    model = torch.nn.Linear(1, 1).double()
    x = torch.tensor([[1.0], [float("nan")]], dtype=D)
    with pytest.raises(FloatingPointError, match="inner step 0.*'weight'"):
        inner_loop(model, metaddp.params_of(model), Batch(x, torch.zeros(2, 1, dtype=D), 2),
                   lambda p, y: (p - y) ** 2, steps=1, optimizer=sgd(0.1))


def test_a_gradient_transformation_alone_is_not_a_step():
    # Applied as a step, clipped gradients would be added to the weights: ascent.
    clip = clip_by_global_norm(1.0)
    assert clip.transforms and not sgd(0.1).transforms
    with pytest.raises(ValueError, match="ends with a gradient transformation"):
        chain(sgd(0.1), clip)
    with pytest.raises(ValueError, match="chain it before an optimizer"):
        metaddp.MAML(torch.nn.Linear(2, 1), optimizer=clip)
    with pytest.raises(ValueError, match="chain it before an optimizer"):
        metaddp.MAML(torch.nn.Linear(2, 1), learn_lr="scalar", optimizer=lambda lr: clip)
    assert not chain(clip, sgd(0.1)).transforms
