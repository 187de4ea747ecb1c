"""The run folder has one writer at a time, and its files get the usual permissions."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from metaddp.cli import main
from metaddp.train import RunFolderError, RunLock, _checkpoint

TINY = ["sinusoid", "--steps", "2", "--meta-batch", "2", "--shots", "3", "--query", "2",
        "--hidden", "8", "--eval-every", "0", "--eval-tasks", "4", "--no-progress"]


def wait_for(condition, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the first run did not start in time"
        time.sleep(0.1)


def test_a_second_run_in_a_busy_folder_is_refused_and_a_dead_ones_lock_is_not(tmp_path, capsys):
    out = tmp_path / "run"
    # A long run in another process, checkpointing every step so that it can be resumed.
    first = subprocess.Popen(
        [sys.executable, "-m", "metaddp", "train", *TINY, "--steps", "1000000",
         "--checkpoint-every", "1", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        owner = f"host {socket.gethostname()}, PID {first.pid}"
        wait_for(lambda: (out / "checkpoint.pt").exists(), first)
        assert (out / ".lock").read_text() == owner + "\n"
        config = (out / "config.json").read_bytes()
        for again in ([*TINY, "--force", "--out", str(out)], ["--resume", str(out)]):
            assert main(["train", *again]) == 2
            err = capsys.readouterr().err
            assert err == (f"metaddp train: error: {out} is in use by another metaddp train run "
                           f"({owner}): wait for it to end, or choose another --out\n")
        assert (out / "config.json").read_bytes() == config and first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)  # dies without cleaning up, as a crashed run would
        first.communicate()
    # The dead run's name stays in the lock file, but the kernel released its lock.
    assert (out / ".lock").read_text() == owner + "\n"
    assert main(["train", *TINY, "--force", "--out", str(out)]) == 0
    assert (out / ".lock").read_text() == ""  # released when the run ended
    assert main(["train", "--resume", str(out), "--steps", "3", "--no-progress"]) == 0


def test_the_lock_is_one_per_folder_and_released(tmp_path):
    with RunLock.acquire(tmp_path / "a") as lock:
        assert (tmp_path / "a" / ".lock").read_text() == f"host {socket.gethostname()}, PID {os.getpid()}\n"
        try:  # flock locks belong to an open file: a second open conflicts even in one process
            RunLock.acquire(tmp_path / "a")
            raise AssertionError("a second lock was granted")
        except RunFolderError as e:
            assert f"PID {os.getpid()}" in str(e)
        RunLock.acquire(tmp_path / "b").release()  # another folder is free
    assert lock.fd is None
    RunLock.acquire(tmp_path / "a").release()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_run_files_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        assert main(["train", *TINY, "--out", str(tmp_path / "run")]) == 0
        os.umask(0o077)
        _checkpoint.atomic_write(tmp_path / "private", lambda f: f.write(b"x"))
    finally:
        os.umask(old)
    names = ["config.toml", "config.json", "metrics.csv", "checkpoint.pt", "summary.json", ".lock"]
    assert {n: oct(mode(tmp_path / "run" / n)) for n in names} == {n: oct(0o644) for n in names}
    assert mode(tmp_path / "private") == 0o600  # the umask decides, not a fixed mode
