"""``metaddp train`` under real signals: preemption (SIGTERM, Ctrl-C) checkpoints and says how
to resume; a killed process is restarted by the launcher and the run continues from its
checkpoint with nothing lost or repeated; a diverging run ends in one line."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

TINY = ["sinusoid", "--meta-batch", "4", "--shots", "5", "--query", "5", "--hidden", "8",
        "--eval-every", "0", "--eval-tasks", "4", "--no-progress"]


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "metaddp", "train", *TINY, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rows(folder: Path) -> list[dict]:
    path = folder / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def wait_for(condition, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not get there in time")
        time.sleep(0.02)


def children(pid: int) -> list[int]:
    """The worker processes a launcher started (Linux /proc): spawned by it, or forked by the
    fork server it started."""
    out = []
    for child in all_children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            out.append(child)
        elif b"forkserver" in cmdline:
            out.extend(all_children(child))
    return sorted(out)


def test_a_stop_signal_checkpoints_and_the_run_resumes(tmp_path):
    # SIGTERM to two processes' launcher (Ctrl-C to one process:
    # test_a_stop_at_an_evaluation_step_is_evaluated_on_resume).
    nproc, sig = 2, signal.SIGTERM
    run = tmp_path / "run"
    proc = start("--nproc", str(nproc), "--steps", "100000", "--checkpoint-every", "100000",
                 "--out", str(run))
    wait_for(lambda: len(rows(run)) >= 3)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    step = stop_step(last, sig.name)
    assert last.endswith(f"Continue with: metaddp train --resume {run}")
    assert [int(r["step"]) for r in rows(run)] == list(range(1, step + 1))
    resumed = subprocess.run([sys.executable, "-m", "metaddp", "train", "--resume", str(run),
                              "--steps", str(step + 2), "--nproc", str(nproc), "--no-progress"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert [int(r["step"]) for r in rows(run)] == list(range(1, step + 3))


def test_a_killed_process_is_restarted_and_nothing_is_lost_or_repeated(tmp_path):
    common = ["--nproc", "2", "--steps", "160", "--checkpoint-every", "40"]
    whole = start(*common, "--out", str(tmp_path / "whole"))  # the uninterrupted run, beside it
    run = tmp_path / "run"
    proc = start(*common, "--max-restarts", "1", "--out", str(run))
    wait_for(lambda: (run / "checkpoint.pt").exists() and len(rows(run)) >= 50)
    workers = children(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    _, whole_err = whole.communicate(timeout=300)
    assert whole.returncode == 0, whole_err
    # The restart is said in one line, with the step it continues from.
    assert re.search(r"a process failed; restart 1 of 1, from step \d+", err), err
    assert len(rows(run)) == 160  # the steps after the last checkpoint were trained again ...
    # ... from the checkpoint, on the same number of processes: bit for bit the same losses.
    assert [r["meta_loss"] for r in rows(run)] == [r["meta_loss"] for r in rows(tmp_path / "whole")]


def test_a_diverging_run_ends_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "metaddp", "train", *TINY, "--steps", "5",
                          "--outer-lr", "1e30", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 3
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("metaddp train: training stopped at step ")
    assert "lower the outer learning rate (--outer-lr 1e+30)" in lines[0]


def test_torchrun_restarts_start_again_then_continue_the_run_with_resume_auto(tmp_path):
    """``torchrun --max-restarts`` runs the command again after a worker dies: with
    ``--resume auto`` an attempt killed before the first checkpoint starts the run again in its
    folder (which holds only this run's own start), and one killed after it continues from the
    checkpoint (its process groups connect, though the launcher's store still holds the
    earlier attempts' keys)."""
    run = tmp_path / "run"
    proc = start_torchrun(run, "--steps", "160", "--checkpoint-every", "40", restarts=2)
    wait_for(lambda: len(rows(run)) >= 10)
    assert not (run / "checkpoint.pt").exists()
    os.kill(all_children(proc.pid)[1], signal.SIGKILL)
    wait_for(lambda: (run / "checkpoint.pt").exists() and len(rows(run)) >= 50)
    workers = [pid for pid in all_children(proc.pid)]
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert [int(r["step"]) for r in rows(run)] == list(range(1, 161))


def stopped_with_a_checkpoint(proc: subprocess.Popen, run: Path, by: str) -> None:
    """The run ends with the stop status, one line naming ``by`` and the step, and a
    checkpoint of that step with every step's metrics up to it."""
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    step = stop_step(err.strip().splitlines()[-1], by)
    assert (run / "checkpoint.pt").exists() and len(rows(run)) == step


def stop_step(line: str, by: str) -> int:
    """The checkpoint step a stop's line names. One process knows that its stop wrote the
    checkpoint; a launcher, whose processes may be killed after its grace period, names the
    checkpoint the folder holds."""
    found = re.fullmatch(
        rf"metaddp train: stopped by {by}(?: after step (\d+); checkpoint written|; the last "
        r"checkpoint holds step (\d+))\. Continue with: metaddp train --resume \S+",
        line,
    )
    assert found, line
    return int(found.group(1) or found.group(2))


def start_torchrun(run: Path, *args: str, restarts: int = 1) -> subprocess.Popen:
    """``torchrun`` with 2 processes and ``restarts`` restarts, continuing or starting
    ``run``."""
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts),
         "-m", "metaddp", "train", *TINY, *args, "--out", str(run), "--resume", "auto"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def all_children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return sorted(out)


def test_ctrl_c_on_a_terminal_checkpoints_under_the_launcher(tmp_path):
    # Ctrl-C signals the whole process group: every worker gets SIGINT from the terminal and
    # once more from the launcher, milliseconds apart. That is one request: the step ends and
    # the checkpoint is written (a second SIGINT used to end the worker before it).
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "metaddp", "train", *TINY, "--nproc", "2",
                             "--steps", "100000", "--checkpoint-every", "100000", "--out",
                             str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    wait_for(lambda: len(rows(run)) >= 3)
    os.killpg(proc.pid, signal.SIGINT)
    stopped_with_a_checkpoint(proc, run, "SIGINT")


def test_an_evaluation_that_diverges_ends_in_one_line(tmp_path):
    # Training at this rate is finite for 3 steps; adapting held-out tasks for 10 is not.
    run = subprocess.run([sys.executable, "-m", "metaddp", "train", "sinusoid", "--inner-lr",
                          "0.3", "--steps", "3", "--eval-tasks", "4", "--checkpoint-every", "1",
                          "--no-progress", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("metaddp train: evaluation after step 3: ")
    assert "the last checkpoint holds step 2" in lines[0]


def test_a_killed_process_without_restarts_ends_in_one_line_with_the_way_back(tmp_path):
    run = tmp_path / "run"
    proc = start("--nproc", "2", "--steps", "100000", "--checkpoint-every", "20", "--out",
                 str(run))
    wait_for(lambda: (run / "checkpoint.pt").exists() and len(rows(run)) >= 30)
    os.kill(children(proc.pid)[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    assert "Root Cause" not in err and "Traceback" not in err, err  # torch's report, left out
    last = err.strip().splitlines()[-1]
    assert last.startswith("metaddp train: process 1 was killed by SIGKILL; the last checkpoint "
                           "holds step "), err
    assert last.endswith(f"Continue with: metaddp train --resume {run}"), err


def test_a_stop_signal_to_one_process_stops_the_run_with_a_checkpoint(tmp_path):
    # Every process ends the step it is in (they vote on stopping), checkpoints and leaves
    # with the stop status: reported as a stop, not as a failed process.
    run = tmp_path / "run"
    proc = start("--nproc", "2", "--steps", "100000", "--checkpoint-every", "100000", "--out",
                 str(run))
    wait_for(lambda: len(rows(run)) >= 3)
    os.kill(children(proc.pid)[1], signal.SIGTERM)
    stopped_with_a_checkpoint(proc, run, "a signal to its processes")


def test_a_stop_at_an_evaluation_step_is_evaluated_on_resume(tmp_path):
    # Ctrl-C to a run on one process, where every step is due for an evaluation: the stop
    # skips its step's, and the checkpoint says so; the resume evaluates the same weights
    # first and completes the step's row.
    run, whole = tmp_path / "run", tmp_path / "whole"
    proc = start("--eval-every", "1", "--steps", "100000", "--checkpoint-every", "100000",
                 "--out", str(run))
    # The run that does not stop, beside it (its steps beyond the stop are not compared).
    straight = start("--eval-every", "1", "--steps", "40", "--out", str(whole))
    wait_for(lambda: len(rows(run)) >= 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    step = stop_step(last, "SIGINT")
    assert last.endswith(f"Continue with: metaddp train --resume {run}")
    assert [int(r["step"]) for r in rows(run)] == list(range(1, step + 1))
    assert rows(run)[-1]["test_after"] == ""  # the stopping step's evaluation was skipped
    resumed = subprocess.run([sys.executable, "-m", "metaddp", "train", "--resume", str(run),
                              "--steps", str(step + 1), "--no-progress"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    _, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err
    assert step + 1 <= 40, step
    # One process, the same seed: the run that stopped and the one that did not hold the
    # same bits, every evaluation included.
    cells = ("step", "meta_loss", "test_before", "test_after")
    assert [[r[c] for c in cells] for r in rows(run)] == [
        [r[c] for c in cells] for r in rows(whole)[: step + 1]
    ]


def test_a_second_ctrl_c_during_a_long_backward_ends_the_run_at_once(tmp_path):
    """Two Ctrl-C presses 2.5 s apart, both during one step of about 10 s: a Python handler
    would run only after the backward returns and see them as one request. The wake-up pipe's
    watcher times them as they arrive: exit 130 at once, the way back in one line."""
    run = tmp_path / "run"
    long = ["sinusoid", "--hidden", "2048", "--shots", "1600", "--query", "1600", "--meta-batch", "4",
            "--inner-steps", "3", "--eval-every", "0", "--eval-tasks", "1", "--steps", "3",
            "--no-progress", "--out", str(run)]
    proc = subprocess.Popen([sys.executable, "-m", "metaddp", "train", *long],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (run / "metrics.csv").exists())  # the loop has begun its first step
    time.sleep(2.0)
    proc.send_signal(signal.SIGINT)
    time.sleep(2.5)  # past the window in which a second press is the same request
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    waited = time.monotonic() - t0
    assert proc.returncode == 130, err
    assert waited < 2.0, waited  # not after the step's backward (seconds more)
    last = err.strip().splitlines()[-1]
    assert "interrupted by a second Ctrl-C before the step ended" in last, err
    assert "no checkpoint was written" in last
