"""Differentiable inner optimizers (pure ``init`` / ``update`` pairs) and learned learning rates."""

from ._learned_lr import GRANULARITIES, LearnedLR
from ._optimizers import (
    InnerOptimizer,
    LearningRate,
    SlotState,
    State,
    adam,
    apply_updates,
    learned_rates,
    lr_for,
    sgd,
)

__all__ = [
    "GRANULARITIES",
    "InnerOptimizer",
    "LearnedLR",
    "LearningRate",
    "SlotState",
    "State",
    "adam",
    "apply_updates",
    "learned_rates",
    "lr_for",
    "sgd",
]
