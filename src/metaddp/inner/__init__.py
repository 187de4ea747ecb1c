"""Differentiable inner optimizers (pure ``init`` / ``update`` pairs) and learned learning rates."""

from ._adaptive import adagrad, rmsprop
from ._learned_lr import GRANULARITIES, LearnedLR
from ._loss_scale import DEFAULT as DEFAULT_LOSS_SCALE
from ._loss_scale import LossScale, TaskScale, resolve_loss_scale
from ._optimizers import (
    InnerOptimizer,
    LearningRate,
    SlotState,
    State,
    adam,
    adamw,
    apply_updates,
    hyperparameters,
    learned_rates,
    lr_for,
    per_step_sgd,
    sgd,
)
from ._transforms import chain, clip_by_global_norm

__all__ = [
    "DEFAULT_LOSS_SCALE",
    "GRANULARITIES",
    "InnerOptimizer",
    "LearnedLR",
    "LearningRate",
    "LossScale",
    "SlotState",
    "State",
    "TaskScale",
    "adagrad",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "hyperparameters",
    "learned_rates",
    "lr_for",
    "per_step_sgd",
    "resolve_loss_scale",
    "rmsprop",
    "sgd",
]
