"""The run folder: what a run writes, refusing to overwrite another run, the saved settings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from . import _checkpoint
from ._config import TrainConfig, toml_text

CHECKPOINT = "checkpoint.pt"
CONFIG_JSON = "config.json"
CONFIG_TOML = "config.toml"
# What a run writes; --force removes exactly these before a new run starts.
ARTIFACTS = (
    CHECKPOINT,
    CONFIG_JSON,
    CONFIG_TOML,
    "metrics.csv",
    "summary.json",
    "plots",
    "tensorboard",
)


class RunFolderError(ValueError):
    """The output folder cannot hold this run without losing something."""


def check_folder(out: Path, resume: bool, force: bool) -> None:
    """Refuse to start a new run over an earlier one (unless ``force``), or to resume nothing."""
    out = Path(out)
    if resume:
        if not (out / CHECKPOINT).exists():
            raise RunFolderError(f"{out} holds no {CHECKPOINT}: nothing to resume")
        return
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise RunFolderError(
            f"{out} is not empty (it holds {', '.join(sorted(p.name for p in out.iterdir())[:4])}"
            f"...). Continue that run with --resume {out}, choose another --out, or pass "
            "--force to replace it"
        )


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
    try:
        return TrainConfig.from_mapping(json.loads(path.read_text()), str(path))
    except (OSError, json.JSONDecodeError) as e:
        raise RunFolderError(f"cannot read the settings of the run in {out} ({e})") from None
