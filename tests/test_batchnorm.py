"""Synchronized BatchNorm on one process: it must be exactly PyTorch's BatchNorm (outputs,
first and second derivatives, running statistics) and leave the module as it found it.
The multi-rank checks (world sizes 2 and 4, uneven shards) are in test_algorithms.py."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from metaddp import MAML, MetaDDP, call, params_of, sync_batchnorm
from metaddp.distributed._batchnorm import _synced_by


def identity(ts):
    return ts


def net(norm: type[nn.Module], momentum: float | None = 0.1, affine: bool = True) -> nn.Module:
    torch.manual_seed(0)
    if norm is nn.BatchNorm1d:
        return nn.Sequential(nn.Linear(3, 4), norm(4, momentum=momentum, affine=affine), nn.Tanh(),
                             nn.Linear(4, 2)).double()
    return nn.Sequential(nn.Conv2d(1, 3, 3), norm(3, momentum=momentum, affine=affine), nn.Tanh(),
                         nn.Flatten(), nn.Linear(3 * 4 * 4, 2)).double()


def data(norm):
    g = torch.Generator().manual_seed(1)
    shape = (7, 3) if norm is nn.BatchNorm1d else (7, 1, 6, 6)
    # An offset mean of 3 checks that the shifted sums do not cancel.
    return 3 + torch.randn(shape, generator=g, dtype=torch.float64)


def second_order(model, x, synced: bool):
    """A MAML-like objective: the gradient of a loss at weights moved by its own gradient."""
    p = params_of(model)
    ctx = sync_batchnorm(model, identity) if synced else contextlib.nullcontext()
    with ctx:
        loss = (call(model, p, x) ** 2).mean()
        g = torch.autograd.grad(loss, list(p.values()), create_graph=True)
        fast = {k: v - 0.1 * gi for (k, v), gi in zip(p.items(), g)}
        out = (call(model, fast, x).sin()).mean()
    return out, torch.autograd.grad(out, list(p.values()))


@pytest.mark.parametrize("norm", [nn.BatchNorm1d, nn.BatchNorm2d])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("affine", [True, False])
def test_matches_torch_batchnorm_to_second_order(norm, momentum, affine):
    a, b = net(norm, momentum, affine), net(norm, momentum, affine)
    x = data(norm)
    out_ref, g_ref = second_order(a, x, synced=False)
    out, g = second_order(b, x, synced=True)
    # E[(x-k)^2] - E[x-k]^2 against PyTorch's own variance kernel: ~1e-15 apart in float64;
    # second derivatives pass through rsqrt(var + eps) twice and amplify that to ~1e-13.
    # A wrong statistic (unbiased instead of biased variance, a missing term) is off by >1e-2.
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    for gi, ri in zip(g, g_ref):
        torch.testing.assert_close(gi, ri, rtol=1e-10, atol=1e-12)
    for (k, ra), (_, rb) in zip(a.named_buffers(), b.named_buffers()):
        torch.testing.assert_close(rb, ra, rtol=1e-12, atol=1e-12, msg=k)


def test_eval_mode_uses_running_statistics():
    a, b = net(nn.BatchNorm2d), net(nn.BatchNorm2d)
    x = data(nn.BatchNorm2d)
    a(x), b(x)  # one training step of running statistics
    a.eval(), b.eval()
    with sync_batchnorm(b, identity):
        got = b(x)
    torch.testing.assert_close(got, a(x), rtol=0, atol=0)  # the same F.batch_norm call: exact


def test_module_is_restored_and_nesting_refused():
    model = net(nn.BatchNorm1d)
    bn = model[1]
    with sync_batchnorm(model, identity):
        assert _synced_by(bn) is not None
        with pytest.raises(RuntimeError, match="already synchronized"):
            with sync_batchnorm(model, identity):
                pass
    assert _synced_by(bn) is None and type(bn) is nn.BatchNorm1d
    handle = sync_batchnorm(model, identity)  # without `with`: until remove()
    assert _synced_by(bn) is handle
    handle.remove()
    assert _synced_by(bn) is None and type(bn) is nn.BatchNorm1d
    with pytest.raises(ValueError, match="boom"):
        with sync_batchnorm(model, identity):
            raise ValueError("boom")
    assert _synced_by(bn) is None and type(bn) is nn.BatchNorm1d


def test_nothing_is_written_into_the_layers():
    """MetaDDP and sync_batchnorm put no key into any module's ``__dict__`` (no replaced
    ``forward``, no attribute), and the numbers are one process's on the whole batch."""
    x = data(nn.BatchNorm2d)
    ref = net(nn.BatchNorm2d)
    out_ref, g_ref = second_order(ref, x, synced=False)
    for how in ("MetaDDP", "sync_batchnorm"):
        model = net(nn.BatchNorm2d)
        before = {n: set(vars(m)) for n, m in model.named_modules()}
        learner = MetaDDP(MAML(model, inner_lr=0.1)) if how == "MetaDDP" else None
        with sync_batchnorm(model, identity) if learner is None else contextlib.nullcontext():
            assert _synced_by(model[1]) is not None
            out, g = second_order(model, x, synced=False)  # synchronized already
            assert {n: set(vars(m)) for n, m in model.named_modules()} == before, how
        if learner is not None:
            learner.release()
        assert {n: set(vars(m)) for n, m in model.named_modules()} == before, how
        assert _synced_by(model[1]) is None and type(model[1]) is nn.BatchNorm2d
        # Tolerances of test_matches_torch_batchnorm_to_second_order, for the same reasons.
        torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
        for gi, ri in zip(g, g_ref):
            torch.testing.assert_close(gi, ri, rtol=1e-10, atol=1e-12)
        for (k, ra), (_, rb) in zip(ref.named_buffers(), model.named_buffers()):
            torch.testing.assert_close(rb, ra, rtol=1e-12, atol=1e-12, msg=k)


def test_global_statistics_come_from_reduce():
    """With a reduce that adds a second copy of the batch, statistics are those of both."""
    model = net(nn.BatchNorm1d, momentum=None)
    x = data(nn.BatchNorm1d)
    seen = []

    def doubled(ts):
        seen.append(len(ts))
        return [t * 2 for t in ts]  # two identical shards: sums and count double

    ref = net(nn.BatchNorm1d, momentum=None)
    with sync_batchnorm(model, doubled):
        got = model(x)
    want = ref(x)  # the same mean and biased variance; the unbiased running variance differs
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # float64 reordering, as above
    assert seen == [3]
    n = 2 * x.shape[0]
    h = ref[0](x).detach()
    # Default float64 tolerances of assert_close (1e-7 relative): the value differs by n/(n-1),
    # 8% here, if the global count is not used.
    torch.testing.assert_close(model[1].running_var, h.var(0, unbiased=False) * n / (n - 1))


def test_a_copy_of_a_synchronized_module_is_pytorchs_own():
    """copy.deepcopy of a wrapped model (an evaluation copy, an EMA) works and is a plain
    module: its layers take their own batch's statistics, with no collective, so one rank
    may use it alone; the copy can be synchronized itself, and the original is unchanged."""
    model = net(nn.BatchNorm1d)
    x = data(nn.BatchNorm1d)
    seen = []

    def counting(ts):
        seen.append(len(ts))
        return ts

    with sync_batchnorm(model, counting):
        twin = copy.deepcopy(model)
        # PyTorch's own statistics, bit for bit (the same kernel); the original's are synced.
        torch.testing.assert_close(twin(x), net(nn.BatchNorm1d)(x), rtol=0, atol=0)
        assert seen == []
        model(x)
        assert seen == [3]
        with sync_batchnorm(twin, counting):  # not "already synchronized"
            twin(x)
        assert seen == [3, 3]
        twin(x)  # taken off again
        assert seen == [3, 3]


def test_every_way_a_layer_is_called_takes_global_statistics():
    """A layer called as ``bn.forward(x)`` inside a model's forward, and ``nn.SyncBatchNorm``
    (what DDP code converted with ``convert_sync_batchnorm`` holds), take their statistics
    from the reduce as ``bn(x)`` does: otherwise each rank would silently use its own."""
    x = data(nn.BatchNorm1d)
    for layer in (nn.BatchNorm1d(3), nn.SyncBatchNorm(3)):
        layer.double()
        seen = []

        def counting(ts, seen=seen):
            seen.append(len(ts))
            return ts

        with sync_batchnorm(nn.Sequential(layer), counting):
            layer.forward(x)
            layer(x)
        assert seen == [3, 3], type(layer).__name__
