"""Guards: the wrapper's checks, at named points of a meta-step, over state it owns.

A meta-step passes five points, and every refusal of :class:`metaddp.MetaDDP` belongs to one:

- **tasks in** (``shard``, ``meta_loss``, ``adapt``): batches that cannot be what they say,
  whole batches where ranks split the samples, and on checked steps the ranks' agreement on
  the meta-batch (its size, every batch's global size, the tasks' data), the weights, the
  modules' modes and which parameters train;
- **share in** (``clone()``'s ``adapt``, ``grad``): a loss that is not a share of a known
  batch, where ranks split the samples;
- **loss out** (``meta_loss``'s result): a trained tensor outside the module;
- **before the sum** (``sync_grads``): gradients summed twice; on checked steps, what the
  step computed that no earlier check saw (loss prints, the caller's shares:
  :mod:`metaddp.distributed._work`); the meta-loss's finiteness rides in the same SUM;
- **after the sum**: the step is counted, and the next one's checks scheduled.

Checks that cost a collective run on *checked steps* only (:class:`Schedule`): the first
meta-step of every learner and a sparse sample of later ones (steps 1, 4, 16, 64, ...), or
every step in check mode. Every verdict that follows a collective is made from values all
ranks hold, so all ranks raise together and none is left waiting in the next collective.

[Note: fingerprints] A task's fingerprint is a few float64 sums over its tensors, two per
tensor (plain and position-weighted, so that reordered samples differ). Ranks that build the
same task with the same code get the same bits; two different draws differ in the first
digits. The comparison allows a relative 1e-9, far above any reduction-order difference of a
float64 sum of a few thousand terms and far below a different draw.
"""

from __future__ import annotations

import contextlib
import math
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _host
from .._adapt import NON_FINITE_LOSS, finite_flags
from .._data import Batch, BatchKey, MetaBatch, Task, batch_name, named_batches
from .._functional import OTHER_DRAWS, OtherDraws, refuse_data_parallel, require_trained
from .._reach import listing, shapes, unknown_leaves
from .._share import LOG, NOT_PER_SAMPLE, share_of
from .._types import LossFn, Supports
from ..forward import batch_start
from ..inner import InnerOptimizer, learned_rates
from ._check import OutOfSyncError, WeightCheck
from ._collectives import (
    SKIPPED,
    Group,
    _guard,
    _record,
    agree_on_site,
    all_reduce_counts,
    comm_device,
    group_rank,
    group_size,
    max_abs_difference,
)
from ._mesh import Mesh
from ._sharded import local
from ._unkeyed import UnkeyedDraws
from ._work import PRINTS, judge, work_block

# Relative agreement of two fingerprints: see [Note: fingerprints].
_SAME = 1e-9

# The mistakes a rank finds in its own work during a step, summed over the ranks with the
# step's gradients (every rank raises alike): kind -> the error.
VERDICTS: dict[str, Exception] = {
    "per_sample": ValueError(NOT_PER_SAMPLE),
    "draws": ValueError(OTHER_DRAWS),
    "gradient": FloatingPointError(
        "the meta-gradient is not finite (NaN or Inf) on some rank, though the meta-loss is: "
        "a second-order term divided by zero or a square root at zero (adam(eps_root=0) with "
        "a zero second moment: use eps_root > 0), or a backward of your own that made one. "
        "No optimizer step has used it"
    ),
}


class Schedule:
    """Which meta-steps are checked: the first, then steps 1, 4, 16, 64, ... (powers of 4),
    or every step with ``every``. Counted by ``sync_grads``, alike on every rank."""

    def __init__(self, every: bool) -> None:
        self.every = every
        self.step = 0

    def due(self) -> bool:
        s = self.step
        return self.every or s == 0 or (s & (s - 1) == 0 and (s.bit_length() - 1) % 2 == 0)

    def advance(self) -> None:
        self.step += 1


def extremes(
    values: Sequence[float] | Tensor, group: Group, why: str = SKIPPED
) -> tuple[list[float], list[float]]:
    """Elementwise minimum and maximum of ``values`` over ``group``, in one collective (after
    :func:`agree_on_site`, whose error gives ``why``)."""
    v = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    if group_size(group) == 1 or not v.numel():
        return v.tolist(), v.tolist()
    agree_on_site(group, v.numel(), "guard check", why)
    both = torch.cat([v, -v]).to(comm_device(group))
    _record(both.numel(), both.numel() * 8)
    _guard(lambda: dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group), "guard check")
    top, low = both[: v.numel()].tolist(), (-both[v.numel() :]).tolist()
    return low, top


def _differ(low: Sequence[float], top: Sequence[float]) -> list[int]:
    """The positions whose minimum and maximum differ by more than fingerprints may."""
    return [
        i
        for i, (a, b) in enumerate(zip(low, top, strict=True))
        if abs(b - a) > _SAME * max(1.0, abs(a), abs(b))
    ]


def fingerprint(task: Task) -> Tensor:
    """A float64 summary of a task's four tensors (see [Note: fingerprints]), on their device."""
    tensors = (task.support.x, task.support.y, task.query.x, task.query.y)
    return torch.cat([tensor_print(t) for t in tensors])


def _index_sums(batch: Batch) -> tuple[int, int, int, int]:
    """This rank's part of ``batch``: how many samples, whether its start is unknown, and
    the sums of the global indices it holds and of their squares (0 where unknown)."""
    h = batch.x.shape[0]
    s = batch_start(batch)
    if s is None:
        return h, 1, 0, 0
    e = s + h  # sums over s .. e - 1
    return h, 0, _tiled(e)[0] - _tiled(s)[0], _tiled(e)[1] - _tiled(s)[1]


def _tiled(n: int) -> tuple[int, int]:
    """The sums of 0 .. n-1 and of their squares."""
    return n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6


def tensor_print(t: Tensor) -> Tensor:
    """A float64 summary of one tensor (see [Note: fingerprints]), on its device."""
    f = local(t).detach().reshape(-1).to(torch.float64)  # a DTensor: this rank's rows
    w = torch.cos(torch.arange(f.numel(), dtype=torch.float64, device=f.device))
    return torch.stack([f.sum(), (f * w).sum()])


def _rows(tasks: Sequence[Task]) -> Tensor:
    return torch.stack([fingerprint(t) for t in tasks]) if tasks else torch.zeros(0, 8)


def _gather(rows: Tensor, group: Group) -> list[Tensor]:
    """Every rank's ``rows`` (``[k, 8]``, ``k`` may differ by rank) over ``group``, in rank
    order: two collectives (the longest ``k``, then a SUM of padded blocks)."""
    ranks = group_size(group)
    if ranks == 1:
        return [rows]
    counts = all_reduce_counts(
        [rows.shape[0] if r == dist.get_rank(group) else 0 for r in range(ranks)], group
    )
    width = max(counts) if counts else 0
    block = torch.zeros(ranks, width, rows.shape[1], dtype=torch.float64)
    block[dist.get_rank(group), : rows.shape[0]] = rows
    block = block.to(comm_device(group))
    _record(block.numel(), block.numel() * 8)
    _guard(lambda: dist.all_reduce(block, group=group), "guard check")
    block = block.cpu()
    return [block[r, : counts[r]] for r in range(ranks)]


def refuse_at_construction(module: nn.Module, deterministic: bool) -> None:
    """What ``MetaDDP(module, deterministic=...)`` refuses before it changes anything: DDP
    inside (or around) the module, nothing to train, learned rates it would not keep alike,
    and a mode the algorithm does not declare (:class:`metaddp.algorithms.Supports`)."""
    refuse_data_parallel(module)
    require_trained(module)
    refuse_rates_outside(module, deterministic)
    supports = getattr(module, "supports", None)
    if isinstance(supports, Supports):
        supports.refuse(type(module).__name__, deterministic=deterministic)
    refusal = getattr(module, "deterministic_refusal", None)
    if deterministic and callable(refusal) and (why := refusal()) is not None:
        raise ValueError(why)


def refuse_rates_outside(module: nn.Module, deterministic: bool) -> None:
    """Raise if the algorithm's inner optimizer learns rates (tensors that require grad,
    given to ``sgd`` or ``adam``) that the wrapper would not keep alike on every rank."""
    optimizer = getattr(module, "optimizer", None)
    rates = learned_rates(optimizer) if isinstance(optimizer, InnerOptimizer) else ()
    if not rates:
        return
    if deterministic:
        raise ValueError(
            "deterministic mode learns inner learning rates through learn_lr only (those rates "
            "are spread to every task and summed order-free): build the algorithm with "
            "learn_lr='scalar', 'tensor' or 'parameter' instead of giving its optimizer rates "
            "that require grad"
        )
    ours = {id(p) for p in module.parameters()}
    outside = [r for r in rates if id(r) not in ours]
    if outside:
        raise ValueError(
            f"the inner optimizer learns {len(outside)} learning rate(s) that are not "
            "parameters of the wrapped algorithm: sync_grads() would not sum their gradients "
            "over the ranks, and every rank would train its own. Build the algorithm with "
            "learn_lr='scalar', 'tensor' or 'parameter' (its rates are then its parameters), "
            "or register the rates on it as nn.Parameters"
        )


_OTHER_MODELS = (
    "At the comparison of weights and settings, the ranks hold models of other structure: "
    "other modules, parameters or buffers (build the model alike on every rank), or one rank "
    "skipped a forward or backward that the others ran."
)

Setting = tuple[str, str, float]
"""``(kind, name, value)``: kind ``algorithm``, ``mode``, ``layer`` or ``grad``."""


def _settings(module: nn.Module) -> list[Setting]:
    """What every rank must set alike, as numbers: the algorithm's settings (its
    ``signature()``, by a CRC: ranks that differ in ``first_order``, a method's iterations or
    any setting that changes how many collectives a step runs would otherwise wait for each
    other until the collective timeout), every module's training flag (dropout and BatchNorm
    compute otherwise in eval mode, and BatchNorm then sums no statistics), torch.nn's layers'
    settings (by a CRC) and every parameter's ``requires_grad`` (which sets what the inner
    steps sum)."""
    signature = getattr(module, "signature", None)
    out: list[Setting] = []
    if callable(signature):
        text = str(signature())
        out.append(("algorithm", text, float(zlib.crc32(text.encode()))))
    for name, m in module.named_modules():
        called = f"{name!r} ({type(m).__name__})" if name else type(m).__name__
        out.append(("mode", called, float(m.training)))
        if held := _hyperparameters(m):
            out.append(("layer", f"{called}: {held}", float(zlib.crc32(held.encode()))))
    return out + [("grad", repr(n), float(p.requires_grad)) for n, p in module.named_parameters()]


def _hyperparameters(m: nn.Module) -> str:
    """A layer of torch.nn's own: the settings its class declares (``__constants__``: a
    ``Dropout``'s ``p``, a ``BatchNorm``'s ``eps`` and ``momentum``), as text. Nothing else
    is read: a module of the user's own class, or an attribute set on a layer (a hook's count,
    a rank), may rightly differ. FSDP2's per-layer class stands in for the layer's own."""
    own = next(c for c in type(m).__mro__ if not c.__module__.startswith("torch.distributed."))
    if not own.__module__.startswith("torch.nn.modules"):
        return ""
    names = sorted(getattr(own, "__constants__", ()))
    return ", ".join(f"{k}={v!r}" for k in names if _plain(v := getattr(m, k, None)))


def _plain(v: object) -> bool:
    """A number, a string, None, or a tuple of them: what prints alike on every rank."""
    if type(v) is tuple:
        return all(_plain(x) for x in v)
    return v is None or type(v) in (bool, int, float, str)


def _unlike(settings: list[Setting]) -> str:
    """The error for settings that differ across the ranks (the algorithm's, the layers',
    modes, then trained parameters)."""
    named = {kind: [n for k, n, _ in settings if k == kind] for kind, _, _ in settings}
    if own := named.get("algorithm"):
        return (
            "the ranks' algorithms have different settings (inner steps, rates, first_order, "
            "the hypergradient method's own...): each would compute another meta-gradient. "
            f"This rank's: {own[0]}. Build the algorithm alike on every rank, and change a "
            "setting on every rank alike"
        )
    if layers := named.get("layer"):
        return (
            "the ranks' layers have different settings (a Dropout's p, a BatchNorm's "
            "momentum...): each would compute another meta-gradient. This rank's: "
            f"{'; '.join(layers)}. Change a layer's setting on every rank alike"
        )
    if modes := named.get("mode"):
        return (
            f"the ranks run {listing(modes)} in different modes, training on some and eval on "
            "others (train() or eval() called on some ranks only): dropout and BatchNorm "
            "compute other things in eval mode, so the meta-gradient would be no one "
            "process's, and BatchNorm's sums over the ranks would not match. Call train() and "
            "eval() on every rank alike; for one rank's own evaluation, use `with "
            "learner.local():` and call train() again before the next meta-step"
        )
    return (
        f"the ranks train different parameters: {listing(named.get('grad', []))} "
        "requires a gradient on some ranks and not on others (requires_grad_ called on some "
        "ranks only): the inner steps' sums over the ranks would not match. Freeze and "
        "unfreeze parameters on every rank alike"
    )


def _alone(where: str, held: int | str, n: int | str, mesh: Mesh) -> str:
    """The error for a share of a part of a batch where no other rank holds the rest."""
    return (
        f"{where} got a share of a batch of {n} samples that holds {held} of them on this "
        f"rank, while no other rank holds the rest: a sample group of one rank ({mesh!r}) "
        "holds all of each of its tasks' samples, so every other part of the batch would "
        "be left out. Cut a rank's part with learner.shard(...) or Batch.split(x, y, "
        "learner.mesh.sample_index, learner.mesh.samples), never with md.rank() and "
        "md.world_size()"
    )


def _kind(tasks: Sequence[Task]) -> float:
    """How a meta-batch was built, as a number the ranks compare: 0 a plain list; a
    ``MetaBatch`` from 1 the whole list of tasks, 2 ``make_task``, 3 by hand."""
    if not isinstance(tasks, MetaBatch):
        return 0.0
    if tasks.source is None:
        return 3.0
    return 1.0 if isinstance(tasks.source, tuple) else 2.0


def _loss_key(loss_fn: LossFn) -> tuple[Any, Any]:
    """``(object, function)`` of a bound method, which is made anew at each attribute access;
    ``(loss_fn, None)`` otherwise."""
    owner, func = getattr(loss_fn, "__self__", None), getattr(loss_fn, "__func__", None)
    return (owner, func) if owner is not None and func is not None else (loss_fn, None)


class StepGuards:
    """The checks one :class:`metaddp.MetaDDP` runs, and the state they keep.

    Args:
        module: the wrapped module (its parameters are the trained ones).
        mesh: the ranks and how they share the work.
        every_step: check mode: the collective checks on every step, and the weights the
            model runs on compared at every forward (also inside the library's own loops).
    """

    def __init__(self, module: nn.Module, mesh: Mesh, *, every_step: bool) -> None:
        self.module, self.mesh = module, mesh
        self.schedule = Schedule(every_step)
        self.every_step = every_step
        # Forwards on fast weights compared across the sample axis on checked steps (every
        # weight at every forward in check mode); nothing is registered on one rank.
        self.weights = WeightCheck(module, mesh.sample_group, fast_only=not every_step)
        self._own_loop = False
        self._local = False
        self._update_weight_check()
        # Meta-batches already agreed on this step (shard(), then meta_loss on the same).
        self._agreed: weakref.WeakSet[MetaBatch] = weakref.WeakSet()
        # Loss functions whose meta-loss was searched for tensors outside the module: a
        # function, or a bound method's object and function (a new method object each time).
        self._searched: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()
        self.searches = 0  # calls of loss_out, so the wrapper runs it once per meta-loss
        # The meta-loss shares since the last sum, added up (a loop that only evaluates
        # keeps one number, not a list).
        self._loss: Tensor | None = None
        # Each trained parameter's .grad as the last sum left it, with its version: while a
        # .grad is that tensor, unchanged, it holds a SUM over the ranks already.
        self._summed: dict[int, tuple[weakref.ref[Tensor], int]] = {}
        # With shard=True: the ids of the sharded parameters and the group holding the same
        # rows (set by the wrapper once it has cut them).
        self.sharded: tuple[set[int], Any] | None = None
        # Forwards that draw outside metaddp's keyed loops (a clone() or hand loop's): refused
        # where they run, on one process too, so a script that runs at one runs at any.
        # Verdicts of this rank's work noted during the step (Collectives.note), by kind.
        self._verdicts: dict[str, Tensor] = {}
        # Whether a forward may have moved buffers since the wrapper was built (task groups'
        # running statistics then differ legitimately, even before the first sum).
        self.moved = False
        self.unkeyed = UnkeyedDraws(module, lambda: not self._local)
        # The prints of the step's loss functions (note), compared before the sum, and the
        # functions printed (printing).
        self._prints: list[tuple[int, Tensor]] = []  # (meta_loss call or 0, print)
        self._printed: list[Any] = []
        self._one_process = group_size(mesh.group) == 1  # no print to compare
        self._calls = 0  # meta_loss calls this step
        self._calling = 0  # the running one's number where its prints compare over the mesh
        if every_step:
            LOG.checking.add(self)

    # --- state ----------------------------------------------------------------------------

    def _update_weight_check(self) -> None:
        on = not self._local and (self.every_step or (self.schedule.due() and not self._own_loop))
        self.weights.enabled = on

    def own_loop(self) -> contextlib.AbstractContextManager[None]:
        """Inside the library's own inner loops (exact by construction) the weights the model
        runs on are compared only in check mode."""
        return self._while("_own_loop")

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        """One rank's own work (``MetaDDP.local``): nothing is compared, and it may draw."""
        with self._while("_local"), LOG.unlogged():
            yield

    @contextlib.contextmanager
    def _while(self, flag: str) -> Iterator[None]:
        before = getattr(self, flag)
        setattr(self, flag, True)
        self._update_weight_check()
        try:
            yield
        finally:
            setattr(self, flag, before)
            self._update_weight_check()

    def _begin(self) -> None:
        """A step of this learner is under way: shares made now may be its own. In check
        mode, which compares them, a step whose gradients are all cleared starts afresh (an
        attempt that raised and was retried leaves no half of its shares)."""
        if LOG.checking and not self._local:  # every learner says so while one compares
            fresh = self.every_step and all(p.grad is None for p in self.module.parameters())
            LOG.begin(self, afresh=fresh)

    @contextlib.contextmanager
    def meta_loss_call(self, tasks: Sequence[Task]) -> Iterator[None]:
        """Loss functions printed inside are the step's ``k``-th meta-loss's: over a
        :class:`MetaBatch` of global tasks one function serves every task on every rank, and
        its prints are compared over the mesh; over a plain list (a rank's own tasks, which
        may each have their own loss), within the sample group."""
        if self._local:  # one rank's own work: no place among the ranks' calls
            yield
            return
        self._calls += 1
        before = self._calling
        self._calling = self._calls if isinstance(tasks, MetaBatch) else 0
        try:
            yield
        finally:
            self._calling = before

    def remove(self) -> None:
        self.weights.remove()
        if self.unkeyed is not None:
            self.unkeyed.remove()

    # --- tasks in -------------------------------------------------------------------------

    def tasks_in(self, tasks: Sequence[Task]) -> None:
        """Refuse what a meta-batch cannot be, and on checked steps what the ranks do not
        agree on."""
        self._begin()
        self.refuse_whole(named_batches(tasks))
        # A step being recorded in a CUDA graph cannot read values on the host; the replays
        # run no Python, and the shard() of each step is checked outside the graph.
        if not self.schedule.due() or self._local or _host.recording():
            self.moved = True
            return
        if isinstance(tasks, MetaBatch):
            if tasks in self._agreed:
                return
            self._agreed.add(tasks)
        try:
            self._agree(tasks)
            self.weights_agree()
        except BaseException:
            _host.discard()  # the step ends here: its pending checks go with it
            raise
        finally:
            self.moved = True  # the tasks go to forwards next

    def weights_agree(self) -> None:
        """On a checked step, before any work: every parameter and buffer the same wherever
        ranks must hold the same, by fingerprint ([Note: fingerprints]; one small collective,
        two with sharded parameters, which are compared between the ranks that hold the same
        rows). Buffers are compared over the whole mesh before the first step and within
        each sample group after it (task groups move their own running statistics). A
        checkpoint loaded on some ranks after the wrapper was built, or weights one rank
        changed by hand, end here, not in a meta-gradient that is no one process's. The
        settings every rank must share (:meth:`_settings`) ride in the mesh's comparison."""
        groups = self._in_step(trained=self.schedule.step > 0 or self.moved)
        for k, (members, group) in enumerate(groups):
            # The last comparison is over the whole mesh (_in_step).
            settings = _settings(self.module) if k == len(groups) - 1 else []
            flags = [v for _, _, v in settings]
            if not (members or flags) or group_size(group) == 1:
                continue
            prints = [tensor_print(t) for _, t in members]
            device = prints[0].device if prints else None
            prints.append(torch.tensor(flags, dtype=torch.float64, device=device))
            low, top = extremes(torch.cat(prints), group, _OTHER_MODELS)
            n = 2 * len(members)
            if bad := _differ(low[n:], top[n:]):
                raise OutOfSyncError(_unlike([settings[i] for i in bad]))
            low, top = low[:n], top[:n]
            if bad := _differ(low, top):
                names = list(dict.fromkeys(members[i // 2][0] for i in bad))
                raise OutOfSyncError(
                    f"the ranks hold different values of {listing(names)} at the start of "
                    f"meta-step {self.schedule.step}: each would compute the meta-gradient of "
                    "other weights. Load a checkpoint before MetaDDP is built (it broadcasts "
                    "rank 0's) or on every rank, and change weights on every rank alike (the "
                    "optimizer, after sync_grads())"
                )

    def refuse_whole(self, batches: Mapping[BatchKey, Batch]) -> None:
        """Refuse a batch that holds all its samples on this rank while its samples are split
        over several ranks (a meta-batch not cut with ``shard``): every rank would add the
        whole batch, the task's gradient times the number of ranks. No collective: a rank's
        part that holds every sample (the others' empty) is a :class:`metaddp.data.Shard`."""
        ranks = self.mesh.samples
        if ranks == 1:
            return
        for key, b in batches.items():
            if b.whole_where_split():
                raise ValueError(
                    f"{batch_name(key)} holds all {b.n} of its samples on this rank, but its "
                    f"samples are split over the {ranks} ranks of a sample group: every rank "
                    f"would add the whole batch's gradient, {ranks} times the task's. Cut this "
                    "rank's part "
                    "with learner.shard(...) (or Task.split(learner.mesh.sample_index, "
                    f"{ranks})); a part cut by hand is Batch.local(x, y, n), with n the "
                    "whole batch's size"
                )

    def _agree(self, tasks: Sequence[Task]) -> None:
        world = self.mesh.group
        source = tasks.source if isinstance(tasks, MetaBatch) else None
        n = float(tasks.n) if isinstance(tasks, MetaBatch) else -1.0
        low, top = extremes([_kind(tasks), n], world)
        if low[0] != top[0]:
            raise ValueError(
                "the ranks pass different kinds of meta-batch (a list on some, a MetaBatch "
                "on others): build it the same way on every rank, with learner.shard(...)"
            )
        if low[1] != top[1]:
            raise ValueError(
                f"the ranks disagree on the meta-batch's task count (from {int(low[1])} to "
                f"{int(top[1])}): give learner.shard the whole meta-batch (every task, the same "
                "on every rank) or its size and make_task(i); a rank's own tasks, or a count "
                "of its own, make a different meta-batch on every rank"
            )
        self.check_sizes(tasks)
        if isinstance(source, tuple):
            self._agree_on_list(source)
        elif source is not None and self.schedule.step == 0:
            assert isinstance(tasks, MetaBatch)
            self._agree_on_make_task(source, tasks.indices)
        if not isinstance(tasks, MetaBatch):
            self._refuse_repeats(tasks)

    def check_sizes(self, tasks: Sequence[Task]) -> None:
        """Raise :class:`metaddp.OutOfSyncError` unless the ranks that split tasks' samples
        hold the same number of tasks, and every task's shards add up to the global sizes
        its batches declare (three small collectives)."""
        group = self.mesh.sample_group
        low, top = extremes([len(tuple(tasks))], group)
        if low != top:
            raise OutOfSyncError(
                "the ranks that split tasks' samples hold different numbers of tasks "
                f"({int(low[0])} to {int(top[0])}): give every rank of a sample group the same "
                "tasks (learner.shard(...))"
            )
        self.check_batch_sizes(named_batches(tasks))

    def check_batch_sizes(self, batches: Mapping[BatchKey, Batch]) -> None:
        """Raise :class:`metaddp.OutOfSyncError` unless every batch declares the same global
        size ``n`` on every rank that splits it, and its shards add up to ``n``."""
        group = self.mesh.sample_group
        if group_size(group) == 1 or not batches:
            return
        named = list(batches.items())
        low, top = extremes([b.n for _, b in named], group)
        # Per batch, summed over the ranks in the same collective: the samples held, how many
        # ranks do not know where their part starts, and the sums of the global indices the
        # parts hold and of their squares, which parts that tile 0 .. n-1 add up to exactly.
        counts = all_reduce_counts([v for _, b in named for v in _index_sums(b)], group)
        for (key, _), lo, hi, (h, unknown, s1, s2) in zip(
            named, low, top, (counts[i : i + 4] for i in range(0, len(counts), 4)), strict=True
        ):
            n = int(lo)
            if lo == hi and h == lo and not unknown and (s1, s2) != _tiled(n):
                raise OutOfSyncError(
                    f"{batch_name(key)} batch's parts do not tile its {n} samples: their "
                    "starts overlap or leave gaps (a start= that is not where the part "
                    "begins: torch.chunk gives the first parts ceil(n / ranks) samples), so "
                    "dropout would key other samples' masks. Cut tasks with learner.shard (or "
                    "Batch.split), which record where each part starts"
                )
            if lo != hi or h != lo:
                says = f"{int(lo)}" if lo == hi else f"{int(lo)} to {int(hi)}"
                raise OutOfSyncError(
                    f"{batch_name(key)} batch says it has {says} samples, but its shards on the "
                    f"{group_size(group)} ranks that split it hold {h}. Cut tasks with "
                    "learner.shard (or Task.split), which record the global size; a part cut "
                    "by hand is Batch.local(x, y, n) with n the whole batch's size, never the "
                    "part's own length"
                )

    def _agree_on_list(self, every: tuple[Task, ...]) -> None:
        low, top = extremes(_rows(list(every)).reshape(-1), self.mesh.group)
        if bad := _differ(low, top):
            raise ValueError(
                f"the tasks given to shard() differ across the ranks (task {bad[0] // 8} first): "
                "shard() takes the whole meta-batch, the same on every rank, and cuts each "
                "rank's part itself. Pass every rank every task (or shard(n, make_task)); "
                "a rank's own tasks would be cut again"
            )

    def _agree_on_make_task(self, make_task: Callable[[int], Task], mine: range) -> None:
        """``make_task(i)`` must be a function of ``i`` alone: built twice, the same task; and
        the same on every rank (task 0 on all of them, and each task on the ranks that split
        it)."""
        first = _rows([make_task(i) for i in mine])
        again = _rows([make_task(i) for i in mine])
        drifts = float(bool(_differ(first.reshape(-1).tolist(), again.reshape(-1).tolist())))
        zero = fingerprint(make_task(0))
        low, top = extremes(torch.cat([zero.new_tensor([drifts]), zero]), self.mesh.group)
        if top[0]:
            raise ValueError(
                "make_task(i) built the same task twice differently: it draws from a "
                "generator it does not seed from i (torch's global one?), so task i depends "
                "on how many tasks the rank built before it. Draw from "
                "md.generator_for(seed, step, i)"
            )
        if _differ(low[1:], top[1:]):
            raise ValueError(
                "make_task(0) builds a different task on different ranks: the tasks depend on "
                "the process (a sampler seeded with the rank?). Seed them from the global task "
                "index alone: md.generator_for(seed, step, i)"
            )
        low, top = extremes(first.reshape(-1), self.mesh.sample_group)
        if bad := _differ(low, top):
            raise ValueError(
                f"task {mine[bad[0] // 8]} differs across the ranks that split its samples: the "
                "tasks depend on the process (a sampler seeded with the rank?). Seed them from "
                "the global task index alone: md.generator_for(seed, step, i)"
            )

    def _refuse_repeats(self, tasks: Sequence[Task]) -> None:
        """A plain list of tasks whose global count is summed over the task axis: a task held
        twice (torch's ``DistributedSampler`` pads by repeating) would count twice."""
        rows = _gather(_rows(tasks), self.mesh.task_group)
        seen: dict[tuple[float, ...], tuple[int, int]] = {}
        for r, block in enumerate(rows):
            for j, row in enumerate(block.tolist()):
                if not any(row):  # an empty shard: nothing to compare
                    continue
                key = tuple(round(v, 9) for v in row)
                if key in seen:
                    (r0, j0) = seen[key]
                    raise ValueError(
                        f"the meta-batch holds one task twice (task {j0} of task group {r0} "
                        f"and task {j} of task group {r}): a sampler that pads, such as torch's "
                        "DistributedSampler, repeats tasks to even out the ranks, and each "
                        "copy would count. Build the meta-batch with learner.shard(n, "
                        "make_task), which splits by global index without padding"
                    )
                seen[key] = (r, j)

    def check_in_sync(self, *, trained: bool = False) -> None:
        """Raise if any parameter or buffer differs between ranks, value by value (one
        collective; sharded parameters between the ranks that hold the same rows: a second
        one). ``trained``: as :meth:`_in_step`."""
        for members, group in self._in_step(trained):
            self._compare(members, group)

    def _in_step(self, trained: bool) -> list[tuple[list[tuple[str, Tensor]], Any]]:
        """The parameters and buffers, by the group of ranks that must hold the same of
        each: sharded parameters the ranks that hold the same rows, the rest the mesh.
        ``trained``: after meta-steps, buffers are compared within each sample group only.
        Task groups adapt other tasks, so statistics that forwards move (BatchNorm's running
        ones) legitimately differ between them (docs/algorithms.md)."""
        named: list[tuple[str, Tensor]] = list(self.module.named_parameters())
        buffers: list[tuple[str, Tensor]] = list(self.module.named_buffers())
        out: list[tuple[list[tuple[str, Tensor]], Any]] = []
        if self.sharded is not None:
            ids, rows_group = self.sharded
            out.append(([(n, t) for n, t in named if id(t) in ids], rows_group))
            named = [(n, t) for n, t in named if id(t) not in ids]
        if trained and self.mesh.tasks > 1:
            out.append((buffers, self.mesh.sample_group))
        else:
            named += buffers
        out.append((named, self.mesh.group))
        return out

    def _compare(self, named: list[tuple[str, Tensor]], group: Any) -> None:
        spread = max_abs_difference([t for _, t in named], group=group)
        bad = [
            f"{name} (max difference {d:.3g})"
            for (name, _), d in zip(named, spread, strict=True)
            if d > 0
        ]
        if bad:
            raise ValueError(
                f"ranks hold different weights: {listing(bad)}. Seed every rank alike, load the "
                "same checkpoint, or build MetaDDP with broadcast=True to copy rank 0's "
                "weights."
            )

    # --- share in -------------------------------------------------------------------------

    def share_in(self, loss: Tensor, where: str) -> None:
        """Where ranks split a task's samples, ``loss`` must be ``metaddp.share(per_sample,
        batch)`` of a rank's part of a batch; on checked steps its sizes are agreed."""
        self.moved = True
        self._begin()
        ranks = self.mesh.samples
        if self._local:
            return
        made = share_of(loss)
        if ranks == 1 and not self._local:
            if made is not None and made.source != "count" and made.held != made.n:
                raise ValueError(_alone(where, made.held, made.n, self.mesh))
            return
        fix = (
            "Pass md.share(per_sample_losses, batch), with the Batch the losses come from "
            "(loss_fn(..., reduction='none'))"
        )
        if made is None:
            raise ValueError(
                f"{where} got a loss that md.share did not make (a plain mean such as "
                f"F.mse_loss(pred, y), or a share changed afterwards), while {ranks} ranks "
                "split the task's samples: each would step on the mean of its own shard, not "
                f"the task's. {fix}"
            )
        if made.source == "count":
            raise ValueError(
                f"{where} got md.share(losses, {made.n}), a share of a count, while {ranks} "
                "ranks split the task's samples: a count written by hand is easily this "
                f"rank's own ({made.held} samples here). {fix}"
            )
        if made.source == "batch" and made.held == made.n and made.n > 0:
            raise ValueError(
                f"{where} got a share of a batch that holds all {made.n} of its samples on "
                f"this rank, while {ranks} ranks split them: cut this rank's part with "
                "learner.shard(...) or Batch.local(x, y, n)"
            )
        if self.schedule.due():
            low, top = extremes([made.n], self.mesh.sample_group)
            (held,) = all_reduce_counts([made.held], self.mesh.sample_group)
            if low != top or held != low[0]:
                raise OutOfSyncError(
                    f"{where}: the share's batch says it has {int(low[0])} to {int(top[0])} "
                    f"samples, but the {ranks} ranks that split it hold {held}. A part cut by "
                    "hand is Batch.local(x, y, n) with n the whole batch's size, never the "
                    "part's own length"
                )

    # --- loss out -------------------------------------------------------------------------

    def loss_out(self, loss: Tensor, loss_fn: LossFn) -> None:
        """Refuse a meta-loss that depends on a trained tensor outside the module (searched
        once per loss function), and keep its value for the sum's finiteness check."""
        self._begin()
        self.searches += 1
        if loss.requires_grad and not self._was_searched(loss_fn):
            self._refuse_unknown_leaves(loss)
            owner, func = _loss_key(loss_fn)
            with contextlib.suppress(TypeError):
                self._searched.setdefault(owner, set()).add(func)
        if loss.numel() == 1:
            share = loss.detach().reshape(1)
            self._loss = share if self._loss is None else self._loss + share.to(self._loss)
        if self._summed and loss.requires_grad:
            loss.register_hook(self._before_backward)

    def _was_searched(self, loss_fn: LossFn) -> bool:
        owner, func = _loss_key(loss_fn)
        try:
            return func in self._searched.get(owner, ())
        except TypeError:  # not weakly referable: searched every time
            return False

    def _refuse_unknown_leaves(self, loss: Tensor) -> None:
        """Raise if the meta-loss depends on a tensor that needs a gradient but is not a
        parameter of the module: sync_grads() would not sum its gradient, so every rank would
        keep the gradient of its own shard for it (a number that changes with the world size)."""
        unknown = unknown_leaves([loss], list(self.module.parameters()))
        if unknown:
            _host.discard()  # the step ends here: its pending checks go with it
            raise ValueError(
                f"the meta-loss depends on {len(unknown)} tensor(s) of shape {shapes(unknown)} "
                "that need a gradient but are not parameters of the wrapped module: captured "
                "by the loss function or read by the model from outside. sync_grads() sums "
                "the module's parameters' gradients only, so every rank would keep the "
                "gradient of its own shard for them, a different number at every world size. "
                "Register such a tensor as an nn.Parameter of the model (or of the algorithm), "
                "or detach it if it is not meant to train"
            )

    # --- the sum -------------------------------------------------------------------------

    def _before_backward(self, grad: Tensor) -> None:
        # Runs as the backward of a meta-loss starts, before any .grad is added to.
        if held := self._still_summed():
            self._refuse_summed(held, "this backward would add to them")

    def _still_summed(self) -> list[str]:
        """The trained parameters whose ``.grad`` is still the SUM the last sync_grads()
        wrote, untouched since (not zeroed, replaced or added to)."""
        # Most steps zero the gradients first (freed or written to): no walk of the module.
        if not any(
            (g := ref()) is not None and g._version == v for ref, v in self._summed.values()
        ):
            return []
        held = []
        for name, p in self.module.named_parameters():
            kept, g = self._summed.get(id(p)), p.grad
            if kept is not None and g is not None and kept[0]() is g and g._version == kept[1]:
                held.append(name)
        return held

    def _refuse_summed(self, names: list[str], what: str) -> None:
        _host.discard()  # the step ends here: its pending checks go with it
        raise RuntimeError(
            f"the gradients of {listing(names)} still hold the SUM over ranks that the last "
            f"sync_grads() wrote, and {what}: sync_grads() would sum them again, multiplying "
            "them by the number of ranks. Zero the gradients once the optimizer has used them "
            "(optimizer.zero_grad()); to accumulate several meta-batches, run backward() on "
            "each (all but the last inside `with learner.no_sync():`) and sync_grads() once, "
            "after the last."
        )

    def work_agrees(self) -> None:
        """On a checked step, once its backwards have run and before the sum: the ranks
        agree on what they computed that no earlier check saw (raises
        :class:`OutOfSyncError` on every rank alike): the loss functions' prints, and the
        shares the caller made with ``md.share`` whose backward ran (a ``clone()`` loop's
        query loss, a hand loop's). Each rank writes one row, gathered over the mesh in one
        collective (:mod:`metaddp.distributed._work`)."""
        # The caller's shares are compared in check mode only: a program may skip a share
        # (a mask) in ways that no record of the shares tells from a rank's own count.
        made, unsure = LOG.take(self) if self.every_step else ([], False)
        prints, self._prints, self._printed, self._calls = self._prints, [], [], 0
        if self._local or not self.schedule.due() or _host.recording():
            return
        world = group_size(self.mesh.group)
        if world == 1 and not made:
            return
        device = comm_device(self.mesh.group) if world > 1 else torch.device("cpu")
        block = work_block(
            group_rank(self.mesh.group),
            world,
            self.mesh.task_index,
            self.mesh.tasks,
            made,
            unsure,
            prints,
            device,
        )
        if world > 1:
            _record(block.numel(), block.numel() * 8)
            _guard(lambda: dist.all_reduce(block, group=self.mesh.group), "guard check")
        alone = _alone("md.share(losses, batch)", "{held}", "{n}", self.mesh)
        found = judge(block.cpu(), world, alone)
        if found:
            raise OutOfSyncError(found)

    def before_sum(self) -> None:
        """Refuse gradients that still hold the last sum (a second ``sync_grads()``)."""
        if held := self._still_summed():
            self._refuse_summed(held, "no backward has added to them since")

    @contextlib.contextmanager
    def other_draws(self) -> Iterator[None]:
        """On a checked step, note draws from a torch generator of the caller's own, numpy's
        or Python's in the block (:class:`metaddp._functional.OtherDraws`), outside
        ``learner.local()``."""
        if self._local or not self.schedule.due():
            yield
            return
        with OtherDraws() as seen:
            yield
        self.note("draws", torch.tensor([seen.drew]))

    def printing(self, key: Any) -> bool:
        """Whether to print the loss function ``key`` now: once per function on a checked
        step, for the first few functions (:data:`metaddp.distributed._work.PRINTS`); the
        print is noted as ``note("loss_fn", (key, print))``."""
        if self._local or not self.schedule.due() or _host.recording() or self._one_process:
            return False
        return len(self._printed) < PRINTS and not any(k is key for k in self._printed)

    def note(self, kind: str, flag: Any) -> None:
        """A verdict of this rank's work in the step (``kind`` one of :data:`VERDICTS`; a
        1-element bool tensor, true for a mistake), summed over the ranks with the step; or
        with ``kind`` ``"loss_fn"``, a loss function's print
        (:func:`metaddp._share.loss_print`), compared across the ranks before the sum."""
        if kind == "loss_fn":
            key, printed = flag
            if self.printing(key):
                self._printed.append(key)
                self._prints.append((self._calling, printed.detach()))
            return
        flag = flag.detach().reshape(1)
        held = self._verdicts.get(kind)
        self._verdicts[kind] = flag if held is None else held | flag

    def rider(self, like: Tensor) -> Tensor:
        """What rides in the gradient SUM for the guards: the step's meta-loss (0 without
        one), whose sum over the ranks is finite exactly when every rank's share is, then
        each of :data:`VERDICTS` (how many ranks found that mistake)."""
        total = like.new_zeros(1) if self._loss is None else self._loss.to(like).reshape(1)
        self._loss = None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if grads:  # the rider is taken once every gradient is final (module docstring)
            # Sharded rows refuse a norm; an FSDP2 model's DTensor gradients: their rows.
            plain = [local(g).as_subclass(Tensor) for g in grads]
            self.note("gradient", ~finite_flags(plain).all())
        flags = [self._verdicts.get(k) for k in VERDICTS]
        self._verdicts = {}
        return torch.cat([total, *(like.new_zeros(1) if f is None else f.to(like) for f in flags)])

    def after_sum(self, rode: Sequence[float], *, summed: bool) -> None:
        """Judge the summed rider (the same numbers on every rank), remember the summed
        gradients (``summed``: the sum wrote them), and count the step."""
        loss_sum, *found = rode
        if summed:
            self._summed = {
                id(p): (weakref.ref(p.grad), p.grad._version)
                for p in self.module.parameters()
                if p.grad is not None
            }
        self.schedule.advance()
        self._agreed = weakref.WeakSet()
        self._update_weight_check()
        # A non-finite meta-loss explains a non-finite gradient: said first.
        ranks = dict(zip(VERDICTS, found, strict=True))
        for kind in ("per_sample", "draws"):
            if ranks[kind] > 0:
                raise ValueError(*VERDICTS[kind].args)
        if not math.isfinite(loss_sum):
            raise FloatingPointError(NON_FINITE_LOSS)
        if ranks["gradient"] > 0:
            raise FloatingPointError(*VERDICTS["gradient"].args)
