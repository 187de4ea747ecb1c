"""Meta-learning algorithms by name, for the training command.

Each entry builds, from a network and the run's settings, a module with
``meta_loss(tasks, loss_fn, n_tasks, reduce=)`` (training) and
``adapt(support, loss_fn, reduce=, steps=)`` (meta-test evaluation). A new algorithm is one
more entry in :data:`ALGORITHMS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ._maml import MAML

Builder = Callable[[nn.Module, Any], nn.Module]

ALGORITHMS: dict[str, Builder] = {
    # Finn, Abbeel & Levine 2017: second-order meta-gradient through the inner loop.
    "maml": lambda model, cfg: MAML(model, cfg.inner_lr, cfg.inner_steps),
    # The same with the inner gradients held constant (first-order MAML, ibid. sec. 5.2).
    "fomaml": lambda model, cfg: MAML(model, cfg.inner_lr, cfg.inner_steps, first_order=True),
}


def build(name: str, model: nn.Module, cfg: Any) -> nn.Module:
    """The algorithm ``name`` wrapped around ``model`` with the settings of ``cfg``."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name](model, cfg)
