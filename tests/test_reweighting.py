"""``metaddp train noisy-digits``: data reweighting under label noise from the command line,
on two processes, resumed; its settings' refusals; the learned weights' figure."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from metaddp.cli import main

pytest.importorskip("sklearn")  # the digits (the digits extra)

SHORT = ["noisy-digits", "--steps", "40", "--eval-every", "20", "--checkpoint-every", "20",
         "--eval-tasks", "4", "--no-progress"]


def rows(folder: Path) -> list[dict]:
    with open(folder / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_reweighting_on_two_processes_resumes_and_matches_one(tmp_path, capsys):
    """Half the run on two processes, the rest resumed; the same run on one process: every
    step once, and the same test accuracy (the two differ only in the order of sums)."""
    two, one = tmp_path / "two", tmp_path / "one"
    half = [a if a != "40" else "20" for a in SHORT]
    assert main(["train", *half, "--algorithm", "reweight", "--nproc", "2", "--out", str(two)]) == 0
    assert main(["train", "--resume", str(two), "--steps", "40", "--nproc", "2", "--no-progress"]) == 0
    assert main(["train", *SHORT, "--algorithm", "reweight", "--out", str(one)]) == 0
    out = capsys.readouterr().out
    assert "test on 4 held-out batches" in out and "accuracy" in out
    assert [int(r["step"]) for r in rows(two)] == list(range(1, 41))
    a, b = (json.loads((f / "summary.json").read_text()) for f in (two, one))
    # 200 test images: one image is 0.005; rounding cannot move 40 float32 steps that far.
    assert abs(a["test_acc_after"] - b["test_acc_after"]) < 0.005
    assert a["test_acc_after"] > 0.3  # 40 steps from 0.1 (chance) on ten classes
    if (one / "plots").is_dir() and (one / "plots" / "training.png").exists():
        assert (one / "plots" / "weights.png").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["sinusoid", "--noise", "0.2"], "noise is a setting of noisy-digits"),
        (["noisy-digits", "--noise", "0.95"], "fraction of flipped labels"),
        (["noisy-digits", "--eval-steps", "1"], "eval_steps must be 0"),
        (["noisy-digits", "--ways", "5"], "all ten digits"),
        (["noisy-digits", "--method", "neumann"], "method is the hypergradient of reweight"),
        (["noisy-digits", "--algorithm", "reweight", "--method", "neumann", "--memory", "low"],
         "memory='low'"),
        (["noisy-digits", "--eval-tasks", "13"], "12 test batches of held-out data"),
    ],
)
def test_settings_that_cannot_work_are_one_line(tmp_path, capsys, args, message):
    code = main(["train", *args, "--steps", "1", "--out", str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1
