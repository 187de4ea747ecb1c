"""The training application: settings, the :class:`Trainer` (step / evaluate / save),
checkpoints, metrics, plots and the run folder."""

from ._checkpoint import CheckpointError
from ._config import DTYPES, LAYOUTS, TrainConfig, read_toml
from ._folder import (
    CHECKPOINT,
    RunFolderError,
    RunLock,
    check_folder,
    prepare_folder,
    saved_config,
    unsaved_start,
)
from ._trainer import NonFiniteError, Trainer, train

__all__ = [
    "CHECKPOINT",
    "DTYPES",
    "LAYOUTS",
    "NonFiniteError",
    "CheckpointError",
    "RunFolderError",
    "RunLock",
    "TrainConfig",
    "Trainer",
    "check_folder",
    "prepare_folder",
    "read_toml",
    "saved_config",
    "train",
    "unsaved_start",
]
