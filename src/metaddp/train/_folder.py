"""The run folder: what a run writes, refusing to overwrite another run, one writer at a time,
the saved settings."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any

from .._output import quoted
from . import _checkpoint
from ._config import TrainConfig, toml_text

CHECKPOINT = "checkpoint.pt"
CONFIG_JSON = "config.json"
CONFIG_TOML = "config.toml"
# What a run writes; --force removes exactly these before a new run starts.
ARTIFACTS = (
    *(p.name for p in _checkpoint.history(Path(CHECKPOINT))),
    CONFIG_JSON,
    CONFIG_TOML,
    "metrics.csv",
    "summary.json",
    "plots",
    "tensorboard",
    "shards",  # a sharded run's checkpoint states (_sharded_state.SHARDS)
)
# Held (flock) by the process that writes the run; it names that process. Never removed, so
# that every run opens the same file; a run leaves it empty when it ends.
LOCK = ".lock"


class RunFolderError(ValueError):
    """The output folder cannot hold this run without losing something."""


def way_back(step: int | None, out: Path) -> str:
    """What a stopped or failed run's folder keeps, and the command that continues it."""
    if step is None:
        return "no checkpoint was written: start it again with the same command"
    return (
        f"the last checkpoint holds step {step}. Continue with: metaddp train --resume "
        f"{quoted(out)}"
    )


def check_folder(out: Path, resume: bool, force: bool) -> None:
    """Refuse to start a new run over an earlier one (unless ``force``), or to resume nothing."""
    out = Path(out)
    if resume:
        if not _checkpoint.exists(out / CHECKPOINT):
            raise RunFolderError(f"{out} holds no {CHECKPOINT}: nothing to resume")
        return
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} is a file, not a folder")
    held = sorted(p.name for p in out.iterdir() if p.name != LOCK) if out.is_dir() else []
    if held and not force:
        if _checkpoint.exists(out / CHECKPOINT):  # never advise deleting its checkpoints
            go_on = (
                f"Continue that run with --resume {quoted(out)}, or choose another --out "
                "(--force would replace it, deleting its checkpoints)"
            )
        else:
            go_on = (
                "It holds no checkpoint (a run with other settings that stopped before its "
                "first): choose another --out, or pass --force to replace it"
            )
        raise RunFolderError(f"{out} is not empty (it holds {', '.join(held[:4])}...). {go_on}")


def unsaved_start(out: Path, identity: dict[str, Any]) -> bool:
    """Whether ``out`` holds a run with these settings (``identity``) that wrote no
    checkpoint: it stopped or failed before its first one, so starting it again in the
    folder loses nothing (a launcher's restart, or the same command run again)."""
    out = Path(out)
    if not (out / CONFIG_JSON).is_file() or _checkpoint.exists(out / CHECKPOINT):
        return False
    try:
        return TrainConfig(**saved_config(out)).resolved().identity() == identity
    except (RunFolderError, TypeError, ValueError):
        return False


class RunLock:
    """The run folder's writer lock: an advisory ``flock`` on ``out/.lock``, which names its
    holder (host and PID). The kernel drops it when the holder exits, however it ends, so a
    lock file left by a dead run never blocks. Create with :meth:`acquire`.
    """

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    @classmethod
    def acquire(cls, out: Path) -> RunLock:
        """Create ``out`` if needed and take its lock, or raise ``RunFolderError`` naming the
        process that holds it."""
        out = Path(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise RunFolderError(f"cannot write in the output folder {out}: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 200).decode(errors="replace").strip() or "a process"
            os.close(fd)
            raise RunFolderError(
                f"{out} is in use by another metaddp train run ({owner}): wait for it to end, "
                "or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, PID {os.getpid()}\n".encode())
        return cls(fd)

    def release(self) -> None:
        """Forget the owner and let the next run in (also done by the kernel at exit)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def prepare_folder(out: Path, cfg: TrainConfig, resume: bool, force: bool) -> None:
    """Create the folder (clearing a previous run's files with ``force``); write the config."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if force and not resume:
        for name in ARTIFACTS:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    (out / "plots").mkdir(exist_ok=True)
    _checkpoint.atomic_write(
        out / CONFIG_TOML, lambda f: f.write(toml_text(cfg.to_dict()).encode())
    )
    _checkpoint.atomic_write(
        out / CONFIG_JSON, lambda f: f.write(json.dumps(cfg.to_dict(), indent=2).encode())
    )


def saved_config(out: Path) -> dict[str, Any]:
    """The settings a run recorded in its folder (for ``--resume``)."""
    path = Path(out) / CONFIG_JSON
    if not path.exists() and _checkpoint.exists(Path(out) / CHECKPOINT):
        # Every checkpoint holds the settings too: the resume writes config.json again.
        warnings.warn(
            f"{path} is missing: the settings come from the latest checkpoint", stacklevel=2
        )
        try:
            state = _checkpoint.load_latest(Path(out) / CHECKPOINT, {})
        except _checkpoint.CheckpointError as e:
            raise RunFolderError(f"cannot read the settings of the run in {out} ({e})") from None
        return TrainConfig.from_mapping(state["config"], str(Path(out) / CHECKPOINT))
    try:
        return TrainConfig.from_mapping(json.loads(path.read_text()), str(path))
    except (OSError, json.JSONDecodeError) as e:
        raise RunFolderError(f"cannot read the settings of the run in {out} ({e})") from None
