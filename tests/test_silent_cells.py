"""Cells of algorithm x mode that used to give a silently different number, and now give the
one-process answer or an error that names the fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import metaddp as md
import silent_workers as W
from metaddp.distributed.launch import run_local
from metaddp.testing import scenarios as S

# --- random draws outside metaddp's keyed forwards ----------------------------------------


@pytest.mark.parametrize(
    "fn,args,layer",
    [
        (W.anil_clone, (), "model.body.2 (Dropout)"),
        (W.call_loop, (), "model.2 (Dropout)"),
        (W.call_loop, (True,), "model.2 (FunctionalDropout)"),
    ],
    ids=["anil-clone", "md.call-loop", "F.dropout-in-forward"],
)
@pytest.mark.parametrize("world,layout", [(2, "sample"), (3, "sample"), (2, "task")])
def test_dropout_in_a_hand_written_loop_is_refused_on_every_rank(fn, args, layer, world, layout):
    # These loops' forwards drew PyTorch's own masks from each process's generator: their
    # meta-gradient at 2 processes differed from 1 by 0.47 and 0.52 in the largest entry.
    # 8 samples over 3 ranks leaves one rank 2 samples, and the task layout a rank whole tasks.
    for out in run_local(fn, world, layout, 0.3, *args, threads=1):
        assert out["error"].startswith(f"{layer} draws random numbers where metaddp cannot key"), out
        assert "the meta-gradient would change with the number of processes" in out["error"]


@pytest.mark.parametrize("world", [2, 3])
def test_the_same_loops_without_draws_are_the_one_process_answer(world):
    # Dropout 0 (and, after a local() block that drew, eval mode): nothing is refused, and the
    # meta-gradient is one process's. Float64 with sums split differently: 1e-12 is far above
    # the few ulps of reordered sums of 8 samples, far below any different draw (1e-1).
    for fn in (W.anil_clone, W.call_loop):
        (want,) = run_local(fn, 1, "sample", 0.0, threads=1)
        for out in run_local(fn, world, "sample", 0.0, threads=1):
            torch.testing.assert_close(torch.tensor(out["grad"]), torch.tensor(want["grad"]), rtol=1e-12, atol=1e-12)
    (want,) = run_local(W.call_loop, 1, "sample", 0.3, threads=1)
    for out in run_local(W.call_loop, world, "sample", 0.3, threads=1):
        got, ref = torch.tensor(out["after local, eval"]["grad"]), torch.tensor(want["after local, eval"]["grad"])
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


# --- float16 loss scaling: scaled where it runs, refused where it cannot ------------------

P = S.Problem("mlp", steps=2, n_tasks=2, dtype=torch.float32)
P64 = dataclasses.replace(P, dtype=torch.float64)


def _tiny(prediction, target):
    # A loss of order 1e-6: its activations' gradients sit near float16's smallest normal.
    return 1e-6 * P.loss_fn(prediction, target)


def _meta_grad(alg, p: S.Problem, outer: float) -> dict[str, torch.Tensor]:
    alg.zero_grad(set_to_none=True)
    (alg.meta_loss(p.tasks(), _tiny) * outer).backward()
    return {k: g / outer for k, g in S.meta_gradient(alg).items()}


def _relative_error(got, want) -> float:
    top = max(float(w.abs().max()) for w in want.values())
    return max(float((got[k].double() - want[k]).abs().max()) for k in want) / top


def test_maml_plus_plus_scales_its_float16_inner_steps():
    # MAML++'s own loop ran float16 unscaled while its loss_scale said LossScale(): 0.20 off
    # float64 on this problem. The outer backward is scaled by 2**16 in both (GradScaler's
    # part). Measured: scaled 1.1e-3, unscaled 1.1e-1; the bounds sit between them.
    lr = P.inner_lr * 1e6

    def build(p, **kw):
        return md.MAMLPlusPlus(p.build_model(), inner_lr=lr, steps=2, per_step_bn=False, **kw)

    want = _meta_grad(build(P64), P64, 1.0)
    scaled = build(P, autocast=torch.float16)
    assert scaled.loss_scale == md.LossScale()
    unscaled = build(P, autocast=torch.float16)
    unscaled.loss_scale = None
    assert _relative_error(_meta_grad(scaled, P, 2.0**16), want) < 5e-3
    assert _relative_error(_meta_grad(unscaled, P, 2.0**16), want) > 2e-2


def test_an_overflowing_scale_skips_maml_plus_plus_and_protomaml_steps():
    # A scale of 2**120 overflows float16 at once: the step is skipped, so the meta-loss is the
    # query loss at the start (the meta-parameters; ProtoMAML's prototype head), bit for bit.
    huge = md.LossScale(init=2.0**120)
    alg = md.MAMLPlusPlus(P.build_model(), inner_lr=0.1, steps=1, per_step_bn=False, autocast=torch.float16)
    alg.loss_scale = huge
    tasks = P.tasks()
    with torch.autocast("cpu", dtype=torch.float16):
        start = sum(md.batch_share(alg.model, md.params_of(alg.model), t.query, P.loss_fn) for t in tasks) / len(tasks)
    assert torch.equal(alg.meta_loss(tasks, P.loss_fn).detach(), start.detach())

    c = S.Problem("conv", n_tasks=2, steps=1, dtype=torch.float32)
    proto = md.ProtoMAML(c.build_model(), ways=3, inner_lr=0.1, autocast=torch.float16)
    proto.loss_scale = huge
    tasks = c.tasks()
    with torch.autocast("cpu", dtype=torch.float16):
        want = sum(md.batch_share(proto.model, proto.start(t.support, reduce=md.identity_reduce), t.query,
                                  c.loss_fn) for t in tasks) / len(tasks)
    assert torch.equal(proto.meta_loss(tasks, c.loss_fn).detach(), want.detach())


def test_paths_without_loss_scaling_refuse_float16_scaling():
    net = P.build_model
    # memory="low" computes the meta-gradient inside meta_loss, where no scale reaches it (the
    # outer backward's neither): refused at construction, loss_scale=None too, not dropped.
    with pytest.raises(ValueError, match="memory='low' computes the meta-gradient inside"):
        md.MAML(net(), autocast=torch.float16, memory="low")
    with pytest.raises(ValueError, match=r"memory=Replay\(k=2, states=32\) computes the meta-gradient"):
        md.MAML(net(), autocast=torch.float16, memory=md.Replay(k=2), loss_scale=None)  # a replay tree
    assert md.MAML(net(), autocast=torch.float16, memory="low", first_order=True).loss_scale  # the loop
    # memory changed after construction: refused when set, and the mode stays as it was.
    later = md.MAML(net(), autocast=torch.float16, loss_scale=None, batched=False)
    with pytest.raises(ValueError, match="upstream gradient of one"):
        later.memory = "low"
    assert later.memory == "default"
    # autocast changed after memory: refused where the rebuilt loop would run.
    late = md.MAML(net(), memory="low", batched=False)
    late.autocast = torch.float16
    with pytest.raises(ValueError, match="upstream gradient of one"):
        late.meta_loss(P.tasks(), P.loss_fn)
    # clone()'s adapt(loss) steps on the caller's loss, unscaled.
    with pytest.raises(ValueError, match="clone\\(\\)'s adapt\\(loss\\) runs the inner steps without"):
        md.MAML(net(), autocast=torch.float16).clone()
    assert md.MAML(net(), autocast=torch.float16, loss_scale=None).clone() is not None
    assert md.MAML(net(), autocast=torch.bfloat16).clone() is not None


# --- settings a mode would drop -----------------------------------------------------------


@pytest.mark.parametrize(
    "kw,named",
    [
        ({"inner_loss": lambda p, y: (p - y).squeeze(-1) ** 2}, "inner_loss="),
        ({"weights": md.WeightNet(4)}, "weights="),
        ({"start": "current", "outer": nn.ParameterDict({"a": nn.Parameter(torch.zeros(1))})}, "start='current'"),
        ({"method": md.Truncated(1), "start": "current", "weights": md.WeightNet(4)}, "method=Truncated()"),
    ],
)
def test_bilevel_clone_refuses_what_its_adapt_would_drop(kw, named):
    # clone()'s adapt(loss) steps, unrolled, on the caller's loss: a problem that is more than
    # that lost its inner loss, weighting, start or method without a word (and failed far
    # away with "no rank produced a gradient").
    with pytest.raises(TypeError, match="has no clone") as e:
        md.Bilevel(nn.Linear(1, 1), **kw).clone()
    assert named in str(e.value)
    assert md.Bilevel(nn.Linear(1, 1)).clone() is not None


def test_deterministic_mode_refuses_batched_at_construction():
    # Deterministic mode stacks its own chunks: batched=True or False had no effect.
    for batched in (True, False):
        with pytest.raises(ValueError, match=f"batched={batched} would not apply"):
            md.MetaDDP(md.MAML(P64.build_model(), batched=batched), deterministic=True)
    with pytest.raises(ValueError, match="memory='default' and no autocast"):  # was at the first step
        md.MetaDDP(md.MAML(P64.build_model(), memory="low"), deterministic=True)
    md.MetaDDP(md.MAML(P64.build_model()), deterministic=True).release()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("where", ["meta_loss", "adapt"])
def test_a_draw_from_a_generator_of_the_model_own_is_refused_one_by_one(where, world):
    # torch.randn(x.shape, generator=self.g) in the forward: every process drew the same
    # numbers from its own copy of the generator for other samples. With batched=False the
    # meta-gradient at 2 processes was 0.067 off the one-process one (largest entry),
    # without an error; the default generators' states, compared, had not moved. Refused at
    # sync_grads on every rank of the first (checked) step, at any size, as a draw from
    # torch's default generator is at once.
    own = "the model or the loss function drew random numbers from a generator of its own"
    for out in run_local(W.noisy_forward, world, "generator", False, where, threads=1):
        assert out.get("error", "").startswith(own), out


@pytest.mark.parametrize("batched", [False, None])
@pytest.mark.parametrize("how", ["numpy", "random"])
def test_a_draw_from_numpy_or_python_in_a_forward_is_refused(how, batched):
    # Noise from np.random.randn in the forward gave a meta-gradient 0.069 (one by one) and
    # 0.094 (stacked: vmap does not see numpy) off the one-process one at 2 processes
    # (largest entry), silently; from random.gauss, 0.022 and 0.028. numpy's and Python's
    # global generators' states are compared on checked steps now, refused at sync_grads.
    drew = "the model or the loss function drew random numbers from a generator of its own"
    for out in run_local(W.noisy_forward, 2, how, batched, threads=1):
        assert out.get("error", "").startswith(drew), out


def test_a_draw_stacked_tasks_cannot_make_is_named_by_its_line():
    # Stacked (batched=None picks them for this model), torch.vmap refuses the draw; the
    # error said "(a dropout call)" for any draw. It now names the line of the forward.
    line = "x = x + 0.1 * torch.randn(x.shape, generator=self.g, dtype=x.dtype), silent_workers.py:"
    for out in run_local(W.noisy_forward, 2, "generator", None, threads=1):
        assert out["error"].startswith(f"the model or the loss function draws random numbers in the forward ({line}")


def test_a_draw_in_a_module_forward_run_by_clone_is_refused():
    # torch.randn in a module's own forward, which names no dropout: clone()'s forwards of it
    # were not hooked, and at 2 processes the meta-gradient was 0.049 off the one-process
    # one (largest entry), silently. A forward whose source may draw is hooked now.
    for out in run_local(W.noisy_clone, 2, "torch", threads=1):
        assert out.get("error", "").startswith("model (Noisy) draws random numbers where metaddp cannot key"), out
    # The same module drawing nothing ("none"): hooked, and the one-process answer (float64
    # sums of halves: 1e-12 above their last places, as above).
    (want,) = run_local(W.noisy_clone, 1, "none", threads=1)
    for out in run_local(W.noisy_clone, 2, "none", threads=1):
        torch.testing.assert_close(torch.tensor(out["grad"]), torch.tensor(want["grad"]), rtol=1e-12, atol=1e-12)


# --- a loss that reads a statistic of its own batch ---------------------------------------


STATISTIC_WHERE = ["stacked", "loop", "adapt", "bilevel", "stacked-bn", "stacked-dropout", "mamlpp-adapt",
                   "bilevel-adapt"]
STATISTIC_LOSSES = ["sum", "variance", "balanced"]


@pytest.fixture(scope="module")
def statistic_steps() -> dict[int, list[dict]]:
    # Every case in one process group per world size (the cases raise on every rank alike,
    # so the group stays in step from one to the next).
    cases = [(loss, where) for loss in STATISTIC_LOSSES for where in STATISTIC_WHERE]
    return {world: run_local(W.batch_statistics, world, cases, threads=1) for world in (2, 3)}


@pytest.mark.parametrize("where", STATISTIC_WHERE)
@pytest.mark.parametrize("loss", STATISTIC_LOSSES)
def test_a_loss_reading_its_batch_is_refused_where_ranks_split_samples(statistic_steps, loss, where):
    # L2RW's weights normalised by the batch's sum, a loss over the targets' variance, a
    # class-balanced loss: each rank's share saw its own shard's statistic, so the
    # meta-gradient moved with the number of processes (silently). Now every rank raises at
    # sync_grads, the empty-handed ones too (3 ranks: shards of 3, 3 and 2 samples).
    for world, ranks in statistic_steps.items():
        for rank in ranks:
            out = rank[(loss, where)]
            assert out.get("error", "").startswith("the loss function does not give one loss per sample"), (world, out)


def test_bilevel_weights_that_read_their_batch_are_refused_and_weights_of_each_loss_are_exact():
    # weights= normalised by the batch's sum: each rank normalised over its own shard, and
    # the meta-gradient moved with the number of processes (silently). Refused now; weights
    # of each sample's loss alone are the one-process meta-gradient (float64, 1e-12 as above).
    for out in run_local(W.bilevel_weights, 2, True, threads=1):
        assert out.get("error", "").startswith("the loss function does not give one loss per sample"), out
    (want,) = run_local(W.bilevel_weights, 1, False, threads=1)
    for world in (2, 3):
        for out in run_local(W.bilevel_weights, world, False, threads=1):
            got = torch.tensor(out["grad"])
            torch.testing.assert_close(got, torch.tensor(want["grad"]), rtol=1e-12, atol=1e-12)


def test_one_loss_function_on_tasks_of_other_lengths_is_no_false_alarm():
    # The ranks' loss functions are compared by their losses on made-up inputs of the real
    # ones' shapes: tasks of other sequence lengths on other ranks are not a mismatch. Float64,
    # 1e-12 as above.
    (want,) = run_local(W.varying_lengths, 1, "task", threads=1)
    for world, layout in ((2, "task"), (3, "task"), (2, "sample")):
        for out in run_local(W.varying_lengths, world, layout, threads=1):
            got = torch.tensor(out["grad"])
            torch.testing.assert_close(got, torch.tensor(want["grad"]), rtol=1e-12, atol=1e-12)


def test_the_same_loss_on_one_process_or_with_global_sums_is_exact():
    # One process: the batch is whole, its statistic is the task's (no check, no error). A
    # normalisation summed over the ranks (md.data.global_sums) is the one-process value at 2
    # and 3 processes: float64, 1e-12 as above.
    (one,) = run_local(W.batch_statistic, 1, "sum", "loop", threads=1)
    (want,) = run_local(W.global_statistic, 1, threads=1)
    torch.testing.assert_close(torch.tensor(one["grad"]), torch.tensor(want["grad"]), rtol=1e-12, atol=1e-12)
    for world in (2, 3):
        for out in run_local(W.global_statistic, world, threads=1):
            torch.testing.assert_close(torch.tensor(out["grad"]), torch.tensor(want["grad"]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("where", ["loop", "stacked"])
@pytest.mark.parametrize("last", [False, True], ids=["largest-first", "largest-last"])
@pytest.mark.parametrize("loss", ["target", "loss"])
def test_a_loss_over_its_batch_largest_is_refused_wherever_the_largest_sits(loss, last, where):
    # Each loss divided by the largest target (or the largest loss) of the rank's own 4
    # samples: at 2 processes the meta-gradient was 3e-3 (target) and 9e-4 (loss) off the
    # one-process one, without an error, where the largest sample came first in a rank's
    # part (the old check compared the first half alone, whose largest was the whole's).
    for out in run_local(W.extreme_sample, 2, loss, last, where, threads=1):
        assert out.get("error", "").startswith("the loss function does not give one loss per sample"), out


@pytest.mark.parametrize("loss", ["mean", "sum"])
def test_a_loss_averaged_or_summed_over_a_sample_outputs_is_no_false_alarm(loss):
    # Each sample's loss its own: the check passes, and 2 processes give the one-process
    # meta-gradient. float64: the sums of halves differ from the whole's in the last few
    # places, 1e-12 above them and far below any statistic of a part.
    for last in (False, True):
        (want,) = run_local(W.extreme_sample, 1, loss, last, threads=1)
        for out in run_local(W.extreme_sample, 2, loss, last, threads=1):
            torch.testing.assert_close(torch.tensor(out["grad"]), torch.tensor(want["grad"]), rtol=1e-12, atol=1e-12)


# --- state that differs across ranks -------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_a_checkpoint_loaded_on_rank_zero_after_wrapping_is_refused(world):
    # It was 1.1e-2 off, check=True too: the ranks ran different weights. The first (checked)
    # step compares every parameter's fingerprint before any work.
    for out in run_local(W.differing_state, world, "checkpoint", threads=1):
        assert out.startswith("OutOfSyncError: the ranks hold different values of"), out
        assert "at the start of meta-step 0" in out


def test_a_mode_a_layer_setting_or_frozen_parameter_set_on_one_rank_is_refused_on_every_rank():
    # One rank's model in eval mode ran without dropout there, silently; with BatchNorm, and a
    # parameter frozen on one rank, gloo aborted the processes (collectives of other sizes).
    # A checked step compares every module's training flag and every requires_grad first.
    for out in run_local(W.differing_modes, 2, threads=1):
        for case in ("dropout eval", "batchnorm eval", "dropout eval checked"):
            assert out[case].startswith("OutOfSyncError: the ranks run "), (case, out[case])
            assert "in different modes" in out[case], (case, out[case])
        assert "'model' (Sequential), 'model.0' (Linear), 'model.1' (Dropout)" in out["dropout eval"]
        assert out["batchnorm eval"].startswith("OutOfSyncError: the ranks run 'model.1' (BatchNorm1d) in")
        # A Dropout's p changed on one rank was 0.345 off, silently.
        for case, layer in (("dropout p", "'model.1' (Dropout): inplace=False, p=0."),
                            ("batchnorm momentum", "'model.1' (BatchNorm1d): affine=True")):
            assert out[case].startswith("OutOfSyncError: the ranks' layers have different "
                                        "settings"), (case, out[case])
            assert layer in out[case], (case, out[case])
        # A layer's own attributes are not settings: a hook's count or a note on one rank.
        assert out["attribute on a layer"] == "accepted", out["attribute on a layer"]
        assert out["attribute on one rank's layer"] == "accepted", out["attribute on one rank's layer"]
        for case in ("frozen", "frozen sharded"):
            assert out[case].startswith("OutOfSyncError: the ranks train different parameters: "
                                        "'model.0.bias' requires"), (case, out[case])


def test_a_parameter_frozen_on_one_rank_between_checked_steps_is_an_error_not_an_abort():
    # Between checked steps nothing is compared, but with the default overlapped sums the rank
    # that froze it refuses before the step's first collective (gloo aborted both processes).
    # The other rank learns of it from the closed connection within the 10 s timeout.
    frozen, other = run_local(W.frozen_alone, 2, timeout_s=10, threads=1)[::-1]
    assert frozen.startswith("ValueError: the set of trained parameters (requires_grad=True) "
                             "changed on this rank"), frozen
    assert other.startswith("CollectiveError"), other


def test_an_inner_rate_that_differs_by_rank_is_refused():
    # md.inner.sgd(0.1 + 1e-3 * rank): the optimizer's numbers are part of the settings, whose
    # digest the first step's check compares before any work (and tags the gradient SUM), so
    # ranks that differ fail there, each naming its own settings, instead of averaging.
    for rank, out in enumerate(run_local(W.differing_state, 2, "rate", threads=1)):
        assert out.startswith("OutOfSyncError: the ranks' algorithms have different settings"), out
        assert f"('lr', {0.1 + 1e-3 * rank})" in out, out


def test_a_non_finite_meta_gradient_is_an_error_before_any_optimizer_step():
    # It was a NaN meta-gradient without a word (the meta-loss finite). Now sync_grads raises
    # on every rank alike, at 1 process as at 2.
    for world in (1, 2):
        for out in run_local(W.nan_meta_gradient, world, threads=1):
            assert out.startswith("the meta-gradient is not finite (NaN or Inf) on some rank"), out
            assert "eps_root > 0" in out


def test_sharded_rows_saved_the_usual_way_refuse_to_load(tmp_path):
    # Rank 0's state_dict() loaded on every rank gave every rank rank 0's rows (99.7% off);
    # DCP given state_dict() instead of sharded_state_dict() the same (94.6%). A state_dict
    # taken outside gathered() now says it holds rows, and loading it is refused.
    for out in run_local(W.sharded_usual_checkpoint, 2, str(tmp_path), threads=1):
        for how in ("torch.save", "dcp", "copied"):
            assert out[how].startswith("RuntimeError: load_state_dict on sharded weights"), out[how]
            assert "learner.gathered()" in out[how]
        assert out["gathered"] == "accepted"


def test_hand_cut_parts_whose_starts_do_not_tile_the_batch_are_refused():
    # A start= off by one sample keyed another sample's dropout masks: 12% off, silently.
    # Checked steps sum the global indices the parts hold (and their squares), in the size
    # check's own collective. With the right starts the masks are the one-process ones
    # (float64; 1e-12 as above).
    for out in run_local(W.hand_cut_starts, 2, False, threads=1):
        assert out.get("error", "").startswith("OutOfSyncError: task 0's support batch's parts do not tile"), out
    (want,) = run_local(W.hand_cut_starts, 1, True, threads=1)
    for out in run_local(W.hand_cut_starts, 2, True, threads=1):
        torch.testing.assert_close(torch.tensor(out["grad"]), torch.tensor(want["grad"]), rtol=1e-12, atol=1e-12)


def test_a_weighting_network_read_by_closure_in_plain_training_is_refused():
    # Bilevel(train_inner=True) trains the model on its inner loss; a weighting network that
    # loss read by closure got no gradient at all, without a word. Given as weights= it is an
    # outer variable of the problem and nothing is refused.
    torch.manual_seed(0)
    net, weighting = nn.Linear(1, 1).double(), md.bilevel.WeightNet(4).double()
    x = torch.linspace(-1, 1, 8, dtype=torch.float64)[:, None]
    tasks = [md.Task(md.Batch(x, 2 * x, 8), md.Batch(x, 3 * x, 8))]

    def weighted(p, y):
        losses = W._mse(p, y)
        return weighting(losses.detach()) * losses

    alone = md.Bilevel(net, inner_loss=weighted, outer_loss=W._mse, start="current", train_inner=True)
    with pytest.raises(ValueError, match="reads 4 trained tensor"):
        alone.meta_loss(tasks)
    given = md.Bilevel(net, inner_loss=W._mse, outer_loss=W._mse, weights=weighting, start="current",
                       train_inner=True)
    given.meta_loss(tasks).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in weighting.parameters())


def test_running_statistics_moved_before_the_first_sum_are_no_false_alarm():
    # The weights' fingerprints compare buffers over the whole mesh only before any forward:
    # task groups move their own running statistics from the first meta-batch on.
    assert run_local(W.accumulated_running_statistics, 2, threads=1) == ["accepted", "accepted"]


def test_a_loss_reading_its_batch_is_refused_with_one_sample_per_rank():
    # Two samples at 2 processes: no rank can cut its part in two, so the one sample is
    # given twice (a batch's sum doubles). A variance offset by 1000 moves the losses by
    # 1e-4 only, and is refused too (64 float64 ulps, not 1e-3).
    for out in run_local(W.batch_statistic, 2, "sum", "loop", 2, threads=1):
        assert out.get("error", "").startswith("the loss function does not give one loss per sample"), out
    for out in run_local(W.batch_statistic, 2, "offset", "loop", threads=1):
        assert out.get("error", "").startswith("the loss function does not give one loss per sample"), out


def test_deterministic_mode_refuses_a_loss_reading_its_batch_on_any_number_of_processes():
    # Deterministic mode calls the loss on fixed chunks of a task's samples, on one process
    # too: a loss over its batch's largest loss gave the same bits at 1, 2 and 3 processes,
    # and 1400x the plain one-process meta-gradient, silently. Refused at sync_grads now.
    for world in (1, 2):
        for out in run_local(W.batch_statistic, world, "sum", "deterministic", threads=1):
            assert out.get("error", "").startswith("the loss function does not give one loss per sample"), out
        # A variance is NaN on a chunk's one sample: the inner gradient's check names it first.
        for out in run_local(W.batch_statistic, world, "variance", "deterministic", threads=1):
            assert "divides by a statistic of its batch, such as a variance" in out.get("error", ""), out
        for out in run_local(W.extreme_sample, world, "loss", False, "deterministic", threads=1):
            assert "deterministic mode cuts every task's samples into fixed chunks" in out.get("error", ""), out


def test_deterministic_mode_takes_a_loss_of_each_sample_alone():
    # No false alarm: losses averaged or summed over a sample's own outputs. Deterministic
    # mode sums in another order than the one-by-one loop: float64, 1e-12 as above.
    for loss in ("mean", "sum"):
        (want,) = run_local(W.extreme_sample, 1, loss, False, threads=1)
        for world in (1, 2):
            for out in run_local(W.extreme_sample, world, loss, False, "deterministic", threads=1):
                got = torch.tensor(out["grad"])
                torch.testing.assert_close(got, torch.tensor(want["grad"]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pick", [slice(None, 1), slice(1, 3), slice(None, None, 2)], ids=["[:1]", "[1:3]", "[::2]"])
@pytest.mark.parametrize("world,layout", [(2, "task"), (3, "task"), (2, "sample")])
def test_a_slice_of_a_meta_batch_is_the_slice_of_the_global_tasks(pick, world, layout):
    # batch[:1] was a tuple of this rank's own first task: in the task layout every rank kept
    # a task of its own, and the meta-gradient mixed tasks that no one process would. Now a
    # slice picks global tasks as on one process (float64, sums in another order: 1e-12).
    want = torch.tensor(W.sliced_reference(pick))
    for got in run_local(W.sliced_meta_batch, world, layout, pick, threads=1):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-12, atol=1e-12)
