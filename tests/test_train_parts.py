"""Small parts of training: the confidence interval, checkpoints, metrics on resume."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from metaddp.train import _checkpoint
from metaddp.train._metrics import MetricsLog, mean_ci95, read


def test_mean_ci95_is_the_normal_interval():
    values = [0.2, 0.9, 0.4, 0.7, 0.55, 0.61]
    mean, half = mean_ci95(values)
    assert mean == pytest.approx(statistics.fmean(values), rel=1e-15)
    assert half == pytest.approx(1.96 * statistics.stdev(values) / math.sqrt(6), rel=1e-14)
    assert math.isnan(mean_ci95([3.0])[1])


def test_checkpoint_round_trip_and_refusals(tmp_path):
    path = tmp_path / "c.pt"
    config = {"task": "sinusoid", "seed": 1, "steps": 10}
    model = {"w": torch.arange(3.0)}
    _checkpoint.save(path, step=4, config=config, model=model, optimizer={"state": {}, "param_groups": []})
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left behind
    state = _checkpoint.load(path, {"task": "sinusoid", "seed": 1})
    assert state["step"] == 4 and torch.equal(state["model"]["w"], model["w"])
    with pytest.raises(_checkpoint.CheckpointError, match="seed: checkpoint 1, now 2"):
        _checkpoint.load(path, {"task": "sinusoid", "seed": 2})
    torch.save({"w": torch.zeros(1)}, tmp_path / "foreign.pt")
    with pytest.raises(_checkpoint.CheckpointError, match="not a metaddp training checkpoint"):
        _checkpoint.load(tmp_path / "foreign.pt", {})
    # A failed write leaves the old checkpoint as it was.
    before = path.read_bytes()

    def fail(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _checkpoint.atomic_write(path, fail)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "foreign.pt"]


def test_metrics_on_resume_keep_rows_up_to_the_checkpoint(tmp_path):
    log = MetricsLog(tmp_path, 0, tensorboard=False)
    for step in range(1, 6):
        log.write({"step": step, "meta_loss": 1.0 / step, "seconds": 0.5 * step})
    log.write({"step": 6, "meta_loss": 0.1, "seconds": 3.0, "test_before": 2.0, "test_after": 1.0})
    log.close()
    resumed = MetricsLog(tmp_path, 4, tensorboard=False)
    assert resumed.seconds == 2.0
    resumed.write({"step": 5, "meta_loss": 0.25, "seconds": 2.5})
    resumed.close()
    rows = read(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["meta_loss"] for r in rows] == [1.0, 0.5, 1 / 3, 0.25, 0.25]
    assert all(math.isnan(r["test_after"]) for r in rows)
    log = MetricsLog(tmp_path, 5, tensorboard=False)
    with pytest.raises(KeyError, match="unknown metric"):
        log.write({"step": 6, "accuracy": 1.0})
    log.close()


def test_older_checkpoints_are_kept_and_a_damaged_newest_falls_back(tmp_path):
    path = tmp_path / "checkpoint.pt"
    model = {"w": torch.zeros(2)}
    for step in (2, 4, 6, 8):
        _checkpoint.save(path, step=step, config={"seed": 1}, model=model,
                         optimizer={"state": {}, "param_groups": []})
    # The newest three are kept, newest first.
    assert [int(_checkpoint.load(p, {})["step"]) for p in _checkpoint.history(path)] == [8, 6, 4]
    path.write_bytes(b"torn")  # the newest is damaged (a disk error, a copy cut short)
    with pytest.warns(RuntimeWarning, match="corrupt or unreadable.*; resuming from checkpoint.1.pt \\(step 6\\)"):
        state = _checkpoint.load_latest(path, {"seed": 1})
    assert state["step"] == 6
    # Another configuration is never a reason to fall back: that is the wrong run.
    with pytest.raises(_checkpoint.CheckpointError, match="seed: checkpoint 1, now 2"):
        _checkpoint.load_latest(tmp_path / "checkpoint.1.pt", {"seed": 2})
