"""Dynamic loss scaling of the inner steps (``metaddp.LossScale``) for float16 forward passes.

CPU autocast runs ``nn.Linear`` in float16 in torch 2.13 (``torch.autocast("cpu",
dtype=torch.float16)``; the MSE loss itself runs in float32), so these tests use it as a GPU
would; no model is converted to float16 by hand. MAML runs its tasks one by one
(``batched=False``): the loop is the path that scales.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import metaddp as md
from metaddp.distributed.launch import run_local
from metaddp.testing import scenarios as S

P = S.Problem("mlp", steps=2, n_tasks=3, dtype=torch.float32)


def maml(p: S.Problem = P, *, loss_scale=None, autocast=None, steps=None, lr=None, **kw) -> md.MAML:
    alg = md.MAML(p.build_model(), inner_lr=p.inner_lr if lr is None else lr,
                  steps=p.steps if steps is None else steps, autocast=autocast, batched=False, **kw)
    alg.loss_scale = loss_scale  # set after construction: MAML's own signature may not take it yet
    return alg


def meta_grad(alg: md.MAML, loss_fn=P.loss_fn, outer: float = 1.0, tasks=None) -> dict[str, torch.Tensor]:
    """The meta-gradient; ``outer`` scales the meta-loss before its backward (as
    ``torch.amp.GradScaler`` would) and is divided out again."""
    alg.zero_grad(set_to_none=True)
    (alg.meta_loss(P.tasks() if tasks is None else tasks, loss_fn) * outer).backward()
    return {k: g / outer for k, g in S.meta_gradient(alg).items()}


def finite(grads) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads.values())


def test_default_on_under_float16_only_and_part_of_the_settings():
    assert md.MAML(P.build_model(), autocast=torch.float16).loss_scale == md.LossScale()
    assert md.MAML(P.build_model(), autocast=torch.bfloat16).loss_scale is None
    assert md.MAML(P.build_model()).loss_scale is None
    a = md.MAML(P.build_model(), autocast=torch.float16)
    b = md.MAML(P.build_model(), autocast=torch.float16)
    b.loss_scale = False
    assert b.loss_scale is None and a.signature() != b.signature()
    b.loss_scale = md.LossScale(init=2.0**8)
    assert a.signature() != b.signature()
    with pytest.raises(ValueError, match="power of two"):
        md.LossScale(init=1000.0)
    with pytest.raises(ValueError, match="below 1"):
        md.LossScale(backoff=2.0)
    with pytest.raises(TypeError, match="LossScale"):
        b.loss_scale = 1024.0
    # memory="low" computes the meta-gradient inside meta_loss: no scale reaches it, neither the
    # inner one nor the outer backward's, so float16 there is refused, loss_scale=None too (first
    # order runs the default loop, which scales). tests/test_silent_cells.py has the other paths.
    for scale in (md.inner.LossScale(), None):
        with pytest.raises(ValueError, match="upstream gradient of one"):
            md.MAML(P.build_model(), autocast=torch.float16, memory="low", loss_scale=scale)
    assert md.MAML(P.build_model(), autocast=torch.float16, memory="low", first_order=True).loss_scale
    assert md.MAML(P.build_model(), autocast=torch.bfloat16, memory="low").memory == "low"


def test_scaling_a_float32_step_changes_nothing():
    # A power-of-two scale changes only exponents: every product and sum of the scaled
    # backward is the unscaled one times the scale, rounded the same way, and the division
    # undoes it exactly. So the meta-gradients agree bit for bit (not just to rounding).
    plain = meta_grad(maml())
    scaled = meta_grad(maml(loss_scale=md.LossScale(init=2.0**20)))
    assert plain.keys() == scaled.keys()
    assert all(torch.equal(plain[k], scaled[k]) for k in plain)


@pytest.mark.parametrize("first_order", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_an_overflow_skips_the_step(first_order, optimizer):
    # A scale of 2**120 overflows float16 at once (its largest value is 65504).
    net = P.build_model()
    task = P.tasks()[0]
    params = md.params_of(net)
    opt = {"sgd": md.sgd(0.1), "momentum": md.sgd(0.1, momentum=0.9), "adam": md.adam(0.1)}[optimizer]
    state = opt.init(params)
    scale = md.LossScale(init=2.0**120).start(next(iter(params.values())))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = md.batch_share(net, scale.watch(params), task.support, P.loss_fn)
        fast, new_state = md.inner_step(loss, params, state, opt, step=0, first_order=first_order,
                                        scale=scale)  # no FloatingPointError: the scaler handles it
        query = md.batch_share(net, fast, task.query, P.loss_fn)
    assert all(torch.equal(fast[k], params[k]) for k in params)
    for new, old in zip(new_state.slots, state.slots, strict=True):
        assert all(torch.equal(new[k], old[k]) for k in old)
    assert float(scale.value) == 2.0**119
    got = torch.autograd.grad(query, list(params.values()))
    # The loop without the step: the query loss of the meta-parameters themselves.
    with torch.autocast("cpu", dtype=torch.float16):
        want = torch.autograd.grad(md.batch_share(net, params, task.query, P.loss_fn), list(params.values()))
    assert all(bool(torch.isfinite(g).all()) for g in got)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_skipped_step_leaves_the_meta_gradient_of_the_loop_without_it():
    # Step 0 at 2**40 overflows; the backoff of 2**-30 puts step 1 at 2**10, which does not.
    # The second-order meta-gradient is finite (no 0 * inf from the discarded step's graph) and
    # that of one step at 2**10: a skipped step adds exact zeros, so bit for bit.
    f16, tasks = torch.float16, P.tasks()[:1]
    skipped = meta_grad(maml(steps=2, autocast=f16, loss_scale=md.LossScale(init=2.0**40, backoff=2.0**-30)),
                        tasks=tasks)
    one = meta_grad(maml(steps=1, autocast=f16, loss_scale=md.LossScale(init=2.0**10)), tasks=tasks)
    assert finite(skipped)
    assert all(torch.equal(skipped[k], one[k]) for k in one)


def test_the_unscaled_path_still_raises_on_an_overflow():
    def huge(prediction, target):
        return 1e8 * P.loss_fn(prediction, target)

    with pytest.raises(FloatingPointError, match="not finite"):
        meta_grad(maml(autocast=torch.float16, loss_scale=None), huge)


def test_scaling_keeps_small_float16_gradients():
    # A loss of order 1e-6 (the sinusoid MSE times 1e-6; the inner rate times 1e6, so the
    # adaptation is the same): its activations' gradients are near or below float16's
    # smallest normal number (6e-5) and lose their digits or round to zero. The meta-loss is
    # scaled by 2**16 for the outer backward in both runs (as GradScaler would), so only the
    # inner steps differ. Measured relative errors against float64 (max |error| / max |grad|):
    # unscaled 8.3e-2, scaled (LossScale(), 2**10) 5.1e-4; bfloat16 gives 4.1e-3, float32 1e-7.
    def tiny(prediction, target):
        return 1e-6 * P.loss_fn(prediction, target)

    lr = P.inner_lr * 1e6
    p64 = dataclasses.replace(P, dtype=torch.float64)
    want = meta_grad(maml(p64, lr=lr), tiny, tasks=p64.tasks())

    def error(loss_scale) -> float:
        got = meta_grad(maml(lr=lr, autocast=torch.float16, loss_scale=loss_scale), tiny, outer=2.0**16)
        top = max(float(w.abs().max()) for w in want.values())
        return max(float((got[k].double() - want[k]).abs().max()) for k in want) / top

    unscaled, scaled = error(None), error(md.LossScale())
    assert unscaled > 2e-2
    assert scaled < 2e-3


# --- two processes ------------------------------------------------------------------------


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))


def _support() -> tuple[torch.Tensor, torch.Tensor]:
    # The second half's targets are 3000: at a scale of 2**10 the gradient of its predictions
    # (2 * 3000 / 8 * 1024, about 8e5) overflows float16; the first half's (about 300) does not.
    x = torch.linspace(-1, 1, 8).unsqueeze(1)
    y = torch.ones(8, 1)
    y[4:] = 3000.0
    return x, y


def _mse(prediction, target):
    return ((prediction.float() - target) ** 2).flatten(1).mean(1)


def _split_steps(reduce=None) -> dict:
    """Two scaled inner steps (scale 2**10, then 2**0 after an overflow) on this rank's half
    of the support batch: whether this rank's own gradient was finite at step 0, the scale
    after each step, and the fast weights' displacement."""
    rank, world = (md.rank(), md.world_size()) if reduce is not None else (0, 1)
    net = _net()
    x, y = _support()
    shard = md.Batch.split(x, y, rank, world)
    params = md.params_of(net)
    opt = md.sgd(0.1)
    state = opt.init(params)
    scale = md.LossScale(init=2.0**10, backoff=2.0**-10).start(x)
    fast, scales, local_finite = dict(params), [], None
    with torch.autocast("cpu", dtype=torch.float16):
        for step in range(2):
            weights = scale.watch(fast)
            loss = md.batch_share(net, weights, shard, _mse)
            if step == 0:
                own = torch.autograd.grad(scale.value * loss, list(weights.values()), retain_graph=True)
                local_finite = all(bool(torch.isfinite(g).all()) for g in own)
            fast, state = md.inner_step(loss, fast, state, opt, step=step, reduce=reduce, scale=scale)
            scales.append(float(scale.value))
    return {"local_finite": local_finite, "scales": scales,
            "moved": {k: (fast[k] - params[k]).detach() for k in params}}


def _two_ranks() -> dict:
    return _split_steps(md.all_reduce_sum)


def test_every_rank_that_splits_a_task_skips_together():
    ranks = run_local(_two_ranks, 2, threads=1)
    whole = _split_steps()
    # Rank 0's own gradient is finite, rank 1's is not: a local decision would step on rank
    # 0 only. The reduced gradient decides: both skip step 0 and back off to 2**0.
    assert [r["local_finite"] for r in ranks] == [True, False]
    assert whole["scales"] == [1.0, 1.0]
    for r in ranks:
        assert r["scales"] == whole["scales"]
        for k, moved in whole["moved"].items():
            assert moved.abs().max() > 0  # step 1 was taken
            # float16 forward passes: the two shards' sums round differently from the whole's.
            torch.testing.assert_close(r["moved"][k], moved, rtol=1e-2, atol=1e-3 * float(moved.abs().max()))
    assert all(torch.equal(ranks[0]["moved"][k], ranks[1]["moved"][k]) for k in whole["moved"])
