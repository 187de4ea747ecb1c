"""Keyed dropout and the routing of a forward (metaddp.forward) on one
process: the hash's arithmetic, the masks' rate and their independence of the split, rebuilt
inner steps drawing the masks they drew, and the layers routed to metaddp's attention giving
PyTorch's values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metaddp as md
from metaddp.forward import _draws, _routes
from metaddp.testing import scenarios as S


def test_products_modulo_two_to_the_32_never_overflow():
    x = torch.tensor([0, 1, 2**31, 2**32 - 1, 123456789, 2**32 - 12345], dtype=torch.int64)
    for c in (0x7FEB352D, 0x846CA68B, 2**32 - 1, 1):
        got = _draws._mul32(x, c).tolist()
        assert got == [(v * c) % 2**32 for v in x.tolist()], hex(c)


def test_masks_keep_their_rate_and_do_not_depend_on_the_split():
    key = _draws.ForwardKey((0, 3, 7, 1), start=0, rows=10)
    x = torch.ones(10, 100, 100, dtype=torch.float64)
    full = _draws.dropout_mask(key, x, 0.3, False, "F.dropout")
    # 100,000 entries: the kept fraction's standard deviation is sqrt(0.21 / 1e5) = 1.4e-3;
    # 0.005 is 3.4 of them.
    assert (full != 0).double().mean().item() == pytest.approx(0.7, abs=0.005)
    assert set(full.unique().tolist()) == {0.0, 1 / 0.7}
    # A process holding samples 5 to 9 draws their rows of the one-process mask.
    part = _draws.ForwardKey((0, 3, 7, 1), start=5, rows=5)
    assert torch.equal(_draws.dropout_mask(part, x[5:], 0.3, False, "F.dropout"), full[5:])
    # Another forward, or another call of the same forward, draws other masks.
    other = _draws.ForwardKey((0, 3, 7, 2), start=0, rows=10)
    assert not torch.equal(_draws.dropout_mask(other, x, 0.3, False, "F.dropout"), full)
    assert not torch.equal(_draws.dropout_mask(key, x, 0.3, False, "F.dropout"), full)
    # Channel dropout: one draw per (sample, channel), broadcast over the rest.
    channels = _draws.dropout_mask(key, x, 0.5, True, "F.dropout1d")
    assert channels.shape == (10, 100, 1)


def test_a_first_dimension_that_is_not_the_samples_is_refused():
    key = _draws.ForwardKey((0, 0, 0, 0), start=0, rows=4)
    with pytest.raises(ValueError, match="whose first dimension is not the 4 sample"):
        _draws.dropout_mask(key, torch.ones(5, 4, 3), 0.1, False, "F.dropout")


def test_rebuilt_inner_steps_draw_the_masks_they_drew():
    # memory="low" runs each inner step's forward again in the backward: the same forward
    # numbers, the same masks, the default mode's meta-gradient (float64 rounding only).
    p = S.Problem(model="transformer", steps=3, n_tasks=2, n_support=7, n_query=6)
    out = {}
    for memory in ("default", "low"):
        alg = p.build_algorithm()
        alg.memory = memory
        loss = alg.meta_loss(p.tasks(), p.loss_fn)
        loss.backward()
        out[memory] = loss.item(), torch.cat([q.grad.reshape(-1) for q in alg.parameters()])
    assert out["low"][0] == pytest.approx(out["default"][0], rel=1e-14)
    # Float64 sums regrouped by the rebuilt steps: a few ulps of the largest entry.
    scale = out["default"][1].abs().max().item()
    assert (out["low"][1] - out["default"][1]).abs().max().item() <= 1e-12 * scale


def test_a_shard_that_does_not_say_where_it_starts_is_refused():
    net = nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.2), nn.Linear(8, 1)).double()
    x = torch.linspace(-1, 1, 6, dtype=torch.float64)[:, None]
    mse = lambda p, y: (p - y) ** 2  # noqa: E731
    maml = md.MAML(net, inner_lr=0.1)
    cut = md.Task(md.Batch.local(x[3:], x[3:], 6), md.Batch.local(x[3:], x[3:], 6))
    with pytest.raises(ValueError, match="says nothing of where its samples start"):
        maml.meta_loss([cut], mse, reduce=md.identity_reduce)
    placed = md.Task(md.Batch.local(x[3:], x[3:], 6, start=3), md.Batch.local(x[3:], x[3:], 6, start=3))
    assert torch.isfinite(maml.meta_loss([placed], mse, reduce=md.identity_reduce))
    with pytest.raises(ValueError, match="cannot start at 4"):
        md.Batch.local(x[3:], x[3:], 6, start=4)


def test_multi_head_attention_is_pytorchs_and_has_second_derivatives():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(5, 5) > 0.7  # True: not attended (nn.MultiheadAttention's meaning)
    mask.fill_diagonal_(False)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 4] = True
    for kwargs in ({}, {"need_weights": False}, {"attn_mask": mask, "key_padding_mask": padding}):
        want, want_w = mha(x, x, x, **kwargs)
        with _routes.routes(mha):
            got, got_w = mha(x, x, x, **kwargs)
        # The same operations regrouped (one attention kernel against PyTorch's): float64 ulps.
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
        if want_w is not None:
            torch.testing.assert_close(got_w, want_w, rtol=1e-12, atol=1e-13)
    with _routes.routes(mha):
        (g,) = torch.autograd.grad(mha(x, x, x, need_weights=False)[0].sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad((g**2).sum(), mha.in_proj_weight)
    assert torch.isfinite(gg).all() and gg.abs().sum() > 0


def test_unkeyable_draws_name_themselves():
    rough = nn.Sequential(nn.Linear(1, 4), nn.RReLU(), nn.AlphaDropout(0.2), nn.Linear(4, 1))
    found = _routes.unkeyable_layers(rough)
    assert any("RReLU's random slopes" in f for f in found) and any("alpha dropout" in f for f in found)
    seq_first = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1)  # batch_first=False
    assert "sequence-first" in _routes.unkeyable_layers(seq_first)[0]
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)[:, None]
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)).double()

    class Alpha(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return F.alpha_dropout(self.net(x), 0.2, training=True)

    task = md.Task(md.Batch(x, x, 4), md.Batch(x, x, 4))
    with pytest.raises(ValueError, match="alpha_dropout draws random numbers that metaddp does not key"):
        md.MAML(Alpha(), inner_lr=0.1).meta_loss([task], lambda p, y: (p - y) ** 2)


def test_a_moved_shard_keeps_its_start_and_predictions_are_keyed():
    x = torch.linspace(-1, 1, 6, dtype=torch.float64)[:, None]
    part = md.Batch.split(x, x, 1, 2)
    assert part._replace(x=part.x.float()).start == 3  # moved or cast: the same samples
    net = nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.5), nn.Linear(8, 1)).double()
    maml = md.MAML(net)
    whole = maml.predict(md.Batch(x, x, 6))
    # Rows 3 to 5 of the whole batch's prediction: the shard's samples draw their own masks.
    torch.testing.assert_close(maml.predict(part), whole[3:], rtol=0, atol=0)
    maml.at_step(1)
    assert not torch.equal(maml.predict(part), whole[3:])  # another step, other masks


def test_a_hand_loop_that_draws_is_refused_on_one_process_as_on_several():
    # The same script at 1 process and at 2 (tests/test_silent_cells.py): the error, not the
    # one-process number that a second process would then refuse.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.5), nn.Linear(8, 1)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1))
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)[:, None]
    with pytest.raises(ValueError, match="draws random numbers where metaddp cannot key them"):
        md.functional.call(learner.module.model, md.params_of(learner.module.model), x)
    with learner.local():  # one rank's own work may draw
        assert md.functional.call(learner.module.model, md.params_of(learner.module.model), x).shape == (4, 1)
    task = md.Task(md.Batch(x, x, 4), md.Batch(x, x, 4))
    loss = learner.meta_loss(learner.shard([task]), lambda p, y: (p - y) ** 2)  # keyed: runs
    assert torch.isfinite(loss)
    md.shutdown()


def test_a_deep_copy_of_a_wrapped_model_is_a_plain_module_that_may_draw():
    # copy.deepcopy carries the wrapper's hooks along; they refuse only on the modules they
    # were put on, so a copy (an EMA model, one rank's evaluation) draws as PyTorch does.
    import copy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.5), nn.Linear(8, 1)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1))
    twin = copy.deepcopy(net)
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)[:, None]
    assert twin(x).shape == (4, 1)
    with pytest.raises(ValueError, match="draws random numbers where metaddp cannot key them"):
        net(x)
    learner.release()
    md.shutdown()
