"""Deterministic mode: float32 meta-gradients, losses and training runs bit-identical at 1-4
processes, in every layout, with uneven and empty shards.

Every comparison here is ``torch.equal`` or ``==``, never a tolerance, except the accuracy
against float64. Deterministic MetaDDP turns oneDNN off for the process, so the spawned checks
run last in each world size's process group (``workers.deterministic``, through the session
fixture ``worlds``), and the one-process tests at the end put the switch back.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import pytest
import torch

import reference
import workers
from metaddp._data import Chunks
from metaddp.distributed import _fixed
from metaddp.distributed.launch import run_local
from metaddp.testing import scenarios as S
from workers import CASES_DETERMINISTIC as CASES

F32 = torch.float32


@pytest.fixture(scope="module")
def runs(worlds):
    """The deterministic part of every world size's results (tests/conftest.py ``worlds``)."""
    return {"root": worlds["root"], **{w: [r["deterministic"] for r in worlds[w]]
                                       for w in (1, 2, 3, 4)}}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_meta_gradient_is_bit_identical_at_every_world_size(runs, case, world):
    one = runs[1][0]["cases"][case]
    for rank_result in runs[world]:  # and on every rank
        got = rank_result["cases"][case]
        assert got["loss"] == one["loss"]
        assert set(got["grads"]) == set(one["grads"])
        for k, g in one["grads"].items():
            assert torch.equal(got["grads"][k], g), (case, world, k)


def test_default_mode_is_not(runs):
    """Guards the comparison: in float32 the default mode's bits change with the split."""
    one = runs[1][0]["default"]["grads"]
    assert any(not torch.equal(runs[w][0]["default"]["grads"][k], g)
               for w in (2, 3, 4) for k, g in one.items())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_with_different_settings_fail_before_the_step(runs, world):
    for rank_result in runs[world]:
        assert rank_result["settings_differ"].startswith(
            "the ranks' algorithms have different settings"), rank_result["settings_differ"]


def max_rel(grads, ref) -> float:
    return (max(float((grads[k].double() - ref[k]).abs().max()) for k in ref)
            / max(float(g.abs().max()) for g in ref.values()))


@pytest.mark.parametrize("case", ["mlp-sample", "mlp-1st-empty", "conv-bn-sample"])
def test_accuracy_against_float64(runs, case):
    """As accurate as the default float32 mode or better, and within 1e-6 (max-abs scaled)."""
    p64 = CASES[case]
    _, ref = reference.maml_meta_grad(p64.build_model(), p64.tasks(), steps=p64.steps,
                                      inner_lr=p64.inner_lr, first_order=p64.first_order,
                                      classification=p64.model == "conv")
    det = max_rel(runs[1][0]["cases"][case]["grads"], ref)
    default = max_rel(S.run(dataclasses.replace(p64, dtype=F32))["grads"], ref)
    # float32 rounds at 6e-8; a few inner steps of these nets amplify it to ~1e-7. The
    # fixed-point sums add at most 2e-13 of the largest summand.
    assert det < 1e-6
    assert det <= 2 * default, (det, default)


def test_dropout_chunks_draw_the_loops_masks(runs):
    """Each chunk keys its masks by its samples' global indices: the float64 loop's
    meta-gradient, to float32's rounding (with other masks it is 0.1 to 1 off)."""
    got = runs[1][0]["cases"]["transformer-hybrid"]
    want = S.run(CASES["transformer-hybrid"])
    # float32 rounds at 6e-8; two inner steps through attention and layer norm amplify it.
    assert max_rel(got["grads"], want["grads"]) < 1e-5
    assert abs(got["loss"] - want["loss"]) < 1e-6 * abs(want["loss"])


def without_seconds(path: Path) -> list[dict]:
    rows = csv.DictReader(path.read_text().splitlines())
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


@pytest.mark.parametrize("world", [2, 4])
def test_training_run_is_bit_identical(runs, world):
    one = runs[1][0]["full"]
    for rank_result in runs[world]:
        got = rank_result["full"]
        assert got["losses"] == one["losses"]
        assert got["final"] == one["final"]
        for k, w in one["weights"].items():
            assert torch.equal(got["weights"][k], w), k
    root = runs["root"]
    assert (without_seconds(root / f"w{world}" / "full" / "metrics.csv")
            == without_seconds(root / "w1" / "full" / "metrics.csv"))


def test_resume_on_another_process_count_is_bit_identical(runs):
    one, cross = runs[1][0]["full"], runs[2][0]["cross"]
    assert cross["start"] == 10
    assert cross["losses"] == one["losses"][10:]
    for k, w in one["weights"].items():
        assert torch.equal(cross["weights"][k], w), k
    root = runs["root"]
    assert (without_seconds(root / "w2" / "cross" / "metrics.csv")
            == without_seconds(root / "w1" / "full" / "metrics.csv"))


# --- the fixed-point sum itself, on one process ---


def test_fixed_sum_does_not_depend_on_order():
    g = torch.Generator().manual_seed(0)
    # Magnitudes over 12 decades: a float sum of these depends on its order.
    x = torch.randn(3, 12, 5, generator=g) * 10.0 ** torch.randint(-6, 6, (3, 12, 1), generator=g)
    perm = torch.randperm(12, generator=g)
    assert not torch.equal(x.sum(1), x[:, perm].sum(1))  # guards the example
    whole = _fixed.fixed_sum([x], None)[0]
    assert torch.equal(_fixed.fixed_sum([x[:, perm]], None)[0], whole)
    truth = x.double().sum(1)
    scale = x.double().abs().amax(1)
    # Each of the 12 summands is rounded to a grid of 2**-33 of its row's largest or finer
    # (moved by at most half of it), the exact total then rounded once to float32 (2**-24).
    assert ((whole.double() - truth).abs() <= 12 * scale * 2**-34 + truth.abs() * 2**-24).all()
    # Not merely within the bound: the rounding is far finer than float32's.
    assert ((whole.double() - truth).abs() / scale).max() < 2**-23


def test_fixed_sum_keeps_float64_precision():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 12, 5, generator=g, dtype=torch.float64)
    x = x * 10.0 ** torch.randint(-12, 12, (3, 12, 1), generator=g)
    perm = torch.randperm(12, generator=g)
    whole = _fixed.fixed_sum([x], None)[0]
    assert torch.equal(_fixed.fixed_sum([x[:, perm]], None)[0], whole)
    truth = torch.tensor([[math.fsum(x[r, :, j].tolist()) for j in range(5)] for r in range(3)],
                         dtype=torch.float64)
    scale = x.abs().amax(1)
    # float64 summands are summed in two parts, the second on a grid 2**-33 times finer:
    # each summand moves by at most 2**-66 of its row's largest, then one float64 rounding
    # (2**-53) of the exact total. A single float32-style grid would be 2**-34 off.
    assert ((whole - truth).abs() <= 12 * scale * 2**-66 + truth.abs() * 2**-53).all()


def test_fixed_sum_marks_non_finite_entries():
    x = torch.ones(2, 3, 4)
    x[1, 2, 0] = float("inf")
    x[1, 0, 2] = float("nan")
    x[0, :, 3] = torch.tensor([1e-40, 3e-41, 0.0])  # subnormal summands: summed exactly
    out = _fixed.fixed_sum([x], None)[0]
    assert torch.equal(out[0], torch.stack([*torch.full((3,), 3.0), x[0, 0, 3] + x[0, 1, 3]]))
    assert out[0, 3] > 0
    assert out[1].isfinite().tolist() == [False, True, False, True]
    assert torch.equal(out[1, [1, 3]], torch.full((2,), 3.0))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fixed_sum_out_of_step_is_named(dtype):
    # The scale's MAX carries the call tags (in uint8 for float32 summands, whose scales are
    # one byte each): a rank that skipped a collective is caught at this sum, on both ranks.
    said = run_local(workers.deterministic_sum_out_of_step, 2, dtype)
    for message in said:
        assert "out of step at a deterministic sum" in message, message


def test_chunks_depend_on_the_batch_alone():
    # 13 samples, at most 8 chunks: chunks of 2 (the last of 1), whatever the number of parts.
    assert Chunks.of(13, 8)[:3] == (13, 2, 7)
    for parts in (1, 2, 3, 4):
        held = [Chunks.of(13, 8, i, parts).samples for i in range(parts)]
        assert [i for r in held for i in r] == list(range(13))
        assert all(r.start % 2 == 0 for r in held)
    # 2 samples, 2 chunks of one, over 4 parts: two parts hold none.
    assert [len(Chunks.of(2, 8, i, 4).samples) for i in range(4)] == [0, 1, 0, 1]


# --- what the mode refuses, on one process ---


@pytest.fixture
def switches():
    """The mode sets process-wide kernel switches; put them back for the rest of the session."""
    saved = (torch.backends.mkldnn.enabled, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.backends.mkldnn.enabled = saved[0]
    torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[3:]


def learner_for(problem: S.Problem):
    from metaddp import MetaDDP
    return MetaDDP(problem.build_algorithm(), deterministic=True)


def test_algorithms_without_a_deterministic_form_say_so(switches):
    # Declared on the class (metaddp.Supports): refused when MetaDDP is built.
    import metaddp as md

    with pytest.raises(ValueError, match="Bilevel has no deterministic=True"):
        md.MetaDDP(md.Bilevel(torch.nn.Linear(2, 1), inner_lr=0.1), deterministic=True)
    # ANIL's chunks run its body at every step, where the default mode runs it once per task:
    # with dropout in it the masks would differ (0.86 relative at 2 steps), so it is refused.
    body = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.1))
    with pytest.raises(ValueError, match="deterministic ANIL runs its body on every chunk"):
        md.MetaDDP(md.ANIL(body, torch.nn.Linear(8, 1)), deterministic=True)


def test_hand_written_loops_and_a_missing_meta_loss_are_refused(switches):
    p = CASES["mlp-sample"]
    learner = learner_for(p)
    with pytest.raises(TypeError, match="not available in deterministic mode"):
        learner.clone()
    with pytest.raises(TypeError, match="not available in deterministic mode"):
        learner.grad(torch.zeros(()), [])
    with pytest.raises(RuntimeError, match="no meta_loss ran since the last sync_grads"):
        learner.sync_grads()


def test_shards_not_cut_into_chunks_are_refused(switches):
    p = CASES["mlp-sample"]
    learner = learner_for(p)
    # A shard of 6 of 13 samples: not what this rank's chunks hold (all 13 on one process).
    tasks = [t.split(0, 2) for t in p.tasks()[:2]]
    with pytest.raises(ValueError, match="learner.shard"):
        learner.meta_loss(tasks, p.loss_fn)


def test_running_statistics_are_refused(switches):
    # Refused when the learner is built, before any work.
    p = dataclasses.replace(CASES["conv-bn-sample"], running_stats=True)
    with pytest.raises(ValueError, match="track_running_stats=False"):
        learner_for(p)


def test_low_memory_and_autocast_are_refused(switches):
    from metaddp import MAML, MetaDDP

    p = CASES["mlp-sample"]
    for options in ({"memory": "low"}, {"autocast": torch.bfloat16}):
        # Refused when the learner is built, before any work.
        with pytest.raises(ValueError, match="memory='default' and no autocast"):
            MetaDDP(MAML(p.build_model(), **options), deterministic=True)
        # A setting changed afterwards is refused at the next meta-step.
        alg = MAML(p.build_model())
        learner = MetaDDP(alg, deterministic=True)
        for k, v in options.items():
            setattr(alg, k, v)
        with pytest.raises(ValueError, match="memory='default' and no autocast"):
            learner.meta_loss(learner.shard(2, p.task), p.loss_fn)
        learner.release()


def test_memory_modes_that_run_the_default_loop_are_deterministic_and_stacked_tasks_are_refused(switches):
    from metaddp import MAMLPlusPlus, MetaDDP, Reptile

    p = CASES["mlp-sample"]
    # Reptile's memory="low" is its default loop (first-order steps, nothing rebuilt): refused
    # before as if it kept every graph. Same operations, so the same bits.
    grads = []
    for memory in ("default", "low"):
        torch.manual_seed(0)
        learner = MetaDDP(Reptile(p.build_model(), inner_lr=0.1, steps=2, memory=memory), deterministic=True)
        learner.meta_loss(learner.shard(2, p.task), p.loss_fn).backward()
        grads.append([q.grad.clone() for q in learner.parameters()])
        learner.release()
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    # MAML++ with batched=True: the chunks are stacked by the mode itself, as MAML's refusal says.
    with pytest.raises(ValueError, match="batched=True would not apply"):
        MetaDDP(MAMLPlusPlus(p.build_model(), batched=True), deterministic=True)
