"""The training application: settings, the :class:`Trainer` (step / evaluate / save),
checkpoints, metrics, plots, the run folder, and launching a run (its worker, the local
launcher with restarts, the exit statuses)."""

from ._checkpoint import CheckpointError, settings_before
from ._checkpoint import exists as checkpoint_exists
from ._config import DTYPES, LAYOUTS, OUTER_SCHEDULES, TrainConfig, read_toml
from ._folder import (
    CHECKPOINT,
    RunFolderError,
    RunLock,
    check_folder,
    prepare_folder,
    saved_config,
    unsaved_start,
    way_back,
)
from ._launch import (
    EXIT_DIVERGED,
    EXIT_STOPPED,
    begin,
    checkpoint_step,
    checkpoint_world,
    launch,
    launch_nodes,
    one_line_warning,
    quiet_latest,
    under_torchrun,
    worker,
)
from ._trainer import NonFiniteError, Trainer, train

__all__ = [
    "CHECKPOINT",
    "DTYPES",
    "EXIT_DIVERGED",
    "EXIT_STOPPED",
    "LAYOUTS",
    "OUTER_SCHEDULES",
    "NonFiniteError",
    "CheckpointError",
    "RunFolderError",
    "RunLock",
    "TrainConfig",
    "Trainer",
    "begin",
    "check_folder",
    "checkpoint_exists",
    "checkpoint_step",
    "checkpoint_world",
    "launch",
    "launch_nodes",
    "prepare_folder",
    "quiet_latest",
    "read_toml",
    "saved_config",
    "settings_before",
    "train",
    "one_line_warning",
    "under_torchrun",
    "unsaved_start",
    "way_back",
    "worker",
]
