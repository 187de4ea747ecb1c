"""Training faults: a diverging run stops at the failing step, names the likely cause and keeps
the last good checkpoint; a stop signal ends the step on every rank and checkpoints."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from metaddp import train as _train
from metaddp.train import TrainConfig
from metaddp.train._metrics import read
from metaddp.train._trainer import NonFiniteError

CFG = TrainConfig(task="sinusoid", steps=6, meta_batch=4, shots=5, query=5, hidden=8,
                  eval_every=0, eval_tasks=4, checkpoint_every=2).resolved()


def run(cfg: TrainConfig, out: Path) -> str:
    _train.prepare_folder(out, cfg, False, force=False)
    try:
        _train.train(cfg, out, progress=False)
    except NonFiniteError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("setting,value,cause", [
    ("outer_lr", 1e30, "lower the outer learning rate (--outer-lr 1e+30)"),
    ("inner_lr", 1e6, "lower the inner learning rate (--inner-lr 1e+06)"),
])
def test_a_diverging_run_stops_at_once_and_names_the_cause(tmp_path, setting, value, cause):
    cfg = dataclasses.replace(CFG, **{setting: value})
    msg = run(cfg, tmp_path)
    assert msg.startswith("training stopped at step "), msg
    assert cause in msg, msg
    step = int(msg.split("step ")[1].split(":")[0])
    rows = read(tmp_path / "metrics.csv")
    # Every row written is a finite step before the failing one; none is a NaN row.
    assert [int(r["step"]) for r in rows] == list(range(1, step))
    assert all(math.isfinite(r["meta_loss"]) for r in rows)
    if step > 2:  # a checkpoint was due at step 2: it holds finite weights
        state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
        assert f"the last checkpoint holds step {state['step']}" in msg
        assert all(bool(torch.isfinite(v).all()) for v in state["model"].values())
    assert not (tmp_path / "summary.json").exists()  # no summary, no plot of a broken run


def test_the_divergence_advice_works_as_printed(tmp_path, capsys):
    """The message says how to try again; doing exactly that (the setting changed, --force,
    the same folder, a path with a space) trains."""
    from metaddp.cli import main

    out = tmp_path / "a run"
    common = ["train", "sinusoid", "--steps", "4", "--meta-batch", "2", "--shots", "4", "--query", "3",
              "--hidden", "8", "--eval-every", "0", "--eval-tasks", "2", "--checkpoint-every", "2",
              "--no-progress", "--out", str(out)]
    assert main([*common, "--outer-lr", "1e30"]) == 3
    err = capsys.readouterr().err
    assert "run the same command with the setting changed and --force" in err, err
    assert f"'{out}'" in err  # quoted: it has a space
    assert main([*common, "--outer-lr", "0.001", "--force"]) == 0
