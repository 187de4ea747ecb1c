"""What every meta-learning algorithm shares: the model, the inner optimizer (with learned
rates), the reductions it uses, and the meta-batch's bookkeeping.

Rank-agnostic by construction: every gradient of a support loss passes through a ``reduce``
function. By default that is the one bound by the :class:`metaddp.MetaDDP` wrapping the
algorithm (the identity on one process); ``reduce=`` overrides it. The losses are shares
(:func:`metaddp.share`), so reduced gradients are gradients of the global mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypedDict

import torch
from torch import Tensor, nn

from .. import _host
from .. import forward as _draws
from .._adapt import batch_share, check_finite, check_finite_loss, inner_loop
from .._binding import Collectives, collectives_for
from .._data import Batch, BatchKey, MetaBatch, Task, check_batches, named_batches, positive
from .._functional import (
    call,
    params_of,
    refuse_data_parallel,
    refusing_draws,
    require_trained,
    rows_like,
    walked_once,
)
from .._remat import Replay, memory_mode, rematerialized_loop, rematerialized_loss
from .._share import PerSampleCheck
from .._types import LossFn, Params, Reduce, Supports
from ..forward import needs_routes, unkeyable_layers
from ..inner import (
    DEFAULT_LOSS_SCALE,
    InnerOptimizer,
    LearnedLR,
    LearningRate,
    LossScale,
    adagrad,
    adam,
    adamw,
    hyperparameters,
    learned_rates,
    resolve_loss_scale,
    rmsprop,
    sgd,
)
from ._exact import NO_BUFFERS
from ._learner import Learner

OptimizerFactory = Callable[[LearningRate], InnerOptimizer]


class InnerSettings(TypedDict, total=False):
    """The inner loop's settings, as :class:`Algorithm` takes them (its signature holds the
    defaults; :class:`metaddp.MAML` documents each). The algorithms built on it take them as
    ``**settings`` and pass them on, so a setting is named in one signature."""

    inner_lr: float
    steps: int
    first_order: bool
    optimizer: InnerOptimizer | OptimizerFactory | None
    learn_lr: str | None
    memory: str | Replay
    autocast: torch.dtype | None
    loss_scale: LossScale | bool | None
    batched: bool | None


def own_loss(what: str) -> tuple[str, str]:
    """Why a class with a task loss of its own (``what``) has no ``batched=True``
    (a :attr:`Supports.why` pair)."""
    return (
        "stacked",
        "stacked tasks run MAML's own adapt-then-query loss under one vmap; "
        f"{what} is a loss of its own, so its tasks run one by one (batched=None or False)",
    )


# Where dropout cannot be keyed (metaddp.forward): the error says why.
PREDICTION = -1  # the forward number of predict(): none of the loops' (0, 1, 2, ...)
OWN = (
    "a forward you run yourself (learner(x, fast)) under MetaDDP says nothing of which samples "
    "it runs on: call model.eval() to evaluate, run it inside learner.local() for one "
    "process's own work, or compute losses through meta_loss or adapt"
)
CLONED = (
    "clone()'s learner runs forwards whose samples metaddp is not told: use meta_loss or "
    "adapt, which key every forward by its batch"
)


def _unknown_count(n_local: int) -> int:
    raise RuntimeError(
        "the number of tasks in the global meta-batch is unknown: this algorithm runs on "
        "several processes with an explicit reduce= but is not wrapped in metaddp.MetaDDP. "
        "Pass the tasks as a metaddp.MetaBatch (MetaBatch.shard(...)), which carries the "
        "global count, or wrap the algorithm in MetaDDP."
    )


def _reads_rates_entrywise(factory: Any) -> bool:
    """Whether ``factory(rates)`` is one of metaddp's optimizers (a ``functools.partial`` of
    one too), which read each learned rate entry by entry."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return factory in (sgd, adam, adamw, rmsprop, adagrad)


def refuse_transform(optimizer: InnerOptimizer) -> None:
    """Refuse a gradient transformation given as the inner optimizer: its output is a
    gradient, which applied as a step would climb the loss."""
    if optimizer.transforms:
        raise ValueError(
            "the inner optimizer is a gradient transformation (clip_by_global_norm), whose "
            "output is a gradient, not a step: chain it before an optimizer, "
            "metaddp.inner.chain(metaddp.inner.clip_by_global_norm(1.0), metaddp.inner.sgd(lr))"
        )


def need_loss(loss_fn: LossFn | None, who: str) -> LossFn:
    """``loss_fn``; refuse an adaptation without its per-sample loss function."""
    if loss_fn is None:
        raise TypeError(
            f"{who}.adapt(support, loss_fn) needs the per-sample loss of its inner steps "
            "(reduction='none')"
        )
    return loss_fn


def local_fraction(batch: Batch) -> float:
    """The fraction of ``batch``'s global samples this rank holds.

    Over the ranks that split a batch these fractions add up to one, so a quantity every
    one of them holds in full (a displacement, an implicit gradient) weighted by it becomes
    a share, and the usual SUM of meta-gradients counts it once.
    """
    return batch.x.shape[0] / batch.n


class Algorithm(nn.Module):
    """The base of MAML, Meta-SGD, ANIL, Reptile and iMAML (see :class:`metaddp.MAML`).

    Subclasses implement :meth:`task_loss`; those that adapt only part of the model override
    :meth:`adapted_module` and :meth:`forward`.
    """

    supports: ClassVar[Supports] = Supports()
    """What this algorithm offers (:class:`metaddp.algorithms.Supports`); subclasses declare
    theirs."""

    draw_seed: int = 0
    """The seed of the dropout masks (:mod:`metaddp.forward`): with the meta-step, the task's
    global index and the sample's, it keys every mask, so the masks are the same on any
    number of processes. ``metaddp train`` sets it to the run's seed."""

    draw_step: int = 0
    """The meta-step the masks are keyed by: set by :meth:`at_step`, else advanced by one
    after every ``meta_loss``."""

    metaddp_bound: Collectives | None = None
    """The reductions of the :class:`metaddp.MetaDDP` that wraps this algorithm, set by it
    (:mod:`metaddp._binding`); ``None``: one process's, or an error on several."""

    def __init__(
        self,
        model: nn.Module,
        *,
        inner_lr: float = 0.01,
        steps: int = 1,
        first_order: bool = False,
        optimizer: InnerOptimizer | OptimizerFactory | None = None,
        learn_lr: str | None = None,
        memory: str | Replay = "default",
        autocast: torch.dtype | None = None,
        loss_scale: LossScale | bool | None = DEFAULT_LOSS_SCALE,
        batched: bool | None = None,
    ) -> None:
        super().__init__()
        inner_lr = positive(inner_lr, "inner_lr")
        steps = positive(steps, "steps (inner steps per task)", integer=True)
        if not isinstance(first_order, bool):
            raise TypeError(f"first_order must be True or False, got {first_order!r}")
        refuse_data_parallel(model)
        self.supports.refuse(
            type(self).__name__, autocast=autocast is not None, learn_lr=learn_lr is not None
        )
        if autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"autocast must be None, torch.bfloat16 or torch.float16, got {autocast}"
            )
        self.autocast = autocast
        self.model = model
        self._inner_lr, self.steps, self.first_order = inner_lr, steps, first_order
        self.memory = memory
        self.lr: LearnedLR | None = None
        self._factory: OptimizerFactory | None = None
        self.optimizer: InnerOptimizer | None = None
        # The optimizer built from inner_lr and how (setting inner_lr later rebuilds it).
        self._from_rate: tuple[OptimizerFactory, InnerOptimizer] | None = None
        if learn_lr is not None:
            if isinstance(optimizer, InnerOptimizer):
                raise TypeError(
                    "with learn_lr the optimizer must be a factory taking the learning rate "
                    "(e.g. metaddp.inner.sgd or functools.partial(metaddp.inner.adam, b1=0.5)), "
                    "not a built optimizer"
                )
            self.lr = LearnedLR(self.fast_weights(), inner_lr, learn_lr)
            self._factory = optimizer or sgd
            refuse_transform(self._factory(self.lr.as_dict()))
        else:
            if optimizer is None or not isinstance(optimizer, InnerOptimizer):
                factory = optimizer or sgd
                optimizer = factory(inner_lr)
                self._from_rate = (factory, optimizer)
            self.optimizer = optimizer
            refuse_transform(self.optimizer)
        self.loss_scale = loss_scale
        self.batched = batched

    @property
    def memory(self) -> str | Replay:
        """How the inner steps' graphs are held: ``"default"`` (every step's kept),
        ``"low"`` (every step's weights kept, each graph rebuilt) or a
        :class:`metaddp.Replay` tree. Checked when set, as at construction: an unknown mode,
        or a mode the class does not declare (``supports.low_memory``), is refused with the
        reason; so is a rebuilt loop under float16 (:meth:`low_float16`)."""
        return self._memory

    @memory.setter
    def memory(self, value: str | Replay) -> None:
        mode = memory_mode(value)
        self.supports.refuse(
            type(self).__name__, {"low_memory": f"memory={mode!r}"}, low_memory=mode != "default"
        )
        before, self._memory = self.__dict__.get("_memory"), mode
        try:
            self.low_float16()
        except ValueError:
            if before is not None:  # a refused change leaves the mode as it was
                self._memory = before
            raise

    def low_float16(self) -> None:
        """Refuse a rebuilt loop (``memory="low"`` or a replay, second order) under float16
        autocast: its meta-gradient is computed inside ``meta_loss``, so no scale reaches
        its float16 backward passes."""
        if self._rematerialized() and self.autocast == torch.float16:
            raise ValueError(
                f"{type(self).__name__}: memory={self.memory!r} computes the meta-gradient "
                "inside meta_loss, at an upstream gradient of one, so neither the inner "
                "steps' loss scaling nor the outer backward's (torch.amp.GradScaler) reaches "
                "its float16 backward passes, where small gradients underflow (0.15 off "
                "float64 where the default mode is 8e-4). Use autocast=torch.bfloat16, "
                "first_order=True (its loop scales) or memory='default'"
            )

    @property
    def batched(self) -> bool | None:
        """Stacked tasks (``batched=True``) where the class declares them
        (``supports.stacked``: MAML and its family, whose property this is); elsewhere
        ``None`` or ``False``, tasks one by one, and ``True`` is refused with the reason."""
        return None

    @batched.setter
    def batched(self, value: bool | None) -> None:
        if value not in (True, False, None):
            raise TypeError(f"batched must be True, False or None, got {value!r}")
        self.supports.refuse(type(self).__name__, stacked=bool(value))

    # Whether the inner rates are parameters of the algorithm's own (MAML++'s per-step rates),
    # besides learn_lr's: inner_lr is then their initial value only.
    learns_rates: ClassVar[bool] = False

    @property
    def inner_lr(self) -> float:
        """The inner step size (the learned rates' initial value with ``learn_lr``). Set on
        an algorithm whose optimizer was built from it, the optimizer is built again with
        the new rate; elsewhere setting it is refused, since nothing would read it."""
        return self._inner_lr

    @inner_lr.setter
    def inner_lr(self, value: float) -> None:
        value = positive(value, "inner_lr")
        built = self._from_rate
        if self.lr is not None or self.learns_rates:
            raise AttributeError(
                f"{type(self).__name__} learns its inner rates: they are parameters, trained "
                "by the outer optimizer; inner_lr was only their initial value"
            )
        if built is None or self.optimizer is not built[1]:
            raise AttributeError(
                "this algorithm's inner optimizer was given with its own rate, which inner_lr "
                "does not change: assign a new one instead (algorithm.optimizer = "
                "metaddp.inner.sgd(lr))"
            )
        optimizer = built[0](value)
        refuse_transform(optimizer)
        self._inner_lr, self.optimizer, self._from_rate = value, optimizer, (built[0], optimizer)

    @property
    def loss_scale(self) -> LossScale | None:
        """The inner steps' dynamic loss scaling (:class:`metaddp.inner.LossScale`), or ``None``.

        On by default (``LossScale()``) with ``autocast=torch.float16``, off otherwise; set
        ``None`` or ``False`` to turn it off. Every inner loop that runs tasks one by one in
        ``memory="default"`` scales (:func:`metaddp.inner_steps`: MAML and its family,
        MAML++, ProtoMAML, ``adapt``). With float16, the paths that do not scale refuse it
        rather than drop it: stacked tasks (``batched=True``) and ``clone()``;
        ``memory="low"`` refuses float16 itself (:meth:`low_float16`). Each task's scale
        starts at ``init``, whichever rank runs it."""
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, value: LossScale | bool | None) -> None:
        self._loss_scale = resolve_loss_scale(value, self.autocast)
        if getattr(self, "batched", None):  # MAML's stacked tasks
            self.unscaled("batched=True (stacked tasks)")

    def unscaled(self, path: str) -> None:
        """Refuse ``path``, which runs the inner steps without loss scaling, while float16
        loss scaling is in force: it would be silently lost. (A scale given with another
        precision changes nothing but rounding, so there it is not refused.)"""
        if self.loss_scale is None or self.autocast != torch.float16:
            return
        raise ValueError(
            f"{type(self).__name__}: {path} runs the inner steps without loss scaling, which "
            f"is on ({self.loss_scale!r}; autocast=torch.float16 turns it on by default). "
            "Build it with loss_scale=None to run float16 unscaled (small gradients may "
            "underflow), with autocast=torch.bfloat16, or on a path that scales "
            "(memory='default', tasks one by one, meta_loss and adapt)"
        )

    def _rematerialized(self) -> bool:
        """Whether ``memory="low"`` rebuilds the inner steps (not first order, which keeps
        no inner graph and runs the default loop)."""
        return self.memory != "default" and not self.first_order

    def _replay(self) -> Replay | None:
        return self.memory if isinstance(self.memory, Replay) else None

    # --- what subclasses change ------------------------------------------------------------

    def adapted_module(self) -> nn.Module:
        """The module whose parameters the inner loop adapts (the whole model here)."""
        return self.model

    def fast_reduce(self, reduce: Reduce) -> Reduce:
        """The SUM of the inner gradients of this algorithm's fast weights: ``reduce``, which
        tells a sharded weight's rows by name (ANIL: of a head that is whole wherever the
        body is sharded, summed as statistics are)."""
        return reduce

    def sharded_module(self) -> nn.Module | None:
        """The module whose trained parameters ``MetaDDP(..., shard=True)`` cuts into rows:
        the model, where the inner loop adapts all of it (its fast weights are then rows
        too); ``None`` where it adapts a part only."""
        return self.model if self.adapted_module() is self.model else None

    def task_loss(self, task: Task, loss_fn: LossFn, *, reduce: Reduce) -> Tensor:
        """This rank's share of one task's contribution to the meta-loss."""
        raise NotImplementedError

    def forward(self, x: Tensor, fast: Mapping[str, Tensor] | None = None) -> Tensor:
        """The model on ``x`` with fast weights ``fast`` (default: the meta-parameters)."""
        return call(self.model, fast if fast is not None else self.fast_weights(), x)

    def settings(self) -> dict[str, object]:
        """The settings that define this algorithm's meta-gradient (subclasses add theirs)."""
        return {
            "algorithm": type(self).__name__,
            "steps": self.steps,
            "inner_lr": self.inner_lr,
            "first_order": self.first_order,
            "learn_lr": None if self.lr is None else self.lr.per,
            # The inner optimizer's own numbers (a rate given as md.inner.sgd(lr), betas...):
            # ranks whose optimizers differ would adapt differently without an error.
            "optimizer": None if self.optimizer is None else hyperparameters(self.optimizer),
            "autocast": None if self.autocast is None else str(self.autocast),
            "loss_scale": None if self.loss_scale is None else repr(self.loss_scale),
            # The dropout keys, for a model that may draw: ranks told different seeds or
            # meta-steps would draw different masks, so they fail at the gradient SUM instead.
            **(
                {"draw_seed": self.draw_seed, "draw_step": self.draw_step}
                if needs_routes(self.model)
                else {}
            ),
        }

    def at_step(self, step: int) -> None:
        """A training loop says which meta-step (0-based) comes next, before its
        ``meta_loss``. Algorithms with schedules (MAML++'s annealed losses and order) read
        it; the rest key their dropout masks by it."""
        self.draw_step = step

    def signature(self) -> str:
        """:meth:`settings` as text; ``MetaDDP`` checks that every rank has the same."""
        return repr(sorted(self.settings().items()))

    # --- shared -----------------------------------------------------------------------------

    def inner_optimizer(self) -> InnerOptimizer:
        """The inner optimizer, built on the current learned rates when they are learned."""
        if self.lr is None:
            return self._optimizer_on(None)
        # On sharded weights, each per-entry rate's rows of this rank (where it holds rows).
        return self._optimizer_on(rows_like(self.model, self.lr.as_dict(), self.fast_weights))

    def _optimizer_on(self, rates: Params | None) -> InnerOptimizer:
        """The inner optimizer built on ``rates`` (learned rates, as deterministic mode
        copies them per task), or the fixed one where ``rates`` is ``None``."""
        if rates is None:
            assert self.optimizer is not None
            return self.optimizer
        assert self._factory is not None
        return self._factory(rates)

    def fast_weights(self) -> Params:
        """The weights adaptation starts from (the meta-parameters themselves)."""
        return params_of(self.adapted_module())

    def collectives(self, reduce: Reduce | None = None) -> Collectives:
        """The reductions to use: those of the wrapping :class:`metaddp.MetaDDP`, with
        ``reduce`` in place of its sample-axis SUM when given. Under a wrapper that splits the
        work, a model whose draws metaddp cannot key to samples is refused (dropout is
        keyed: :mod:`metaddp.forward`)."""
        if reduce is None:
            found = collectives_for(self)
            if found.split and (drawn := unkeyable_layers(self.model)):
                raise ValueError(
                    f"layers {'; '.join(drawn[:3])}: they draw random numbers in training mode "
                    "that metaddp does not key to samples, so the meta-gradient would change "
                    "with the number of processes and the split of the samples. Call .eval() "
                    "on them or replace them (nn.Dropout is keyed); learner.local() runs them "
                    "on one process"
                )
            return found
        try:
            bound = collectives_for(self)
        except RuntimeError:
            return Collectives(reduce, _unknown_count, "an explicit reduce", samples_split=True)
        return dataclasses.replace(
            bound, reduce=reduce, where="an explicit reduce", exact=None, samples_split=True
        )

    def per_sample(
        self, loss_fn: LossFn, c: Collectives | None = None, *, key: Any = None
    ) -> LossFn:
        """``loss_fn``, checked to give one loss per sample where ranks split a task's
        samples, and printed for the ranks' comparison wherever processes split the work
        (:class:`metaddp._share.PerSampleCheck`); as it is elsewhere. ``c``: the step's
        collectives (default: the bound ones); ``key``: what identifies a loss function
        built anew for each call (default: the function itself)."""
        if c is None:
            try:
                c = collectives_for(self)
            except RuntimeError:  # unbound on several processes: meta_loss says so
                return loss_fn
        if not (c.samples_split or c.split) or isinstance(loss_fn, PerSampleCheck):
            return loss_fn
        seen = self.__dict__.get("_per_sample_seen")
        if seen is None:  # the loss functions checked already (weakly: lambdas come and go)
            seen = self.__dict__["_per_sample_seen"] = weakref.WeakKeyDictionary()
        # Deterministic mode calls the loss function on fixed chunks of a task's samples, on
        # one process too: a statistic of its batch would be one of the chunk's.
        cut = c.samples_split or c.exact is not None
        return PerSampleCheck(
            loss_fn, c.note, c.counting, seen, cut=cut, key=key, printing=c.printing
        )

    def inner_loop(
        self,
        support: Batch,
        loss_fn: LossFn,
        *,
        reduce: Reduce,
        steps: int | None = None,
        start: Params | None = None,
        extra_grad: Callable[[Params], Params] | None = None,
    ) -> Params:
        """The algorithm's inner loop on ``support`` from ``start`` (default: the
        meta-parameters), with its own optimizer, step count and order."""
        module = self.adapted_module()
        start = self.fast_weights() if start is None else start
        steps = self.steps if steps is None else steps
        if self._rematerialize():
            if extra_grad is not None:
                raise ValueError(f"{type(self).__name__} has no memory='low' mode")
            self.low_float16()
            return rematerialized_loop(
                lambda fast, buffers, _: batch_share(module, fast, support, loss_fn, buffers),
                start,
                steps=steps,
                optimizer=self.inner_optimizer,  # built for each step: a factory's rates anew
                reduce=reduce,
                extras=self._needing_grad(support),
                buffers=dict(module.named_buffers()),
                check=check_finite,
                replay=self._replay(),
            )
        return inner_loop(
            module,
            start,
            support,
            loss_fn,
            steps=steps,
            optimizer=self.inner_optimizer(),
            first_order=self.first_order,
            reduce=reduce,
            extra_grad=extra_grad,
            loss_scale=self.loss_scale,
        )

    def sharded_refusal(self) -> str | None:
        """Why this algorithm, as configured, cannot run on sharded meta-parameters
        (``MetaDDP(..., shard=True)``), or ``None``. Its inner steps must treat every entry
        on its own (a norm or a learned per-entry rate would see one rank's rows)."""
        name = type(self).__name__
        if self.lr is not None:
            # Learned rates are cut like the weights they go with (inner_optimizer): the
            # factory must read each rate entry by entry, and its optimizer, judged with one
            # rate per tensor, must be entry by entry too.
            assert self._factory is not None
            if not _reads_rates_entrywise(self._factory):
                return (
                    f"{name}(learn_lr=...) with an optimizer factory of its own: on shards it "
                    "is given each rank's rows of every rate, which a factory that reads a "
                    "rate as a whole (its mean, its norm) would misread. Use "
                    "metaddp.inner.sgd, adam, adamw, rmsprop or adagrad (functools.partial "
                    "for their other settings)"
                )
            optimizer = self._factory({k: r.new_ones(()) for k, r in self.lr.as_dict().items()})
        else:
            optimizer = self.inner_optimizer()
        if not optimizer.entrywise:
            return (
                f"{name}'s inner optimizer is not entry by entry (a chain, a gradient clip, "
                "rates per entry), so on shards it would see one rank's rows: use "
                "metaddp.inner.sgd, adam, adamw, rmsprop or adagrad with number rates, or one "
                "rate per tensor (learned rates, learn_lr=, are cut with the weights)"
            )
        if self.loss_scale is not None:
            return "float16 loss scaling skips steps by a verdict over every row: use bfloat16"
        return None

    def _rematerialize(self) -> bool:
        return self._rematerialized() and torch.is_grad_enabled()

    def _needing_grad(self, *batches: Batch) -> list[Tensor]:
        """What the inner steps read besides the weights that needs a gradient: the learned
        rates (``learn_lr``'s, or tensors given to the optimizer), the adapted module's
        trained parameters that are not fast weights (BOIL's head, CAVIA's network: read as
        the meta-parameters they are), and inputs computed from parameters (ANIL's body
        features)."""
        rates: list[Tensor]
        if self.lr is not None:
            rates = list(self.lr.parameters())
        else:
            rates = list(learned_rates(self.inner_optimizer()))
        fast = self.fast_weights()
        held = [p for k, p in params_of(self.adapted_module()).items() if k not in fast]
        found = rates + held + [b.x for b in batches if b.x.requires_grad]
        # Once each: a tensor listed twice would have its gradient counted twice.
        return list({id(t): t for t in found}.values())

    def adapted_loss(
        self, support: Batch, query: Batch, loss_fn: LossFn, *, reduce: Reduce
    ) -> Tensor:
        """This rank's share of the query loss after the inner loop on ``support``.

        With ``memory="low"`` the meta-gradient is computed here, one rebuilt inner step's
        graph at a time, so a task holds only gradients the size of its weights until the
        backward (:func:`metaddp._remat.rematerialized_loss`).
        """
        module = self.adapted_module()
        if not self._rematerialize():
            fast = self.inner_loop(support, loss_fn, reduce=reduce)
            return batch_share(module, fast, query, loss_fn)
        self.low_float16()
        return rematerialized_loss(
            lambda fast, buffers, _: batch_share(module, fast, support, loss_fn, buffers),
            lambda fast, buffers: batch_share(module, fast, query, loss_fn, buffers),
            self.fast_weights(),
            steps=self.steps,
            optimizer=self.inner_optimizer,  # built for each step: a factory's rates anew
            reduce=reduce,
            extras=self._needing_grad(support, query),
            buffers=dict(module.named_buffers()),
            check=check_finite,
            replay=self._replay(),
        )

    def adapt(
        self,
        support: Batch,
        loss_fn: LossFn | None = None,
        *,
        steps: int | None = None,
        reduce: Reduce | None = None,
    ) -> Params:
        """Fast weights after ``steps`` (default: the algorithm's) inner steps on ``support``."""
        loss_fn = need_loss(loss_fn, type(self).__name__)
        with self.adapting(support, reduce) as c:
            return self.inner_loop(
                support,
                self.per_sample(loss_fn, c),
                steps=steps,
                reduce=c.reduce,
                extra_grad=self.extra_grad(),
            )

    @contextlib.contextmanager
    def adapting(self, support: Batch, reduce: Reduce | None) -> Iterator[Collectives]:
        """What every ``adapt`` does around its own work: refused in deterministic mode, the
        support checked, the forward passes' precision, draws refused where the work is
        split; yields the reductions to use."""
        self._not_exact("adapt()")
        c = self.collectives(reduce)
        self.check_batches({"the support": support}, c)
        with (
            self.autocasting(),
            refusing_draws(c.split),
            walked_once(),
            _draws.meta_batch(self.draw_seed, self.draw_step, range(1)),
            _draws.task(0),
        ):
            yield c

    def __getstate__(self) -> dict[str, Any]:
        # A copy (copy.deepcopy, pickle) is not wrapped: the wrapper binds what it wraps.
        state = self.__dict__.copy()
        state.pop("metaddp_bound", None)
        state.pop("_per_sample_seen", None)  # weak references: checked again after a copy
        return state

    def check_batches(self, batches: Mapping[BatchKey, Batch], c: Collectives) -> None:
        """Refuse batches that cannot be what they say (:func:`metaddp._data.check_batches`),
        and a module with nothing to train, before any work."""
        like = next((p for p in self.parameters() if p.requires_grad), None)
        if like is None:
            require_trained(self)  # raises: nothing to train
        check_batches(batches, like, whole=not c.samples_split, dtypes=self.autocast is None)

    def extra_grad(self) -> Callable[[Params], Params] | None:
        """What every inner step of :meth:`adapt` and ``clone()`` adds to the loss's gradient
        (iMAML: its proximal term); nothing here."""
        return None

    def _not_exact(self, what: str) -> None:
        # Deterministic mode sums the meta-gradient inside meta_loss's backward; sync_grads()
        # sums nothing, so a gradient through any other path would stay each rank's own.
        try:
            exact = collectives_for(self).exact
        except RuntimeError:  # not wrapped, on several processes: meta_loss says so
            return
        if exact is not None:
            raise TypeError(
                f"{type(self).__name__}.{what} is not available in deterministic mode, whose "
                "meta-gradient comes whole from learner.meta_loss(...): sync_grads() sums "
                "nothing else, so every rank would keep its own gradient. Use meta_loss, or "
                "build MetaDDP without deterministic=True"
            )

    def autocasting(self) -> contextlib.AbstractContextManager[object]:
        """The forward passes' precision: ``torch.autocast`` to :attr:`autocast` on the
        parameters' device when set (the meta-parameters, their gradients and every
        reduction stay in the parameters' dtype), else nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        like = next(self.parameters(), None)
        device = like.device.type if like is not None else "cpu"
        return torch.autocast(device, dtype=self.autocast)

    def task_losses(self, tasks: Sequence[Task], loss_fn: LossFn, reduce: Reduce) -> Tensor:
        """The sum of :meth:`task_loss` over ``tasks`` (one by one)."""
        losses = []
        for i, task in enumerate(tasks):
            with _draws.task(i):
                losses.append(self.task_loss(task, loss_fn, reduce=reduce))
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        return total

    def meta_loss(
        self, tasks: Sequence[Task], loss_fn: LossFn | None = None, *, reduce: Reduce | None = None
    ) -> Tensor:
        """This rank's share of the meta-batch loss: its tasks' query shares over the global
        number of tasks.

        Args:
            tasks: the tasks this rank works on (possibly none), each cut to this rank's
                samples. A :class:`metaddp.MetaBatch` carries the global task count; for a
                plain list it is one integer SUM over the task axis.
            loss_fn: per-sample loss (``reduction='none'``).
            reduce: the sample-axis SUM, when not the wrapping MetaDDP's.
        """
        if loss_fn is None:
            raise TypeError(
                f"{type(self).__name__}.meta_loss(tasks, loss_fn) needs the per-sample loss "
                "function (reduction='none')"
            )
        c = self.collectives(reduce)
        self.check_batches(named_batches(tasks), c)
        checked = self.per_sample(loss_fn, c)
        # The checks inside the step wait on the device and are read once (metaddp._host):
        # in sync_grads under a MetaDDP, else at the end of this call.
        _host.begin_step()
        try:
            with self.autocasting(), refusing_draws(c.split), walked_once():
                loss = self._meta_loss(tasks, checked, c)
            c.check_loss(loss, loss_fn)
            if c.step_ends_in_sync:
                return loss
            check_finite_loss(loss)
        except BaseException:
            if not c.step_ends_in_sync:
                _host.discard()
            raise
        _host.read()
        return loss

    def _draws(self, tasks: Sequence[Task], n_tasks: int) -> Any:
        """The dropout keys of this meta-batch: its tasks' global indices (a plain list holds
        every task where its length is the global count; else they are unknown), then the
        next meta-step's."""
        if isinstance(tasks, MetaBatch):
            indices: range | None = tasks.indices
        else:
            indices = range(len(tasks)) if len(tasks) == n_tasks else None
        scope = _draws.meta_batch(self.draw_seed, self.draw_step, indices)
        self.draw_step += 1
        return scope

    def _meta_loss(self, tasks: Sequence[Task], loss_fn: LossFn, c: Collectives) -> Tensor:
        n_tasks = tasks.n if isinstance(tasks, MetaBatch) else c.count_tasks(len(tasks))
        if n_tasks <= 0:
            raise ValueError("a meta-batch needs at least one task, and no rank holds any")
        draws = self._draws(tasks, n_tasks)  # every rank advances the step, tasks or none
        tasks = tuple(tasks)  # this rank's tasks (a MetaBatch has no len(): it is ambiguous)
        if c.exact is not None:
            with draws, _draws.stacked_tasks(len(tasks)):  # chunks keyed by their samples
                return self.exact_meta_loss(tasks, loss_fn, n_tasks, c.exact)
        if not tasks:
            # A rank holding no task contributes nothing: a zero that backward() accepts but
            # that reaches no parameter. MetaDDP's gradient SUM counts its missing gradients
            # as zeros, and a parameter no rank reaches is still reported as unused.
            like = next(self.parameters(), None)
            zero = torch.zeros(()) if like is None else like.detach().new_zeros(())
            return zero.requires_grad_()
        with draws:
            return self.task_losses(tasks, loss_fn, c.reduce) / n_tasks

    def deterministic_refusal(self) -> str | None:
        """Why this algorithm, as configured, has no deterministic form
        (``MetaDDP(..., deterministic=True)``), or ``None``: read when the wrapper is built
        and again at every deterministic meta-step (settings can change)."""
        if self._rematerialized() or self.autocast is not None:
            return (
                "deterministic mode keeps every inner step's graph, in the parameters' dtype: "
                "use memory='default' and no autocast"
            )
        # Buffers saved with the model (BatchNorm's running statistics), not placeholders
        # that stand for fast weights (CAVIA's context, ProtoMAML's head).
        saved = self.model.state_dict()
        if any(name in saved for name, _ in self.model.named_buffers()):
            return NO_BUFFERS
        return None

    def exact_meta_loss(
        self, tasks: Sequence[Task], loss_fn: LossFn, n_tasks: int, sums: Any
    ) -> Tensor:
        """The meta-loss in deterministic mode (``MetaDDP(..., deterministic=True)``): this
        rank's share, every sum order-free (:mod:`metaddp.algorithms._exact`)."""
        raise TypeError(
            f"{type(self).__name__} has no deterministic form (docs/algorithms.md lists the "
            "algorithms that have one): build MetaDDP without deterministic=True to train it "
            "(exact to rounding)"
        )

    def clone(self, *, reduce: Reduce | None = None) -> Learner:
        """A learner holding its own fast weights, in the style of learn2learn's ``clone``.

        ``learner.adapt(loss)`` takes one inner step on a loss computed with ``learner(x)``;
        ``learner(x)`` runs the model on the current fast weights. The module is never
        modified. Inner gradients are reduced like :meth:`meta_loss`'s, so on several ranks
        the loss given to ``adapt`` must be this rank's share (:func:`metaddp.share`).
        """
        self._not_exact("clone()")
        self.unscaled("clone()'s adapt(loss)")
        require_trained(self)
        c = self.collectives(reduce)
        run = self._run if not c.split else self._run_unkeyed
        return Learner(
            run,
            self.fast_weights(),
            self.inner_optimizer(),
            first_order=self.first_order,
            reduce=self.fast_reduce(c.reduce),
            extra_grad=self.extra_grad(),
            check_share=c.check_share,
        )

    def predict(self, batch: Batch, fast: Mapping[str, Tensor] | None = None) -> Any:
        """The model's predictions on ``batch`` (this rank's part of it) with the fast weights
        ``fast`` (default: the meta-parameters), in the forward passes' precision; dropout in
        training mode draws keyed masks of the batch's samples (those of task 0 of the current
        meta-step, as :meth:`adapt`, in a forward of their own), so predictions on a split
        batch are the one-process ones. Evaluation after ``adapt`` under ``MetaDDP``."""
        with (
            self.autocasting(),
            _draws.meta_batch(self.draw_seed, self.draw_step, range(1)),
            _draws.task(0),
            _draws.keyed_forward(batch, number=PREDICTION),
        ):
            return self(batch.x, fast)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A forward outside metaddp's own loops where the work is split: its dropout cannot be
        # keyed (nothing says which samples it runs on), so it draws nothing (the error says
        # how to evaluate). Inside the loops, and on one process alone, the call is as ever.
        bound = self.metaddp_bound
        if bound is None or not bound.split or _draws.scope_open():
            return super().__call__(*args, **kwargs)
        with _draws.unkeyed(OWN):
            return super().__call__(*args, **kwargs)

    def _run_unkeyed(self, fast: Params, *args: Any, **kwargs: Any) -> Any:
        # clone()'s forwards where the work is split: the loss the user builds from them says
        # nothing of which samples they ran on, so their dropout cannot be keyed.
        with _draws.unkeyed(CLONED):
            return self._run(fast, *args, **kwargs)

    def _run(self, fast: Params, *args: Any, **kwargs: Any) -> Any:
        # Subclasses may take more inputs than ``x``; pass everything through untouched.
        forward: Callable[..., Any] = self.forward
        return forward(*args, fast=fast, **kwargs)
