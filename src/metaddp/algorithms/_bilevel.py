"""Bilevel optimisation: any outer variables, any inner problem, one engine with MAML.

An inner problem adapts the weights of ``model`` by K differentiable optimizer steps on an
inner loss over one batch; an outer loss on another batch scores the adapted weights; the
hypergradient is the outer loss's gradient with respect to the *outer variables*: the
parameters of ``outer`` (a weighting network, hyperparameters, synthetic data), and, when the
inner steps start from them, the model's own weights (MAML). A meta-batch of such problems is
a list of :class:`metaddp.Task`, ``support`` the inner batch and ``query`` the outer one, and
the meta-loss is their mean, exactly as for MAML: MAML is this engine with ``start="outer"``,
the task's loss for both levels and :class:`metaddp.bilevel.Unrolled`.

The reductions are the algorithms' as everywhere: every inner gradient and Hessian-vector
product passes through the wrapper's differentiable SUM, the losses are shares, and the
methods (:mod:`metaddp.algorithms._hypergrad`) compute every norm and coefficient from
reduced vectors, so the hypergradient is the one-process value for any split.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import ClassVar, cast

import torch
from torch import Tensor, nn

from .._adapt import batch_share, check_finite
from .._binding import sharding_of
from .._data import Batch, Shard, Task, at_least, generator_for, whole
from .._functional import generator_states, params_of, refusing_draws, walked_once
from .._reach import shapes, unknown_leaves
from .._remat import Replay, memory_mode, rematerialized_loss
from .._types import LossFn, Params, Reduce, Supports
from ..forward import may_draw
from ..inner import InnerOptimizer, learned_rates
from ._base import Algorithm, local_fraction, own_loss
from ._first_step import FirstStep
from ._hypergrad import InnerProblem, Method, Truncated, Unrolled, held, unroll
from ._learner import Learner

STARTS = ("outer", "current")


@dataclasses.dataclass(frozen=True)
class Minibatches:
    """``Bilevel(..., minibatches=Minibatches(size))``: each inner step trains on its own
    minibatch of the support's samples, as a training run does, instead of on all of them.

    Step k's minibatch is ``size`` samples drawn without replacement from the support's
    ``n`` by a generator of ``(seed, k)`` alone (:func:`metaddp.generator_for`), so every
    rank, every world size and every replay of the step (``memory=Replay``) sees the same
    samples; each rank runs the forward on those of its own part, and their shares sum to the
    minibatch's mean. The sequence is the same at every meta-step: the inner problem is one
    fixed training run, whose metagradient the outer steps follow.

    Args:
        size: samples per inner step (at most the support's).
        seed: the run's seed for the draws.
    """

    size: int
    seed: int = 0

    def __post_init__(self) -> None:
        at_least(self.size, "Minibatches(size=)")
        whole(self.seed, "Minibatches(seed=)")

    def indices(self, n: int, step: int) -> Tensor:
        """Step ``step``'s samples among ``n``: global indices, in increasing order."""
        if self.size > n:
            raise ValueError(f"minibatches of {self.size} samples from a support of {n}")
        g = generator_for(self.seed, step)
        return torch.randperm(n, generator=g)[: self.size].sort().values

    def pick(self, support: Batch, step: int) -> Batch:
        """This rank's part of step ``step``'s minibatch: its own samples among them, a
        shard of a batch of ``size`` whose start is how many fall on the ranks before."""
        local = support.x.shape[0]
        start = getattr(support, "start", None)
        if start is None:
            if local != support.n and local != 0:
                raise ValueError(
                    "minibatches pick samples by their global index: give the support as "
                    "md.Batch.local(x, y, n, start=...) or cut it with learner.shard"
                )
            start = 0
        idx = self.indices(support.n, step)
        mine = idx[(idx >= start) & (idx < start + local)] - start
        before = int((idx < start).sum())  # host integers: nothing waits on a device
        x, y = support.x[mine.to(support.x.device)], support.y[mine.to(support.y.device)]
        return Shard.at(x, y, self.size, before)


def _memory_for(method: Method, memory: str | Replay) -> None:
    """Refuse a memory mode other than the default for a method without unrolled steps."""
    if memory != "default" and not isinstance(method, Unrolled):
        raise ValueError(
            f"memory={memory!r} rebuilds unrolled steps; {type(method).__name__} has none"
        )


class Bilevel(Algorithm):
    """A bilevel problem around any ``nn.Module``, exact on any number of processes.

    Args:
        model: the network whose weights the inner problem adapts.
        outer: a module holding the outer variables besides the model's (a weighting
            network, an ``nn.ParameterDict`` of hyperparameters, synthetic images), or
            ``None``. Its parameters are this module's, so the wrapper keeps them alike on
            every rank and sums their gradients; the loss functions and ``penalty`` read them
            by closure.
        inner_loss: ``inner_loss(prediction, target)``, one loss per sample of the inner
            batch (a reweighting: ``weights * losses``). Default: the ``loss_fn`` given to
            ``meta_loss``.
        outer_loss: the same on the outer batch. Default: the ``loss_fn`` given to
            ``meta_loss``.
        penalty: ``penalty(fast) -> scalar``, a term of the inner objective that is not one per
            sample (a weight decay, iMAML's proximal term), computed in full on every rank and
            counted once over the ranks that split the batch.
        start: ``"outer"``: the inner steps start from the model's weights, which are then
            outer variables too (MAML). ``"current"``: they start from the model's current
            weights as constants (a one-step lookahead, hyperparameter search); the
            hypergradient does not reach them, and a step of the caller's own trains them.
        steps: K, the inner optimizer steps.
        inner_lr: the inner SGD step, when ``optimizer`` is not given.
        optimizer: a differentiable inner optimizer (``metaddp.inner.sgd``,
            ``metaddp.inner.adam``), or a function of nothing that builds one at every
            meta-loss, and at every rebuilt step of ``memory="low"`` (for rates computed
            from outer variables,
            ``lambda: md.inner.sgd({k: v.exp() for k, v in log_lrs.items()})``), or a factory
            of the rate (``md.inner.adam``), called with ``inner_lr``.
        method: the hypergradient method (:class:`metaddp.bilevel.Unrolled` by default;
            ``Truncated``, ``ImplicitCG``, ``Neumann``, ``T1T2``, ``SAMA``).
        memory: ``"low"`` rebuilds one inner step's graph at a time (``Unrolled`` only);
            ``"replay"`` or :class:`metaddp.Replay` keeps O(k log_k K) of the K steps' states
            and replays the rest, for inner problems of thousands of steps.
        weights: a module from per-sample losses (detached) to per-sample weights: the inner
            loss is then ``weights(losses) * losses`` of ``inner_loss`` (Meta-Weight-Net,
            Shu et al. 2019; learning to reweight, Ren et al. 2018). It is an outer variable
            (kept as :attr:`weights`).
        minibatches: :class:`metaddp.bilevel.Minibatches`: each inner step on its own
            minibatch of the support, drawn by step (a training run; with
            ``memory=md.Replay()``, thousands of steps). ``Unrolled`` and ``Truncated`` only.
        batched: ``None`` or ``False``: tasks one by one (``True`` is refused, with the
            reason: its losses are its own, not MAML's adapt-then-query loss).
        train_inner: with ``start="current"``, the meta-loss also carries the gradient of the
            inner objective at the model's current weights, the outer variables held: one
            backward and one optimizer step train both levels (simultaneous updates, where
            Meta-Weight-Net alternates). Without outer variables this is plain training on
            the inner loss.
    """

    # Capture: every method but ImplicitCG, whose conjugate gradient reads its residual on
    # the host (recording it raises CaptureError, naming the read).
    supports: ClassVar[Supports] = Supports(
        low_memory=True,
        sharded=True,
        why=(own_loss("Bilevel's hypergradient (its inner and outer losses, by its method)"),),
    )

    def __init__(
        self,
        model: nn.Module,
        *,
        outer: nn.Module | None = None,
        inner_loss: LossFn | None = None,
        outer_loss: LossFn | None = None,
        penalty: Callable[[Params], Tensor] | None = None,
        start: str = "outer",
        steps: int = 1,
        inner_lr: float = 0.01,
        optimizer: InnerOptimizer | Callable[..., InnerOptimizer] | None = None,
        method: Method | None = None,
        memory: str | Replay = "default",
        weights: nn.Module | None = None,
        train_inner: bool = False,
        minibatches: Minibatches | None = None,
        batched: bool | None = None,
    ) -> None:
        if start not in STARTS:
            raise ValueError(f"start must be one of {', '.join(STARTS)}, got {start!r}")
        method = Unrolled() if method is None else method
        if not isinstance(method, Method):
            raise TypeError(
                f"method must be a hypergradient method (metaddp.bilevel.Unrolled(), ImplicitCG(), "
                f"...), got {type(method).__name__}"
            )
        _memory_for(method, memory_mode(memory))
        if outer is not None and not isinstance(outer, nn.Module):
            raise TypeError(
                f"outer must be an nn.Module (an nn.ParameterDict for loose tensors), got "
                f"{type(outer).__name__}: its parameters are what the wrapper keeps alike and sums"
            )
        builder: Callable[[], InnerOptimizer] | None = None
        if optimizer is not None and not isinstance(optimizer, InnerOptimizer):
            if not callable(optimizer):
                raise TypeError(
                    f"optimizer must be an InnerOptimizer or a function, got {optimizer!r}"
                )
            if _takes_an_argument(optimizer):  # md.inner.sgd, md.inner.adam: a factory of the rate
                optimizer = optimizer(inner_lr)
            else:
                builder, optimizer = cast(Callable[[], InnerOptimizer], optimizer), None
        super().__init__(
            model,
            inner_lr=inner_lr,
            steps=steps,
            optimizer=optimizer,
            memory=memory,
            batched=batched,
        )
        self._build = builder
        self._made: list[weakref.ref[Tensor]] = []  # the rates the last build computed
        if start == "outer" and penalty is None and not method.reaches_start(self.steps):
            raise ValueError(
                f"start='outer' with {type(method).__name__}: that method has no path to the "
                "inner steps' start, so the model's weights would get no gradient. Give a "
                "penalty that reads them (iMAML's proximal term, lam/2 ||fast - theta||^2), use "
                "Unrolled(), or start='current'"
            )
        if train_inner and start != "current":
            raise ValueError(
                "train_inner trains the model on the inner loss at its current weights: it "
                "needs start='current' (with start='outer' the weights are outer variables)"
            )
        if minibatches is not None:
            if not isinstance(minibatches, Minibatches):
                raise TypeError(
                    f"minibatches must be md.bilevel.Minibatches(size), got {minibatches!r}"
                )
            if not isinstance(method, (Unrolled, Truncated)):
                raise ValueError(
                    f"minibatches give each inner step its own objective; {type(method).__name__} "
                    "reads one inner objective at the solution: use Unrolled or Truncated"
                )
            if train_inner:
                raise ValueError(
                    "train_inner trains on the inner objective at the current weights, which "
                    "minibatches leave undefined (whose step?): drop one of them"
                )
        if weights is not None and not isinstance(weights, nn.Module):
            raise TypeError(f"weights must be an nn.Module, got {type(weights).__name__}")
        if start == "current" and outer is None and weights is None and not train_inner:
            raise ValueError(
                "nothing for the hypergradient to reach: with start='current' give the outer "
                "variables (outer=, weights=), or train_inner=True for plain training"
            )
        self.outer = outer
        self.weights = weights
        self.train_inner = bool(train_inner)
        self.minibatches = minibatches
        self.inner_loss, self.outer_loss, self.penalty = inner_loss, outer_loss, penalty
        self.start, self.method = start, method
        # Its own rates it learns through optimizer= (no learn_lr here): they must be ours.
        self._check_rates()

    def _check_rates(self) -> None:
        if self._build is not None:
            return  # built at every meta-loss: MetaDDP's search of the loss finds outsiders
        assert self.optimizer is not None
        ours = {id(p) for p in self.parameters()}
        outside = [r for r in learned_rates(self.optimizer) if id(r) not in ours]
        if outside:
            made = any(r.grad_fn is not None for r in outside)
            raise ValueError(
                f"the inner optimizer learns {len(outside)} rate(s) that are not parameters of "
                "this problem: "
                + (
                    "they are computed tensors, made once when the optimizer was built, which "
                    "would not follow the parameters they come from: pass a function that "
                    "builds the optimizer, optimizer=lambda: md.inner.sgd({...}), and the "
                    "module that holds those parameters as outer="
                    if made
                    else "pass the module that holds them as outer="
                )
            )

    def inner_optimizer(self) -> InnerOptimizer:
        if self._build is not None:
            built = self._build()
            if not isinstance(built, InnerOptimizer):
                raise TypeError(f"optimizer() must return an InnerOptimizer, got {built!r}")
            # A rate computed once and returned again: its graph is spent by the first
            # backward through it (PyTorch's "backward through the graph a second time").
            made = [r for r in learned_rates(built) if r.grad_fn is not None]
            if any(r is seen() for r in made for seen in self._made):
                raise ValueError(
                    "optimizer() returned a learned rate it had returned before, computed "
                    "once from the parameters: compute the rates inside the function "
                    "(optimizer=lambda: md.inner.sgd({k: hp[k].exp() ...})), so that every "
                    "call builds them anew"
                )
            self._made = [weakref.ref(r) for r in made]
            return built
        return super().inner_optimizer()

    def settings(self) -> dict[str, object]:
        return dict(
            super().settings(),
            start=self.start,
            weighted=self.weights is not None,
            minibatches=None if self.minibatches is None else dataclasses.astuple(self.minibatches),
            train_inner=self.train_inner,
            **self.method.settings(),
        )

    def fast_weights(self) -> Params:
        return self._start_at(params_of(self.model))

    def _start_at(self, weights: Params) -> Params:
        if self.start == "outer":
            return weights
        return held(weights, weights)  # each hung off its own weight

    def sharded_refusal(self) -> str | None:
        if not isinstance(self.method, (Unrolled, Truncated)):
            return (
                f"{type(self.method).__name__} computes norms and dot products of whole "
                "vectors; on shards it would see one rank's rows: use Unrolled or Truncated"
            )
        if self.penalty is not None:
            return "a penalty(fast) reads whole weights, which on shards are one rank's rows"
        return super().sharded_refusal()

    def not_reached(self) -> set[str]:
        """The parameters the meta-loss does not reach by design (with ``start="current"``,
        the model's): trained by the caller's own step, so a gradient SUM without them is
        not a mistake."""
        if self.start == "outer" or self.train_inner:
            return set()
        return {f"model.{k}" for k, _ in self.model.named_parameters()}

    def problem(
        self,
        task: Task,
        loss_fn: LossFn | None,
        *,
        reduce: Reduce,
        weighted: bool = True,
        keep_first: bool = False,
    ) -> InnerProblem:
        """The inner problem of ``task``: its support is the inner batch, its query the outer
        (``weighted=False``: without the weighting, whose outer variables it then ignores;
        ``keep_first``: the first inner step's gradient kept, :class:`FirstStep`)."""
        # Its own losses checked as meta_loss checks the one it is given.
        per_sample = self.per_sample(self.inner_loss) if self.inner_loss else loss_fn
        outer_loss = self.per_sample(self.outer_loss) if self.outer_loss else loss_fn
        if per_sample is None or outer_loss is None:
            raise TypeError(
                "this Bilevel has no inner_loss or outer_loss of its own: pass loss_fn to "
                "meta_loss(tasks, loss_fn), or build it with both"
            )
        model, penalty, support = self.model, self.penalty, task.support
        weights = self.weights if weighted else None
        inner_loss = per_sample
        if weights is not None:  # weights that read their batch (a normalisation) refused
            inner_loss = self.per_sample(_weighted(per_sample, weights), key=weights)

        minibatches = self.minibatches

        def inner(fast: Params, step: int | None = None) -> Tensor:
            batch = support
            if minibatches is not None:
                assert step is not None, "with minibatches every inner objective is a step's"
                batch = minibatches.pick(support, step)
            loss = batch_share(model, fast, batch, inner_loss)
            if penalty is None:
                return loss
            # Every rank computes the penalty in full; weighted by its fraction of the batch,
            # the SUM over the ranks counts it once.
            return loss + penalty(fast) * local_fraction(support)

        def outer(fast: Params) -> Tensor:
            return batch_share(model, fast, task.query, outer_loss)

        own = params_of(self.model)
        start = self._start_at(own)
        return InnerProblem(
            inner, outer, start, self.steps, self.inner_optimizer(), reduce, check_finite,
            FirstStep(own, start) if keep_first else None,
        )  # fmt: skip

    def task_loss(self, task: Task, loss_fn: LossFn | None, *, reduce: Reduce) -> Tensor:
        keep = self.train_inner and self._same_objective()
        p = self.problem(task, loss_fn, reduce=reduce, keep_first=keep)
        drawn = generator_states() if keep else None
        loss = self._hypergradient(p, task, reduce)
        if not self.train_inner:
            return loss
        # The inner objective's gradient in the model's own weights, the outer variables
        # held: a share's gradient (the wrapper's SUM makes it the batch's). The first inner
        # step took it at held copies of these weights (FirstStep), unless it ran no step
        # there or something drew from torch's generators meanwhile.
        first = p.first
        if first is not None and (first.grads is None or drawn != generator_states()):
            first = None
        with torch.enable_grad():
            if first is None:
                theta = params_of(self.model)
                objective = p.inner(theta, None)
            else:
                theta, objective = first.weights, cast(Tensor, first.objective)
            # This gradient is taken without its graph: a trained tensor the inner loss reads
            # from outside the problem (a weighting network by closure) would get nothing.
            if outside := unknown_leaves([objective], list(self.parameters())):
                raise ValueError(
                    f"the inner loss reads {len(outside)} trained tensor(s) of shape "
                    f"{shapes(outside)} that are not parameters of this problem, which would "
                    "get no gradient: pass a weighting network as weights= (or the module that "
                    "holds them as outer=), or freeze them (requires_grad=False)"
                )
            g = (
                torch.autograd.grad(
                    objective, list(theta.values()), allow_unused=True, materialize_grads=True
                )
                if first is None
                else cast(list[Tensor], first.grads)
            )
        step = cast(
            Tensor, sum((w * d.detach()).sum() for w, d in zip(theta.values(), g, strict=True))
        )
        return loss + (step - step.detach())

    def _same_objective(self) -> bool:
        """Whether the inner objective at the model's weights, computed again, would be the
        first inner step's to the bit: no module may draw (keyed dropout differs by the
        forward's number, and a module's own draws by the generator's state) or hold a
        buffer (running statistics move at every forward), and the weights are whole.
        (Draws from torch's generators in the loss functions are seen after the steps:
        ``task_loss``.)"""
        if sharding_of(self.model) is not None:
            return False
        return not any(m._buffers or may_draw(m) for m in self.modules())

    @property
    def memory(self) -> str | Replay:
        """As :attr:`metaddp.MAML.memory`; a mode other than ``"default"`` needs the
        ``Unrolled`` method, checked when set."""
        return self._memory

    @memory.setter
    def memory(self, value: str | Replay) -> None:
        mode = memory_mode(value)
        if "method" in self.__dict__:  # set later; the constructor checks before
            _memory_for(self.method, mode)
        Algorithm.memory.fset(self, mode)  # type: ignore[attr-defined]

    def _hypergradient(self, p: InnerProblem, task: Task, reduce: Reduce) -> Tensor:
        if self.start == "current" and not any(t.requires_grad for t in self._outer_params()):
            return p.outer(p.start).detach()  # no outer variable to reach: the loss alone
        if isinstance(self.method, Unrolled) and self._rematerialize():
            return rematerialized_loss(
                lambda fast, buffers, step: p.inner(fast, step),
                lambda fast, buffers: p.outer(fast),
                p.start,
                steps=p.steps,
                optimizer=self.inner_optimizer,  # built for each step: a factory's rates anew
                reduce=reduce,
                extras=self._outer_tensors(task, p.optimizer),
                check=check_finite,
                replay=self._replay(),
            )
        return self.method.loss(p)

    def _outer_params(self) -> list[Tensor]:
        mine = {id(p) for p in self.model.parameters()}
        return [p for p in self.parameters() if p.requires_grad and id(p) not in mine]

    def _outer_tensors(self, task: Task, optimizer: InnerOptimizer) -> list[Tensor]:
        # What the rebuilt steps read besides the fast weights that needs a gradient. From
        # the meta-parameters, a penalty may read them as well (iMAML's proximal term).
        others = self._outer_params()
        if self.start == "outer" and self.penalty is not None:
            others += [p for p in self.model.parameters() if p.requires_grad]
        read = learned_rates(optimizer)
        # A rate computed from tensors (optimizer=lambda: sgd(hp["a"].exp())) is computed anew
        # for every rebuilt step: the leaves it is computed from are the inputs, not it.
        rates = [r for r in read if r.is_leaf] + unknown_leaves(read, others)
        inputs = [b.x for b in (task.support, task.query) if b.x.requires_grad]
        # Once each (distilled images are outer parameters and the inner batch's inputs): a
        # tensor listed twice would have its gradient counted twice.
        return list({id(t): t for t in (*others, *rates, *inputs)}.values())

    def meta_loss(
        self, tasks: Sequence[Task], loss_fn: LossFn | None = None, *, reduce: Reduce | None = None
    ) -> Tensor:
        """This rank's share of the mean outer loss over the meta-batch's problems, whose
        gradient is its share of the hypergradient. ``loss_fn`` is the default of both
        levels' losses."""
        return super().meta_loss(tasks, loss_fn or self._own_losses, reduce=reduce)

    def _own_losses(self, prediction: Tensor, target: Tensor) -> Tensor:
        raise TypeError("the inner and outer losses are the problem's own")  # never called

    def task_losses(self, tasks: Sequence[Task], loss_fn: LossFn, reduce: Reduce) -> Tensor:
        # meta_loss without a loss_fn: the problem's own (as given, or checked per sample).
        own = getattr(loss_fn, "loss_fn", loss_fn) == self._own_losses
        return super().task_losses(tasks, cast(LossFn, None) if own else loss_fn, reduce)

    def adapt(
        self,
        support: Batch,
        loss_fn: LossFn | None = None,
        *,
        steps: int | None = None,
        reduce: Reduce | None = None,
        weighted: bool = True,
    ) -> Params:
        """The fast weights after the inner steps (penalty included) on ``support``, the
        inner batch, with their graph. ``weighted=False``: the same steps on the plain losses,
        without ``weights`` (the training a weighting is measured against)."""
        c = self.collectives(reduce)
        self.check_batches({"the support": support}, c)
        given = None if loss_fn is None else self.per_sample(loss_fn, c)
        p = self.problem(
            Task(support, support), given or self.outer_loss, reduce=c.reduce, weighted=weighted
        )
        k = self.steps if steps is None else steps
        with refusing_draws(c.split), walked_once():
            return unroll(p, p.start, p.optimizer.init(p.start), k)

    def clone(self, *, reduce: Reduce | None = None) -> Learner:
        """A learner whose ``adapt(loss)`` steps on the loss the caller computes, unrolled:
        only a problem that is nothing more has one (the inner objective, its weighting, a
        penalty, the start and the method would otherwise be dropped without a word)."""
        dropped = [
            what
            for what, there in (
                ("a penalty", self.penalty is not None),
                ("inner_loss=", self.inner_loss is not None),
                ("weights=", self.weights is not None),
                ("train_inner=True", self.train_inner),
                ("minibatches=", self.minibatches is not None),
                ("start='current'", self.start == "current"),
                (f"method={type(self.method).__name__}()", not isinstance(self.method, Unrolled)),
            )
            if there
        ]
        if dropped:
            raise TypeError(
                f"this Bilevel has no clone(): the learner's adapt(loss) steps, unrolled, on "
                f"the loss you compute, so its {', '.join(dropped)} would be dropped. Use "
                "learner.meta_loss(tasks) and learner.adapt(support), which solve the problem "
                "as built"
            )
        return super().clone(reduce=reduce)


def _weighted(per_sample: LossFn, weights: nn.Module) -> LossFn:
    def loss(prediction: Tensor, target: Tensor) -> Tensor:
        losses = per_sample(prediction, target)
        return weights(losses.detach()).reshape(losses.shape) * losses

    return loss


class WeightNet(nn.Module):
    """Meta-Weight-Net's weighting function (Shu et al. 2019): one hidden layer from a
    sample's loss to its weight in (0, 1).

    Args:
        hidden: the hidden layer's width (the paper's 100).
    """

    def __init__(self, hidden: int = 100) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, losses: Tensor) -> Tensor:
        return torch.sigmoid(self.net(losses.reshape(-1, 1))).reshape(losses.shape)


def _takes_an_argument(fn: Callable[..., object]) -> bool:
    """Whether ``fn`` needs a positional argument (a factory of the learning rate)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in params
    )
