"""Meta-learning algorithms by name: the one registry the training command, ``metaddp
verify`` and the tests build from. A new algorithm is one more entry in :data:`ALGORITHMS`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._remat import Replay
from .._types import Supports
from ..inner import adagrad, adam, adamw, chain, clip_by_global_norm, rmsprop, sgd
from ._anil import ANIL
from ._base import Algorithm, OptimizerFactory
from ._bilevel import Bilevel, Minibatches, WeightNet
from ._boil import BOIL
from ._hypergrad import METHODS
from ._imaml import IMAML
from ._maml import MAML
from ._mamlpp import MAMLPlusPlus
from ._metasgd import MetaSGD
from ._protonet import ProtoMAML, ProtoNet
from ._reptile import Reptile


@dataclasses.dataclass(frozen=True)
class Settings:
    """What an algorithm is built with (each takes the settings it has a use for).

    Args:
        inner_lr: inner learning rate (the initial value of learned rates).
        steps: inner steps per task.
        first_order: drop second-order terms (MAML, Meta-SGD, ANIL).
        lam: iMAML's proximal strength.
        cg_steps: iMAML's conjugate-gradient budget.
        cg_tol: iMAML's relative residual to stop at. It cannot fall far below the dtype's
            precision: 1e-6 suits float32, 1e-10 float64.
        memory: ``"default"``, ``"low"`` or a :class:`metaddp.Replay` (the algorithms whose
            ``supports.low_memory`` says so; see :class:`MAML`).
        optimizer: the inner optimizer by name, one of :data:`INNER_OPTIMIZERS`, at
            ``inner_lr`` (MAML, Meta-SGD, ANIL).
        autocast: ``"bf16"`` or ``"fp16"``: forward passes in that precision (MAML, Meta-SGD,
            ANIL; see :class:`MAML`), or ``None``.
        method: the hypergradient method of ``reweight`` by name (:data:`METHODS`).
        clip: clip every inner gradient to this global norm before the inner optimizer
            (:func:`metaddp.inner.clip_by_global_norm`), or ``None``.
        ways: classes per task (prototypical networks and ProtoMAML need it).
        schedule_steps: the run's meta-steps; MAML++ anneals its multi-step loss over the
            first fifteenth and trains first order over the first third, the paper's
            proportions (10 and 50 of 150 epochs). ``None``: no schedule.
        minibatch: ``reweight``: the inner problem is a whole training run of ``steps``
            minibatch steps of this size from the network's initialisation, drawn from
            ``seed`` (:class:`metaddp.bilevel.Minibatches`), not a one-step lookahead that
            trains the network as it goes. ``None``: the lookahead.
        seed: the minibatches' seed.
    """

    inner_lr: float = 0.01
    steps: int = 1
    first_order: bool = False
    lam: float = 1.0
    cg_steps: int = 25
    cg_tol: float = 1e-6
    memory: str | Replay = "default"
    optimizer: str = "sgd"
    autocast: str | None = None
    method: str = "unrolled"
    clip: float | None = None
    ways: int | None = None
    schedule_steps: int | None = None
    minibatch: int | None = None
    seed: int = 0

    def classes(self, algorithm: str) -> int:
        if self.ways is None:
            raise ValueError(f"{algorithm} needs the number of classes per task (ways)")
        return self.ways

    def autocast_dtype(self) -> torch.dtype | None:
        dtypes = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}
        if self.autocast not in dtypes:
            raise ValueError(f"unknown autocast {self.autocast!r}; choose from bf16, fp16")
        return dtypes[self.autocast]

    def inner_optimizer(self) -> OptimizerFactory:
        if self.optimizer not in INNER_OPTIMIZERS:
            raise ValueError(
                f"unknown inner optimizer {self.optimizer!r}; "
                f"choose from {', '.join(INNER_OPTIMIZERS)}"
            )
        factory = INNER_OPTIMIZERS[self.optimizer]
        if self.clip is None:
            return factory
        clip = clip_by_global_norm(self.clip)
        return lambda lr: chain(clip, factory(lr))


# Inner optimizers by name, as factories of the learning rate.
INNER_OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": sgd,
    "adam": adam,
    "adamw": adamw,
    "rmsprop": rmsprop,
    "adagrad": adagrad,
    # torch.optim.SGD(momentum=0.9), the usual way to train a network.
    "momentum": lambda lr: sgd(lr, momentum=0.9),
}

Builder = Callable[[nn.Module, Settings], Algorithm]


def _unrolled(s: Settings) -> dict[str, Any]:
    """The options MAML, Meta-SGD and ANIL share."""
    return dict(
        inner_lr=s.inner_lr,
        steps=s.steps,
        first_order=s.first_order,
        memory=s.memory,
        optimizer=s.inner_optimizer(),
        autocast=s.autocast_dtype(),
    )


ALGORITHMS: dict[str, Builder] = {
    # Finn, Abbeel & Levine 2017: second-order meta-gradient through the inner loop.
    "maml": lambda m, s: MAML(m, **_unrolled(s)),
    # The same with the inner gradients held constant (first-order MAML, ibid. sec. 5.2).
    "fomaml": lambda m, s: MAML(m, **{**_unrolled(s), "first_order": True}),
    # Li et al. 2017: a learned learning rate per parameter entry, initialised at inner_lr.
    "metasgd": lambda m, s: MetaSGD(m, **_unrolled(s)),
    # Raghu et al. 2020: only the last layer adapts, on features of the rest computed once.
    "anil": lambda m, s: ANIL(*split_head(m), **_unrolled(s)),
    # Nichol et al. 2018: the meta-gradient is the mean displacement theta - phi.
    "reptile": lambda m, s: Reptile(
        m, inner_lr=s.inner_lr, steps=s.steps, optimizer=s.inner_optimizer(), memory=s.memory
    ),
    # Rajeswaran et al. 2019: implicit gradient by conjugate gradient on I + H / lam.
    "imaml": lambda m, s: IMAML(
        m,
        lam=s.lam,
        inner_lr=s.inner_lr,
        steps=s.steps,
        cg_steps=s.cg_steps,
        cg_tol=s.cg_tol,
        optimizer=s.inner_optimizer(),
        memory=s.memory,
    ),
    # Antoniou et al. 2019 (MAML++): per-step learned rates, annealed multi-step loss,
    # first order then second; the cosine outer schedule is the training loop's.
    "mamlpp": lambda m, s: MAMLPlusPlus(
        m,
        inner_lr=s.inner_lr,
        steps=s.steps,
        msl_steps=(s.schedule_steps or 0) // 15,
        first_order_steps=(s.schedule_steps or 0) // 3,
        first_order=s.first_order,
        autocast=s.autocast_dtype(),
        memory=s.memory,
    ),
    # Snell et al. 2017: queries scored against the support's class means (no inner loop),
    # in the embedding below the model's head.
    "protonet": lambda m, s: ProtoNet(
        split_head(m)[0],
        ways=s.classes("protonet"),
        autocast=s.autocast_dtype(),
        memory=s.memory,
    ),
    # Triantafillou et al. 2020: MAML from a head at the prototypes' linear layer.
    "protomaml": lambda m, s: ProtoMAML(
        split_head(m)[0],
        ways=s.classes("protomaml"),
        inner_lr=s.inner_lr,
        steps=s.steps,
        first_order=s.first_order,
        optimizer=s.inner_optimizer(),
        autocast=s.autocast_dtype(),
        memory=s.memory,
    ),
    # Oh et al. 2021 (BOIL): the body adapts, the head is held at its meta-parameters.
    "boil": lambda m, s: BOIL(*split_head(m), **_unrolled(s)),
    # Shu et al. 2019 (Meta-Weight-Net): a network of each support sample's loss weighs it in
    # the model's training loss, trained by the hypergradient of a one-step lookahead scored
    # on the query (clean) batch; the model trains on the weighted loss in the same step.
    "reweight": lambda m, s: Bilevel(
        m,
        weights=WeightNet(),
        start="current",
        steps=s.steps,
        optimizer=s.inner_optimizer()(s.inner_lr),
        method=METHODS[s.method](),
        memory=s.memory,
        **(
            dict(train_inner=True)
            if s.minibatch is None
            # The whole run, from the network's weights (never stepped): the hypergradient
            # reaches the weighting through every minibatch step of it.
            else dict(minibatches=Minibatches(s.minibatch, s.seed))
        ),
    ),
    # Plain training on the support batches (the baseline reweighting is measured against).
    "erm": lambda m, s: Bilevel(
        m, start="current", train_inner=True, steps=s.steps, inner_lr=s.inner_lr
    ),
}


# What each name offers: its class's declaration (first-order MAML has no second order to
# rebuild, so no memory="low").
SUPPORTS: dict[str, Supports] = {
    "maml": MAML.supports,
    # memory="low" is MAML's: first order keeps no inner graph, so it runs the default loop,
    # the same meta-gradient in the same memory (accepted, as the library accepts it).
    "fomaml": MAML.supports,
    "metasgd": MetaSGD.supports,
    "anil": ANIL.supports,
    "reptile": Reptile.supports,
    "imaml": IMAML.supports,
    "mamlpp": MAMLPlusPlus.supports,
    "protonet": ProtoNet.supports,
    "protomaml": ProtoMAML.supports,
    "boil": BOIL.supports,
    "reweight": Bilevel.supports,
    "erm": dataclasses.replace(Bilevel.supports, low_memory=False),  # no lookahead to rebuild
}


def having(capability: str) -> tuple[str, ...]:
    """The algorithms' names whose :class:`metaddp.algorithms.Supports` has ``capability``."""
    return tuple(n for n, s in SUPPORTS.items() if getattr(s, capability))


def split_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(body, head) for ANIL: the model's own ``split_head()`` when it has one; for a
    sequential network, everything but the last layer, and the last."""
    own = getattr(model, "split_head", None)
    if callable(own):
        body, head = own()
        return body, head
    if isinstance(model, nn.Sequential) and len(model) >= 2:
        # A plain Sequential of the same layers: slicing rebuilds the model's own class,
        # whose constructor may take other arguments (the image families' ConvNet).
        layers = list(model)
        return nn.Sequential(*layers[:-1]), layers[-1]
    raise ValueError(
        f"ANIL needs a body/head split: {type(model).__name__} is not a sequential "
        "network with at least two layers and has no split_head() method"
    )


def build(name: str, model: nn.Module, settings: Settings) -> Algorithm:
    """The algorithm ``name`` around ``model``."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name](model, settings)
