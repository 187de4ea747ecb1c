"""The stacked step's own kernels: batch norm and max pooling folded over tasks, one-kernel
parameter updates, the measured choice of convolution, and the operation count they give."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metaddp
from metaddp.algorithms._conv_ways import WAYS, ConvChoice
from metaddp.algorithms._layers import stacked_layers
from metaddp.algorithms._norm import _BatchNormBackward, batch_norm
from metaddp.algorithms._pool import max_pool2d
from metaddp.inner._foreach import added, scaled
from metaddp.testing.dispatch import DispatchCounter

D = torch.float64


def randn(*shape, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=D, requires_grad=grad)


# --- batch norm -----------------------------------------------------------------------------

# Small shapes: finite differences of the second derivative cost the square of the entries
# (72 took 16 s), and a wrong adjoint term is wrong at any size that has several samples,
# channels and positions.
@pytest.mark.parametrize("shape", [(5, 3), (3, 2, 4), (2, 2, 3, 2)], ids=["1d", "2d-seq", "2d"])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_matches_finite_differences_to_the_third_order(shape, affine):
    x = randn(*shape)
    w, b = (randn(shape[1], seed=1), randn(shape[1], seed=2)) if affine else (None, None)
    inputs = (x, w, b) if affine else (x,)

    def f(x, w=None, b=None):
        return batch_norm(x, w, b, 1e-5)

    # The same kernel as PyTorch's: the same bits.
    assert torch.equal(f(*inputs), F.batch_norm(x, None, None, w, b, training=True, eps=1e-5))
    # gradcheck's defaults (float64 central differences, atol 1e-5, rtol 1e-3) catch any wrong
    # term of the adjoints: a missing or misscaled term is O(1) off.
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)

    # The backward's own derivatives (what a third-order derivative differentiates), the
    # statistics recomputed from x as the forward would.
    gy = randn(*shape, seed=3)

    def backward(gy, x, w=None):
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x.detach(), dims, correction=0)
        return _BatchNormBackward.apply(gy, x, w, mean, torch.rsqrt(var + 1e-5), 1e-5)

    assert torch.autograd.gradgradcheck(backward, (gy, x, w) if affine else (gy, x))


def test_stacked_batch_norm_is_one_kernel_and_pytorchs_values_to_second_order():
    w, b = randn(4, 3, seed=1), randn(4, 3, seed=2)
    x = randn(4, 5, 3, 6, 6)

    def one(w, b, x):
        return F.batch_norm(x, None, None, w, b, training=True).tanh().square().sum()

    def derivatives(routed: bool):
        if routed:
            with stacked_layers(), DispatchCounter() as ops:
                y = torch.vmap(one)(w, b, x).sum()
            assert ops.ops["aten.native_batch_norm.default"] == 1
            assert "aten.mul.Tensor" not in ops.ops  # the weights are the kernel's own
        else:
            y = torch.vmap(one)(w, b, x).sum()
        first = torch.autograd.grad(y, (w, b, x), create_graph=True)
        second = torch.autograd.grad(sum(t.sin().sum() for t in first), (w, b, x))
        return [t.detach() for t in (*first, *second)]

    # The same sums in another order (PyTorch's composite double backward against this one):
    # float64 rounding over 180 values per channel, ~1e-14 relative.
    for a, r in zip(derivatives(True), derivatives(False), strict=True):
        assert float((a - r).abs().max()) <= 1e-12 * float(r.abs().max())


def test_running_statistics_and_autocast_keep_pytorchs_batch_norm():
    bn = nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 2, 2, requires_grad=True)
    with stacked_layers():
        tracked = bn(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = F.batch_norm(x, None, None, training=True)
        routed = F.batch_norm(x, None, None, training=True)
    assert type(routed.grad_fn).__name__ == "_BatchNormBackward"  # what the others are not
    assert type(tracked.grad_fn).__name__ == "NativeBatchNormBackward0"
    assert type(cast.grad_fn).__name__ == "NativeBatchNormBackward0"
    assert bn.num_batches_tracked == 1  # PyTorch's own layer updated its statistics


# --- max pooling ----------------------------------------------------------------------------

@pytest.mark.parametrize("kernel, stride, padding, ceil", [(2, None, 0, False), (3, 2, 1, True)])
def test_max_pooling_is_pytorchs_to_the_second_order(kernel, stride, padding, ceil):
    x = randn(2, 3, 7, 6)

    def f(x):
        return max_pool2d(x, kernel, stride, padding, 1, ceil)

    assert torch.equal(f(x), F.max_pool2d(x, kernel, stride, padding, ceil_mode=ceil))
    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))

    stacked = randn(4, 2, 3, 7, 6)  # 4 tasks
    with stacked_layers():
        got = torch.vmap(lambda t: F.max_pool2d(t, kernel, stride, padding, ceil_mode=ceil))(stacked)
    # A max is exact: the same values bit for bit, and the same gradient.
    want = torch.vmap(lambda t: F.max_pool2d(t, kernel, stride, padding, ceil_mode=ceil))(stacked)
    assert torch.equal(got, want)
    assert torch.equal(*(torch.autograd.grad(v.sum(), stacked)[0] for v in (got, want)))


# --- one-kernel updates ---------------------------------------------------------------------

def test_one_kernel_updates_have_per_tensor_values_and_graphs():
    p = [randn(3, 2), randn(4), randn(2, 2, seed=5, grad=False)]
    g = [randn(3, 2, seed=1), randn(4, seed=2), randn(2, 2, seed=3)]
    with DispatchCounter() as ops:
        step = scaled(g, [-0.3, -0.2, -0.1])
        new = added(p, step)
    assert ops.total == 2  # one foreach kernel each
    for pi, gi, f, ni in zip(p, g, [-0.3, -0.2, -0.1], new, strict=True):
        assert torch.equal(ni, pi + f * gi)  # bit for bit
    # Each output depends on its own inputs only: an unreached tensor's gradient stays None.
    got = torch.autograd.grad(new[0].sum(), [*p[:2], *g], allow_unused=True)
    assert got[1] is None and got[3] is None and got[4] is None
    assert torch.equal(got[2], torch.full((3, 2), -0.3, dtype=D))
    # Differentiable again: the second derivative through the scaled gradient.
    assert torch.autograd.gradgradcheck(lambda a, b: added([a], scaled([b.tanh()], [0.7]))[0],
                                        (p[0], g[0]))


def test_broadcasts_and_transformed_tensors_take_per_tensor_operations():
    a, b = randn(3, 2), randn(2)
    (out,) = added([a], [b])
    assert torch.equal(out, a + b)
    assert torch.autograd.grad(out.sum(), b)[0].shape == (2,)
    under_vmap = torch.vmap(lambda t: added([t], [t])[0] + scaled([t], [2.0])[0])(a)
    assert torch.equal(under_vmap, 4 * a)


# --- the convolution's way, measured --------------------------------------------------------

def conv4(hidden: int = 8, ways: int = 5) -> nn.Module:
    """MAML's Conv-4 (3x3 conv, BatchNorm with batch statistics, ReLU, 2x2 max-pool, four
    times), with a narrow width: the operation count does not depend on sizes."""
    def block(cin):
        return [nn.Conv2d(cin, hidden, 3, padding=1),
                nn.BatchNorm2d(hidden, track_running_stats=False), nn.ReLU(), nn.MaxPool2d(2)]

    torch.manual_seed(0)
    return nn.Sequential(*block(1), *block(hidden), *block(hidden), *block(hidden), nn.Flatten(),
                         nn.Linear(hidden, ways))


def conv4_tasks(n: int, dtype=torch.float32, size: int = 28, ways: int = 5):
    g = torch.Generator().manual_seed(n)

    def batch(per_class):
        x = torch.randn(ways * per_class, 1, size, size, generator=g, dtype=dtype)
        y = torch.arange(ways).repeat_interleave(per_class)
        return metaddp.Batch(x, y, ways * per_class)

    return [metaddp.Task(batch(1), batch(15)) for _ in range(n)]


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def meta_gradient(maml, net, tasks):
    net.zero_grad(set_to_none=True)
    maml.meta_loss(tasks, ce).backward()
    return [p.grad.clone() for p in net.parameters()]


def test_every_way_gives_the_loops_meta_gradient_with_max_pooling():
    net = conv4(hidden=4).double()
    tasks = conv4_tasks(3, D, size=16)
    want = meta_gradient(metaddp.MAML(net, inner_lr=0.3, steps=2, batched=False), net, tasks)
    for way in ("auto", *WAYS):
        got = meta_gradient(metaddp.MAML(net, inner_lr=0.3, steps=2, batched=True, conv=way),
                            net, tasks)
        # Stacked against one task at a time: the same sums grouped otherwise, float64
        # rounding of a few thousand terms through two inner steps, ~1e-14 relative to the
        # largest entry. (Relative to the whole gradient: a bias before a batch norm has a
        # gradient of rounding noise, 1e-17, which BatchNorm's mean subtraction cancels.)
        scale = max(float(r.abs().max()) for r in want)
        for a, r in zip(got, want, strict=True):
            assert float((a - r).abs().max()) <= 1e-12 * scale, way


def test_auto_times_every_way_once_per_shape_and_remembers_the_fastest(monkeypatch):
    timed = []
    seconds = {"grouped": 3.0, "per_task": 1.0, "transposed": 2.0, "channels_last": 4.0}

    def fake(self, x, w, b, spec):
        timed.append((tuple(x.shape), spec[5]))
        return seconds[spec[5]]

    monkeypatch.setattr(ConvChoice, "_seconds", fake)
    choice = ConvChoice("auto")
    w = torch.randn(3, 4, 2, 3, 3)
    x = torch.randn(3, 5, 2, 6, 6)
    with stacked_layers(conv=choice):
        for _ in range(2):  # a second call of the same shapes measures nothing
            torch.vmap(lambda w, x: F.conv2d(x, w, padding=1).sum() + F.conv2d(x, w, stride=2).sum())(w, x)
    # Stride 1: all four ways; stride 2: no transposed form.
    assert timed == [((5, 6, 6, 6), v) for v in WAYS] + [
        ((5, 6, 6, 6), v) for v in ("grouped", "per_task", "channels_last")]
    assert sorted(choice.chosen.values()) == ["per_task", "per_task"]
    assert all(set(t) <= set(WAYS) for t in choice.timings.values())


def test_a_forced_way_measures_nothing_and_a_wrong_one_is_refused(monkeypatch):
    monkeypatch.setattr(ConvChoice, "_seconds", lambda *a: pytest.fail("measured"))
    w, x = torch.randn(3, 4, 2, 3, 3), torch.randn(3, 5, 2, 6, 6)
    with stacked_layers(conv=ConvChoice("channels_last")):
        torch.vmap(lambda w, x: F.conv2d(x, w))(w, x)
    with pytest.raises(ValueError, match="conv must be 'auto' or one of grouped, per_task"):
        metaddp.MAML(nn.Linear(1, 1), conv="fastest")


def test_the_real_clock_chooses_a_way_that_applies():
    choice = ConvChoice("auto", repeats=1)
    w, x = torch.randn(3, 4, 2, 3, 3), torch.randn(3, 5, 2, 6, 6)
    with stacked_layers(conv=choice):
        torch.vmap(lambda w, x: F.conv2d(x, w, stride=2))(w, x)
    ((key, way),) = choice.chosen.items()
    assert way in ("grouped", "per_task", "channels_last")
    assert set(choice.timings[key]) == {"grouped", "per_task", "channels_last"}
    assert all(s > 0 for s in choice.timings[key].values())


# --- what a GPU pays: dispatched operations per meta-step -----------------------------------

# This network's stacked second-order step dispatched 1,498 operations at K = 1 and 2,571 at
# K = 2 before these kernels (commit 5d751ba; BENCHMARKS.md gives 1,544 for the benchmark's
# step, which also copies the gradients out). BUDGET is what they give now: a ceiling, so the
# figure cannot creep back. Counts depend on the operations run, not on values or sizes.
BEFORE = {1: 1_498, 2: 2_571}
BUDGET = {1: 883, 2: 1_450}


@pytest.mark.parametrize("steps", [1, 2])
def test_the_stacked_conv4_step_dispatches_within_its_budget_for_any_task_count(steps):
    def count(n_tasks):
        net = conv4()
        maml = metaddp.MAML(net, inner_lr=0.4, steps=steps, batched=True, conv="grouped")
        tasks = conv4_tasks(n_tasks)
        meta_gradient(maml, net, tasks)  # warm-up: lazy initialisation
        with DispatchCounter() as ops:
            meta_gradient(maml, net, tasks)
        return ops.total

    counts = {n: count(n) for n in (2, 8)}
    assert counts[2] == counts[8]  # flat in the number of tasks
    assert counts[2] <= BUDGET[steps], counts
    assert counts[2] <= 0.7 * BEFORE[steps]  # at least 30% fewer
