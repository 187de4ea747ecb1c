"""Every algorithm the training command offers trains, and its meta-test uses adapted weights."""

import dataclasses
import math

import pytest

from metaddp import train as _train
from metaddp.algorithms import ALGORITHMS
from metaddp.train import TrainConfig

CFG = TrainConfig(task="sinusoid", steps=3, meta_batch=3, inner_steps=2, inner_lr=0.05,
                  outer_lr=0.01, shots=6, query=5, hidden=16, dtype="float64",
                  eval_every=0, eval_tasks=4, eval_steps=3, checkpoint_every=3)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
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
