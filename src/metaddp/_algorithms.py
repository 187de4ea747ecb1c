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

from ._anil import ANIL
from ._imaml import IMAML
from ._maml import MAML
from ._metasgd import MetaSGD
from ._reptile import Reptile

Builder = Callable[[nn.Module, Any], nn.Module]

ALGORITHMS: dict[str, Builder] = {
    # Finn, Abbeel & Levine 2017: second-order meta-gradient through the inner loop.
    "maml": lambda model, cfg: MAML(model, cfg.inner_lr, cfg.inner_steps),
    # The same with the inner gradients held constant (first-order MAML, ibid. sec. 5.2).
    "fomaml": lambda model, cfg: MAML(model, cfg.inner_lr, cfg.inner_steps, first_order=True),
    # Li et al. 2017: a learned learning rate per parameter entry, initialised at inner_lr.
    "metasgd": lambda model, cfg: MetaSGD(model, cfg.inner_lr, cfg.inner_steps),
    # Raghu et al. 2020: only the last layer adapts, on features of the rest computed once.
    "anil": lambda model, cfg: ANIL(*split_head(model), cfg.inner_lr, cfg.inner_steps),
    # Nichol et al. 2018: the meta-gradient is the mean displacement theta - phi.
    "reptile": lambda model, cfg: Reptile(model, cfg.inner_lr, cfg.inner_steps),
    # Rajeswaran et al. 2019: implicit gradient by conjugate gradient on I + H / lam.
    # CG's relative residual cannot fall far below the dtype's precision: 1e-6 in float32.
    "imaml": lambda model, cfg: IMAML(model, cfg.lam, cfg.inner_lr, cfg.inner_steps, cg_steps=25,
                                      cg_tol=1e-10 if cfg.dtype == "float64" else 1e-6),
}


def split_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(body, head) of a sequential network: everything but the last layer, and the last."""
    if not isinstance(model, nn.Sequential) or len(model) < 2:
        raise ValueError("ANIL needs a sequential network whose last layer is the head")
    return model[:-1], model[-1]


def build(name: str, model: nn.Module, cfg: Any) -> nn.Module:
    """The algorithm ``name`` wrapped around ``model`` with the settings of ``cfg``."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name](model, cfg)
