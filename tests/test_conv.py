"""The stacked convolution: PyTorch's values to any order, and a kernel count per meta-step that
does not grow with the number of stacked tasks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metaddp
from metaddp.algorithms._conv import convolution
from metaddp.algorithms._conv_ways import WAYS, ConvChoice
from metaddp.algorithms._layers import stacked_layers
from metaddp.testing import scenarios as S
from metaddp.testing.dispatch import DispatchCounter

# (conv function, input shape [N, C, *spatial], weight shape, stride, padding, dilation, groups)
SHAPES = [
    (F.conv1d, (2, 4, 9), (6, 2, 3), 2, 1, 1, 2),
    (F.conv2d, (2, 3, 7, 6), (4, 3, 3, 2), 1, (1, 0), 2, 1),
    (F.conv3d, (1, 2, 5, 4, 4), (3, 2, 2, 2, 2), 1, 0, 1, 1),
]


@pytest.mark.parametrize("conv, xs, ws, stride, padding, dilation, groups", SHAPES,
                         ids=["1d-groups", "2d-dilated", "3d"])
@pytest.mark.parametrize("bias", [True, False])
def test_first_and_second_derivatives_match_finite_differences(
        conv, xs, ws, stride, padding, dilation, groups, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(xs, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(ws, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(ws[0], generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = (x, w) if b is None else (x, w, b)

    def f(x, w, b=None):
        return convolution(x, w, b, stride, padding, dilation, groups)

    # Forward: the same kernel as PyTorch's, so the same bits.
    assert torch.equal(f(*inputs), conv(x, w, b, stride, padding, dilation, groups))
    # gradcheck's defaults (float64 central differences, atol 1e-5, rtol 1e-3) catch any
    # wrong term of the adjoint: a missing or transposed term is O(1) off.
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("forward", WAYS)
def test_vmapped_second_derivatives_equal_pytorchs_own(forward):
    # Per-task weights (plain and grouped), per-task and shared inputs, second order through
    # the inner gradient; the stacked forward each way (the "transposed" one also with
    # dilation, and falling back to grouped at stride 2).
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 4, 2, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 5, 2, 6, 6, generator=g, dtype=torch.float64, requires_grad=True)
    shared = torch.randn(5, 2, 6, 6, generator=g, dtype=torch.float64, requires_grad=True)
    depthwise = torch.randn(3, 4, 1, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)

    def run(routed: bool) -> list[torch.Tensor]:
        def one(w, b, x, d):
            h = F.conv2d(x, w, b, padding=1).tanh()
            h = F.conv2d(h, d, groups=4, dilation=(1, 2))  # per-task weights, 4 groups each
            return (h.square().sum() + F.conv2d(shared, w, stride=2).sin().sum())

        if routed:
            with stacked_layers(conv=ConvChoice(forward)):
                y = torch.vmap(one)(w, b, x, depthwise).sum()
        else:
            y = torch.vmap(one)(w, b, x, depthwise).sum()
        first = torch.autograd.grad(y, (w, b, x, depthwise), create_graph=True)
        second = torch.autograd.grad(sum((t.sin()).sum() for t in first),
                                     (w, b, x, shared, depthwise))
        return [t.detach() for t in list(first) + list(second)]

    # The same values summed in another grouping (grouped kernels against per-group ones):
    # float64 rounding of sums of a few hundred terms, ~1e-15 relative.
    for a, r in zip(run(True), run(False), strict=True):
        assert float((a - r).abs().max()) <= 1e-12 * float(r.abs().max())


def test_string_padding_and_unbatched_inputs_keep_pytorchs_convolution():
    w = torch.randn(4, 2, 3, 3)
    x = torch.randn(2, 5, 5)  # unbatched [C, H, W]
    with stacked_layers():
        same = F.conv2d(torch.randn(1, 2, 5, 5), w, padding="same")
        single = F.conv2d(x, w)
        keyword = F.conv2d(input=x.unsqueeze(0), weight=w, stride=1)
    assert same.shape == (1, 4, 5, 5) and single.shape == (4, 3, 3)
    assert torch.equal(keyword[0], single)


def test_autocast_runs_the_convolution_in_the_lower_precision():
    w = torch.randn(4, 2, 3, 3, requires_grad=True)
    x = torch.randn(3, 2, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16), stacked_layers():
        y = F.conv2d(x, w)
    assert y.dtype == torch.bfloat16
    (gw,) = torch.autograd.grad(y.float().sum(), w)
    assert gw.dtype == torch.float32
    # bf16 has 8 significant bits: its relative error is up to 2^-8 per input, summed over
    # 18 products per output.
    assert torch.allclose(y.float(), F.conv2d(x, w), rtol=0.05, atol=0.05)


def count_ops(tasks: int, steps: int, conv: str = "grouped") -> int:
    problem = S.Problem(model="conv", n_tasks=tasks, steps=steps, batchnorm=True,
                        running_stats=False)
    net = problem.build_model()
    maml = metaddp.MAML(net, inner_lr=problem.inner_lr, steps=steps, batched=True, conv=conv)
    batch = problem.tasks()
    maml.meta_loss(batch, problem.loss_fn).backward()  # warm-up: lazy initialisation
    with DispatchCounter() as ops:
        maml.meta_loss(batch, problem.loss_fn).backward()
    return ops.total


@pytest.mark.parametrize("steps", [1, 2])
def test_a_stacked_second_order_meta_step_dispatches_as_many_operations_for_any_task_count(steps):
    # Exact equality: the count of aten operations does not depend on the values, and
    # PyTorch's own grouped double backward adds a slice and a convolution per task. (With
    # the grouped forward; conv="per_task": next test.)
    assert count_ops(2, steps) == count_ops(6, steps)


def test_per_task_forward_convolutions_add_one_convolution_per_task():
    # Per task, every forward convolution adds one convolution per task; the backward ones
    # add nothing. The two-layer conv net (count_ops): 2 on the support per inner step, 2 on
    # the query, and 3 in each inner step's double backward (conv(x, ggw) in both layers,
    # conv(ggx, w) in the second, whose input has a gradient). 6 tasks against 2: 4 more.
    for steps in (1, 2):
        forward_convs = 2 * steps + 2 + 3 * steps
        assert count_ops(6, steps, "per_task") - count_ops(2, steps, "per_task") == 4 * forward_convs


def test_the_transposed_forward_runs_transposed_convolutions_at_stride_one():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Convolutions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[tuple[bool, tuple]] = []  # (transposed, stride)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution.default:
                self.calls.append((args[6], tuple(args[3])))
            return func(*args, **(kwargs or {}))

    w = torch.randn(3, 4, 2, 3, 3, dtype=torch.float64)
    x = torch.randn(3, 5, 2, 6, 6, dtype=torch.float64)

    def one(w, x):
        return F.conv2d(x, w, padding=1).sum() + F.conv2d(x, w, stride=2).sum()

    with stacked_layers(conv=ConvChoice("transposed")), Convolutions() as seen:
        got = torch.vmap(one)(w, x)
    assert seen.calls == [(True, (1, 1)), (False, (2, 2))]
    # The same sums in another kernel: float64 rounding of 18-term sums.
    assert torch.allclose(got, torch.vmap(one)(w, x), rtol=1e-13, atol=0)


def test_the_routing_is_scoped_to_the_stacked_forward():
    net = nn.Conv2d(1, 1, 1)
    x = torch.randn(1, 1, 2, 2)
    with stacked_layers():
        inside = net(x)
    outside = net(x)
    assert type(inside.grad_fn).__name__ == "_ConvBackward"
    assert type(outside.grad_fn).__name__ == "ConvolutionBackward0"
    assert torch.equal(inside, outside)
