"""What a training run says of its settings and algorithm: --show-settings, the help's table of
per-task defaults, the start and resume lines, refusals of a task/algorithm mismatch, and the
words of the plots per algorithm."""

import dataclasses
import math

import pytest

from metaddp.cli import main
from metaddp.train import TrainConfig

TINY = ["--steps", "2", "--hidden", "8", "--meta-batch", "2", "--eval-tasks", "3", "--no-progress"]


def test_show_settings_prints_the_task_defaults_and_the_flags_given(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "sinusoid", "--show-settings", "--shots", "3"]) == 0
    out = capsys.readouterr().out
    # sinusoid's own defaults (tasks/sinusoid.py), with the flag applied
    assert "maml on sinusoid: steps 1000, meta_batch 25, inner_steps 1, inner_lr 0.01" in out
    assert "shots 3, query 10, hidden 40" in out
    assert "checkpoint every 100 steps" in out
    assert not (tmp_path / "runs").exists()


def test_help_shows_each_task_defaults_and_algorithms(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("sinusoid "))
    assert row[:5] == ["sinusoid", "25", "1", "0.01", "0.001"]
    assert "noisy-digits" in out and "all but protonet, protomaml, reweight, erm" in out
    # Each default said once, in words that read (the memory mode named "default" included).
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}
    assert not [k for k, text in helps.items() if "(default: default)" in text]
    assert helps["memory"].startswith("default (the default; noisy-run: replay): keep every")


def test_an_algorithm_that_does_not_fit_the_task_is_one_line(capsys):
    assert main(["train", "sinusoid", "--algorithm", "reweight"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["metaddp train: error: reweight does not train sinusoid: sinusoid takes "
                   "maml, fomaml, metasgd, anil, reptile, imaml, mamlpp, boil"]
    assert TrainConfig.algorithms_for("noisy-digits")[-2:] == ("reweight", "erm")
    assert not {"protonet", "protomaml"} & set(TrainConfig.algorithms_for("noisy-digits"))


def test_a_run_says_its_settings_and_a_resume_its_step(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "sinusoid", *TINY, "--eval-every", "0", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.splitlines()[0].startswith("maml on sinusoid: steps 2, meta_batch 2, inner_steps 1")
    assert "at the end only (eval_every 0)" in said
    assert main(["train", "--resume", str(out), "--steps", "3", "--no-progress"]) == 0
    assert f"resumed from step 2 ({out / 'checkpoint.pt'})" in capsys.readouterr().out
    assert main(["train", "digits", "--resume", str(out), "--steps", "4"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"metaddp train: error: the run in {out} is a sinusoid run; this command trains "
        "digits: drop the task name to continue it, or give another --out"
    ]


def _rows(n):
    return [
        dict(step=s, meta_loss=1.0 / s, test_before=2.0, test_after=1.5, test_after_ci=0.25,
             test_acc_before=0.2, test_acc_after=0.6, test_acc_after_ci=0.05)
        if s == n else
        dict(step=s, meta_loss=1.0 / s, test_before=math.nan, test_after=math.nan,
             test_after_ci=math.nan, test_acc_before=math.nan, test_acc_after=math.nan,
             test_acc_after_ci=math.nan)
        for s in range(1, n + 1)
    ]


def test_plot_words_fit_the_algorithm(tmp_path):
    pytest.importorskip("matplotlib")
    from metaddp.train._plots import training_curves

    meta = training_curves(_rows(10), tmp_path / "a.png", classification=True, metric="loss",
                           title="maml on glyphs")
    assert meta["title"] == "meta-test on held-out classes"
    assert meta["labels"] == ["before adaptation", "after adaptation (95% CI)"]
    plain = training_curves(_rows(10), tmp_path / "b.png", classification=True, metric="loss",
                            title="reweight on noisy-digits", adapts=False)
    assert plain["title"] == "test on held-out data, as trained"
    assert plain["labels"] == ["as trained (95% CI)"]
    sine = training_curves(_rows(3), tmp_path / "c.png", classification=False, metric="MSE",
                           title="maml on sinusoid")
    assert sine["title"] == "meta-test on held-out tasks" and sine["ylabel"] == "query MSE"
    assert "classes" not in sine["title"]
