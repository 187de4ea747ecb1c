"""The run folder's files get the usual permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from metaddp.cli import main
from metaddp.train import _checkpoint

TINY = ["sinusoid", "--steps", "2", "--meta-batch", "2", "--shots", "3", "--query", "2",
        "--hidden", "8", "--eval-every", "0", "--eval-tasks", "4", "--no-progress"]


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
    names = ["config.toml", "config.json", "metrics.csv", "checkpoint.pt", "summary.json"]
    assert {n: oct(mode(tmp_path / "run" / n)) for n in names} == {n: oct(0o644) for n in names}
    assert mode(tmp_path / "private") == 0o600  # the umask decides, not a fixed mode
