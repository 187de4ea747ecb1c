"""``metaddp train`` from the command line: files written, settings, and refusals on bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

from metaddp.cli import main

TINY = ["sinusoid", "--steps", "3", "--meta-batch", "3", "--shots", "4", "--query", "3",
        "--hidden", "8", "--eval-every", "0", "--eval-tasks", "3", "--checkpoint-every", "2",
        "--dtype", "float64", "--no-progress"]


def rows(folder: Path) -> list[dict]:
    with open(folder / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_of(folder: Path, out: Path) -> Path:
    out.mkdir()
    for name, data in snapshot(folder).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    return out


def test_a_run_writes_its_folder(run_dir, capsys):
    names = {p.name for p in run_dir.iterdir()}
    assert {"checkpoint.pt", "config.toml", "config.json", "metrics.csv", "summary.json", "plots"} <= names
    assert [int(r["step"]) for r in rows(run_dir)] == [1, 2, 3]
    # Only the last step is evaluated (--eval-every 0).
    assert [r["test_after"] != "" for r in rows(run_dir)] == [False, False, True]
    with open(run_dir / "config.toml", "rb") as f:
        assert tomllib.load(f) == {k: v for k, v in json.loads((run_dir / "config.json").read_text()).items()
                                   if v is not None}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 3 and summary["test_after"] > 0
    pytest.importorskip("matplotlib")
    assert (run_dir / "plots" / "training.png").stat().st_size > 1000
    assert (run_dir / "plots" / "adaptation.png").stat().st_size > 1000


def test_refuses_to_overwrite_a_run(run_dir, capsys):
    before = snapshot(run_dir)
    assert main(["train", *TINY, "--out", str(run_dir)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert snapshot(run_dir) == before


def test_resume_refuses_another_configuration(run_dir, capsys):
    before = snapshot(run_dir)
    assert main(["train", "--resume", str(run_dir), "--shots", "5", "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "another configuration" in err and "shots: checkpoint 4, now 5" in err
    assert main(["train", "--resume", str(run_dir), "--steps", "2"]) == 2
    assert "at step 3, beyond --steps 2" in capsys.readouterr().err
    assert snapshot(run_dir) == before


def test_resume_continues_and_force_replaces(tmp_path, run_dir):
    out = copy_of(run_dir, tmp_path / "copy")
    assert main(["train", "--resume", str(out), "--steps", "5", "--no-progress"]) == 0
    got = rows(out)
    assert [int(r["step"]) for r in got] == [1, 2, 3, 4, 5]
    assert [r["meta_loss"] for r in got[:3]] == [r["meta_loss"] for r in rows(run_dir)]
    assert main(["train", *TINY, "--steps", "1", "--out", str(out), "--force"]) == 0
    assert [int(r["step"]) for r in rows(out)] == [1]


def test_corrupt_checkpoint_and_empty_resume(tmp_path, run_dir, capsys):
    out = tmp_path / "corrupt"
    out.mkdir()
    for name in ("config.json", "config.toml", "metrics.csv"):
        (out / name).write_bytes((run_dir / name).read_bytes())
    (out / "checkpoint.pt").write_bytes((run_dir / "checkpoint.pt").read_bytes()[:200])
    # No older checkpoint to fall back to: the error says it, without a warning before it.
    for damaged in ((run_dir / "checkpoint.pt").read_bytes()[:200], b"not a checkpoint"):
        (out / "checkpoint.pt").write_bytes(damaged)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert main(["train", "--resume", str(out)]) == 2
        assert "corrupt or unreadable" in capsys.readouterr().err
        assert not [w for w in seen if "checkpoint" in str(w.message)]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--resume", str(empty)]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_a_damaged_newest_checkpoint_is_warned_about_once_and_falls_back(tmp_path, run_dir):
    out = copy_of(run_dir, tmp_path / "damaged")
    (out / "checkpoint.pt").write_bytes(b"torn")  # step 3's; step 2's is checkpoint.1.pt
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["train", "--resume", str(out), "--steps", "4", "--no-progress"]) == 0
    said = [str(w.message) for w in seen if "checkpoint" in str(w.message)]
    assert len(said) == 1 and "; resuming from checkpoint.1.pt (step 2)" in said[0], said
    # Resumed from step 2: step 3 runs again, with the same loss as the first time.
    got = rows(out)
    assert [int(r["step"]) for r in got] == [1, 2, 3, 4]
    assert got[2]["meta_loss"] == rows(run_dir)[2]["meta_loss"]


def test_under_two_processes_a_damaged_checkpoint_is_one_line_once(tmp_path, run_dir):
    out = copy_of(run_dir, tmp_path / "damaged2")
    (out / "checkpoint.pt").write_bytes(b"torn")
    r = subprocess.run([sys.executable, "-m", "metaddp", "train", "--resume", str(out), "--steps", "4",
                        "--nproc", "2", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "checkpoint" in line and "corrupt" in line]
    assert len(said) == 1 and said[0].startswith("metaddp train: warning: "), r.stderr
    assert "warnings.warn" not in r.stderr  # no source line under it


def test_unknown_task_option_and_setting(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "mnist"])
    assert e.value.code == 2 and "invalid choice: 'mnist'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["train", "sinusoid", "--inner-lrr", "0.1"])
    assert e.value.code == 2 and "unrecognized arguments: --inner-lrr" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "x")]) == 2
    assert "name a task" in capsys.readouterr().err
    assert main(["train", "sinusoid", "--steps", "0", "--out", str(tmp_path / "y")]) == 2
    assert "steps must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    # Values no run can use: refused before the folder exists.
    for flags, said in ((["--timeout", "inf"], "--timeout must be between 0.1 and"),
                        (["--timeout", "1e-9"], "--timeout must be between 0.1 and"),
                        (["--seed", str(2**64)], "seed must be a 64-bit integer")):
        assert main(["train", "sinusoid", *flags, "--out", str(tmp_path / "z")]) == 2
        assert said in capsys.readouterr().err
        assert not (tmp_path / "z").exists()


def test_options_a_run_would_ignore_are_refused(tmp_path, run_dir, capsys):
    out = copy_of(run_dir, tmp_path / "run")
    assert main(["train", "--resume", str(out), "--force"]) == 2
    assert "--force replaces the run in --out and --resume continues it" in capsys.readouterr().err
    assert main(["train", "sinusoid", "--max-restarts", "1", "--out", str(tmp_path / "m")]) == 2
    assert "give --nproc 2 or more" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_cuda_graph_run_resumes_without_them_on_a_machine_without_cuda(tmp_path, run_dir, capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = copy_of(run_dir, tmp_path / "run")
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(saved, cuda_graphs=True)))
    assert main(["train", "--resume", str(out), "--steps", "4", "--no-progress"]) == 2
    assert "resume such a run with --no-cuda-graphs" in capsys.readouterr().err
    assert main(["train", "--resume", str(out), "--steps", "4", "--no-progress",
                 "--no-cuda-graphs"]) == 0
    assert [int(r["step"]) for r in rows(out)] == [1, 2, 3, 4]


def test_a_damaged_config_json_is_one_line(tmp_path, run_dir, capsys):
    out = copy_of(run_dir, tmp_path / "run")
    (out / "config.json").write_text("[1, 2]")
    assert main(["train", "--resume", str(out), "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected settings by name (a table), got a list" in err


def test_a_resume_without_config_json_takes_the_settings_from_the_checkpoint(tmp_path, run_dir):
    out = copy_of(run_dir, tmp_path / "run")
    (out / "config.json").unlink()
    with pytest.warns(UserWarning, match="config.json is missing: the settings come from the latest"):
        assert main(["train", "--resume", str(out), "--steps", "4", "--no-progress"]) == 0
    assert [int(r["step"]) for r in rows(out)] == [1, 2, 3, 4]
    assert json.loads((out / "config.json").read_text()) == dict(
        json.loads((run_dir / "config.json").read_text()), steps=4)


def test_a_resume_removes_what_killed_writes_left(tmp_path, run_dir):
    # A kill during a checkpoint write leaves its temporary file beside the checkpoints.
    out = copy_of(run_dir, tmp_path / "run")
    (out / ".checkpoint.pt.k2j4x.tmp").write_bytes(b"half a checkpoint")
    assert main(["train", "--resume", str(out), "--steps", "4", "--no-progress"]) == 0
    assert not list(out.glob(".*.tmp"))


def test_a_cut_metrics_row_is_left_out_on_resume(tmp_path, run_dir):
    # A full disk or a kill can cut the last row of metrics.csv short.
    out = copy_of(run_dir, tmp_path / "cut")
    with open(out / "metrics.csv", "a") as f:
        f.write("4,5.1e")
    cut = r"metrics.csv disagreed with the checkpoint at step 3 \(1 row\(s\) not whole\)"
    with pytest.warns(UserWarning, match=cut):
        assert main(["train", "--resume", str(out), "--steps", "4", "--no-progress"]) == 0
    assert [int(r["step"]) for r in rows(out)] == [1, 2, 3, 4]


def test_a_row_cut_to_its_first_digit_is_not_kept_as_a_step(tmp_path, run_dir):
    """A row whose first digits still parse ("301,..." cut to "3") was once kept as a bogus
    row for step 3: every row must hold every column and the next step."""
    out = copy_of(run_dir, tmp_path / "digit")
    with open(out / "metrics.csv", "a") as f:
        f.write("3")
    from metaddp.train._metrics import parse

    whole, bad = parse(out / "metrics.csv")
    assert [int(r["step"]) for r in whole] == [1, 2, 3] and bad == [5]
    with pytest.warns(UserWarning, match="1 row\\(s\\) not whole"):
        assert main(["train", "--resume", str(out), "--steps", "5", "--no-progress"]) == 0
    got = rows(out)
    assert [int(r["step"]) for r in got] == [1, 2, 3, 4, 5]
    seconds = [float(r["seconds"]) for r in got]
    assert seconds == sorted(seconds), "the clock continues, it does not restart at 0"


def test_a_metrics_file_cut_in_the_middle_is_rebuilt_from_the_checkpoint(tmp_path, run_dir):
    """Rows lost and a row doubled in the middle of the file: the checkpoint's copy rebuilds
    it, and one warning names what was wrong."""
    out = copy_of(run_dir, tmp_path / "middle")
    before = (out / "metrics.csv").read_text().splitlines()
    damaged = [before[0], before[2], before[2]]  # step 1 lost, step 2 twice, step 3 lost
    (out / "metrics.csv").write_text("\n".join(damaged) + "\n")
    with pytest.warns(UserWarning, match=r"disagreed with the checkpoint at step 3 .*rewritten") as got:
        assert main(["train", "--resume", str(out), "--steps", "4", "--no-progress"]) == 0
    assert len([w for w in got if "metrics.csv" in str(w.message)]) == 1
    after = (out / "metrics.csv").read_text().splitlines()
    assert after[:4] == before[:4] and [int(r["step"]) for r in rows(out)] == [1, 2, 3, 4]


def test_config_file_and_flags_override(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[train]\ntask = "sinusoid"\nsteps = 2\nseed = 5\nhidden = 8\nmeta_batch = 2\n'
                   'eval_tasks = 2\n')
    out = tmp_path / "out"
    assert main(["train", "--config", str(cfg), "--steps", "1", "--out", str(out), "--no-progress"]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert (saved["steps"], saved["seed"], saved["hidden"], saved["meta_batch"]) == (1, 5, 8, 2)
    bad = tmp_path / "bad.toml"
    bad.write_text('task = "sinusoid"\ninner_lrr = 0.1\n')
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "o2")]) == 2
    assert "unknown setting(s) inner_lrr" in capsys.readouterr().err
    bad.write_text('task = "sinusoid\n')
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "o3")]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_omniglot_folder_in_wrong_layout(tmp_path, capsys):
    (tmp_path / "data" / "Latin" / "character01").mkdir(parents=True)
    assert main(["train", "omniglot", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "images_background is missing" in err and "<alphabet>/<character>/*.png" in err
    assert main(["train", "omniglot", "--out", str(tmp_path / "o")]) == 2
    assert "needs --data" in capsys.readouterr().err


def test_a_resume_says_when_longer_steps_move_a_schedule_or_the_evaluation_changes(tmp_path, capsys):
    out = tmp_path / "cosine"
    assert main(["train", *TINY, "--outer-schedule", "cosine", "--outer-lr", "0.01", "--out", str(out)]) == 0
    capsys.readouterr()
    # Three more steps: the cosine rate of step 4 is no longer 0 (the old schedule's end).
    assert main(["train", "--resume", str(out), "--steps", "6", "--eval-tasks", "2", "--no-progress"]) == 0
    said = capsys.readouterr().out
    # 0.5 * 0.01 * (1 + cos(pi * 3 / 6)) = 0.005; over 3 steps, step 3 of 3 ends at 0.
    assert "note: --steps was 3 and is 6: the cosine outer rate anneals over 6 steps (step 4's rate " \
           "0.005, was 0)" in said, said
    assert "note: the evaluation changed (--eval-tasks 3 -> 2): test numbers from step 4 on do not " \
           "compare with the earlier rows of metrics.csv" in said, said
    # A constant rate: more steps are just more steps, nothing to say.
    again = tmp_path / "constant"
    assert main(["train", *TINY, "--out", str(again)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(again), "--steps", "4", "--no-progress"]) == 0
    assert "note:" not in capsys.readouterr().out


def test_two_local_processes_through_the_elastic_launcher(tmp_path, run_dir):
    out = tmp_path / "two"
    assert main(["train", *TINY, "--nproc", "2", "--out", str(out)]) == 0
    one = [float(r["meta_loss"]) for r in rows(run_dir)]
    two = [float(r["meta_loss"]) for r in rows(out)]
    # Float64; two processes only reorder sums (see test_train.py): 1e-10 relative.
    assert all(abs(a - b) <= 1e-10 * abs(a) for a, b in zip(one, two)) and len(two) == 3


def test_a_resume_keeps_the_process_count_and_says_when_it_changes(tmp_path, capsys):
    import torch

    out = tmp_path / "two"
    assert main(["train", *TINY, "--nproc", "2", "--out", str(out)]) == 0
    assert torch.load(out / "checkpoint.pt", weights_only=True)["world"] == 2
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--steps", "4", "--no-progress"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert torch.load(out / "checkpoint.pt", weights_only=True)["world"] == 2  # kept: 2 again
    assert main(["train", "--resume", str(out), "--steps", "5", "--nproc", "1", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "note: the run ran on 2 processes and continues on 1 process: the same steps, equal only to " \
           "rounding (bit for bit with --deterministic)" in err, err
    assert [int(r["step"]) for r in rows(out)] == [1, 2, 3, 4, 5]
    # Another layout is said too (it was taken without a word).
    assert main(["train", "--resume", str(out), "--steps", "6", "--layout", "task", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "note: the run ran in the sample layout and continues in the task layout: the same " \
           "steps, equal only to rounding" in said, said


def test_image_tasks_train_and_report_accuracy(tmp_path, capsys):
    from test_tasks import omniglot_folder

    data = omniglot_folder(tmp_path / "omni")
    small = ["--steps", "2", "--ways", "3", "--shots", "1", "--query", "2", "--hidden", "8",
             "--meta-batch", "2", "--eval-tasks", "4", "--no-progress"]
    assert main(["train", "omniglot", "--data", str(data), *small, "--out", str(tmp_path / "o")]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    # Accuracies are fractions of 6 query images per task, averaged over 4 tasks.
    assert 0 <= summary["test_acc_before"] <= 1 and 0 <= summary["test_acc_after"] <= 1
    assert round(summary["test_acc_after"] * 24) == pytest.approx(summary["test_acc_after"] * 24, abs=1e-9)
    assert "accuracy before adaptation" in capsys.readouterr().out
    pytest.importorskip("sklearn")
    assert main(["train", "digits", *small, "--out", str(tmp_path / "d")]) == 0
    assert [int(r["step"]) for r in rows(tmp_path / "d")] == [1, 2]


def torchrun(nproc: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node",
           str(nproc), "-m", "metaddp", "train", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_under_torchrun_only_rank_0_reports(tmp_path):
    r = torchrun(2, "sinusoid", "--steps", "2", "--meta-batch", "2", "--eval-every", "0",
                 "--eval-tasks", "4", "--no-progress", "--out", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("meta-test on 4 held-out tasks") == 1
    assert r.stdout.count("continue with: metaddp train --resume run") == 1
    assert [int(row["step"]) for row in rows(tmp_path / "run")] == [1, 2]


def test_under_torchrun_a_layout_that_does_not_fit_is_one_error(tmp_path):
    r = torchrun(3, "sinusoid", "--layout", "hybrid", "--out", "run", cwd=tmp_path)
    assert r.returncode != 0 and r.stdout == ""
    errors = [line for line in r.stderr.splitlines() if line.startswith("metaddp train: error:")]
    assert errors == ["metaddp train: error: --layout hybrid makes two task groups of equal size, "
                      "which 3 processes cannot form: start an even number of processes, or use "
                      "--layout sample or task"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("algorithm", ["maml", "fomaml", "metasgd", "anil", "reptile", "imaml",
                                       "boil", "mamlpp", "protonet", "protomaml"])
def test_every_algorithm_trains_the_image_network(tmp_path, algorithm):
    # The image families' ConvNet is an nn.Sequential subclass with its own constructor:
    # ANIL's body/head split once tried to rebuild it from a slice.
    pytest.importorskip("sklearn")
    small = ["--steps", "1", "--ways", "3", "--shots", "1", "--query", "2", "--hidden", "4",
             "--meta-batch", "2", "--eval-tasks", "2", "--no-progress"]
    if algorithm == "imaml":  # its implicit system needs a strong proximal term here
        small += ["--lam", "50"]
    out = tmp_path / algorithm
    assert main(["train", "digits", "--algorithm", algorithm, *small, "--out", str(out)]) == 0
    (row,) = rows(out)
    assert float(row["meta_loss"]) > 0



def test_an_indefinite_imaml_system_names_lam(tmp_path, capsys):
    pytest.importorskip("sklearn")
    small = ["--steps", "1", "--ways", "3", "--shots", "1", "--query", "2", "--hidden", "4",
             "--meta-batch", "2", "--eval-tasks", "2", "--no-progress", "--lam", "1"]
    out = tmp_path / "imaml"
    assert main(["train", "digits", "--algorithm", "imaml", *small, "--out", str(out)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not positive definite" in err[0] and "Raise --lam (now 1)" in err[0]


def blocked_copy(run_dir: Path, out: Path) -> Path:
    """A copy of the run whose checkpoint rotation cannot rename (a directory where an old
    copy goes): it fails as a full disk or an unwritable folder does, with an OSError."""
    copy_of(run_dir, out)
    (out / "checkpoint.2.pt").mkdir()
    (out / "checkpoint.2.pt" / "x").write_text("in the way")
    return out


def test_a_failure_to_write_the_folder_is_one_line_with_the_way_back(tmp_path, run_dir, capsys):
    out = blocked_copy(run_dir, tmp_path / "blocked")
    assert main(["train", "--resume", str(out), "--steps", "5", "--no-progress"]) == 1
    (last,) = capsys.readouterr().err.strip().splitlines()
    assert last.startswith("metaddp train: failed: IsADirectoryError: [Errno 21]"), last
    assert last.endswith(f"the last checkpoint holds step 3. Continue with: metaddp train --resume {out}")


def test_a_process_that_fails_under_the_launcher_is_named_with_its_error(tmp_path, run_dir):
    out = blocked_copy(run_dir, tmp_path / "blocked")
    cmd = [sys.executable, "-m", "metaddp", "train", "--resume", str(out), "--steps", "5",
           "--no-progress", "--nproc", "2", "--timeout", "30"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    note, last = r.stderr.strip().splitlines()  # torch's own reports kept quiet
    assert "note: the run ran on 1 process and continues on 2 processes" in note
    # It used to say "(its error is above)" over nothing: the launcher keeps the error.
    assert last.startswith("metaddp train: process 0 failed: IsADirectoryError: [Errno 21]"), r.stderr
    assert "the last checkpoint holds step 3. Continue with: metaddp train --resume" in last
    assert "Traceback" not in r.stderr


def test_a_run_whose_plots_cannot_be_written_is_still_trained(tmp_path, run_dir, capsys, monkeypatch):
    """After the last checkpoint, a figure that cannot be written (a full disk) is one
    warning; the run reports its results and exits 0."""
    pytest.importorskip("matplotlib")
    import errno

    from metaddp.train import _trainer

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_trainer, "training_curves", full_disk)
    out = copy_of(run_dir, tmp_path / "noplots")
    with pytest.warns(UserWarning, match="the plots were not written .*the run is trained and checkpointed"):
        assert main(["train", "--resume", str(out), "--steps", "4", "--no-progress"]) == 0
    assert "meta-test on 3 held-out tasks" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["step"] == 4
