"""Every algorithm the training command offers trains, and its meta-test uses adapted weights."""

import dataclasses
import math

import pytest

from metaddp import train as _train
from metaddp.train import TrainConfig

CFG = TrainConfig(task="sinusoid", steps=3, meta_batch=3, inner_steps=2, inner_lr=0.05,
                  outer_lr=0.01, shots=6, query=5, hidden=16, dtype="float64",
                  eval_every=0, eval_tasks=4, eval_steps=3, checkpoint_every=3)


# Prototypes need classes: these train on digits (the digits extra), 3-way 1-shot.
CLASSIFIERS = ("protonet", "protomaml")
IMAGES = TrainConfig(task="digits", steps=3, meta_batch=2, inner_steps=2, ways=3, shots=1,
                     query=2, hidden=4, dtype="float64", eval_every=0, eval_tasks=4,
                     eval_steps=2, checkpoint_every=3)


# Reweighting and plain training adapt nothing: they train noisy-digits (test_reweighting.py),
# and sinusoid refuses them (test_train_words.py).
@pytest.mark.parametrize("name", TrainConfig.algorithms_for("sinusoid"))
def test_algorithm_trains_and_adapts_at_meta_test(name, tmp_path):
    cfg = dataclasses.replace(CFG, algorithm=name)
    if name == "imaml":
        # Gradient descent on the proximal objective is stable for inner_lr * lam < 2.
        cfg = dataclasses.replace(cfg, lam=20.0)
    cfg = cfg.resolved()
    _train.prepare_folder(tmp_path, cfg, False, force=False)
    r = _train.train(cfg, tmp_path, progress=False)
    assert len(r["losses"]) == 3 and all(math.isfinite(l) for l in r["losses"])
    before, after = r["final"]["test_before"], r["final"]["test_after"]
    # Three SGD steps on 6 support points of a sinusoid move the query MSE by far more than
    # rounding (float64): equal numbers would mean the adapted weights were never used, as
    # when fast weights are named for a sub-module that the evaluation does not call.
    assert after < before and (before - after) / before > 1e-3


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_prototype_algorithms_train_on_classes(name, tmp_path):
    pytest.importorskip("sklearn")
    cfg = dataclasses.replace(IMAGES, algorithm=name).resolved()
    _train.prepare_folder(tmp_path, cfg, False, force=False)
    r = _train.train(cfg, tmp_path, progress=False)
    assert len(r["losses"]) == 3 and all(math.isfinite(l) for l in r["losses"])
    f = r["final"]
    assert 0 <= f["test_acc_after"] <= 1
    if name == "protonet":  # no inner steps: the prototypes are its adaptation
        assert f["test_after"] == f["test_before"]
    else:  # two steps from the prototypes' head move the query loss
        assert abs(f["test_after"] - f["test_before"]) > 1e-6


def test_prototype_algorithms_refuse_regression():
    with pytest.raises(ValueError, match="protonet scores classes.*not sinusoid"):
        dataclasses.replace(CFG, algorithm="protonet").resolved()


def test_cosine_outer_schedule_is_a_function_of_the_step(tmp_path):
    cfg = dataclasses.replace(CFG, algorithm="mamlpp", outer_schedule="cosine", steps=4).resolved()
    assert [cfg.outer_lr_at(s) for s in range(4)] == pytest.approx(
        [0.01 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(4)])
    assert dataclasses.replace(cfg, outer_schedule="constant").outer_lr_at(3) == 0.01
    with pytest.raises(ValueError, match="unknown outer schedule 'linear'"):
        dataclasses.replace(CFG, outer_schedule="linear").resolved()
    # The trainer sets it at every step and tells MAML++ the step.
    _train.prepare_folder(tmp_path, cfg, False, force=False)
    t = _train.Trainer(cfg, tmp_path)
    t.step(2)
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(cfg.outer_lr_at(2))
    assert t.algorithm.meta_step == 2


def test_inner_clip_reaches_the_inner_optimizer():
    cfg = dataclasses.replace(CFG, inner_clip=0.5, inner_lr=1.0).resolved()
    opt = cfg.algorithm_settings().inner_optimizer()(1.0)  # clip, then sgd at rate 1
    import torch

    g = {"w": torch.full((4,), 5.0, dtype=torch.float64)}  # norm 10
    updates, _ = opt.update(g, opt.init(g), g)
    assert float(updates["w"].norm()) == pytest.approx(0.5, rel=1e-6)  # 0.5 / (10 + 1e-6) * 10
    with pytest.raises(ValueError, match="inner_clip must be a norm > 0"):
        dataclasses.replace(CFG, inner_clip=0.0).resolved()
    with pytest.raises(ValueError, match="inner_clip is a setting of"):
        dataclasses.replace(IMAGES, inner_clip=1.0, algorithm="protonet").resolved()
