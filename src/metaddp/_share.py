"""The share convention: every rank holds its share of each global mean.

A rank's share of a global mean loss is the sum of its own samples' losses divided by the
global sample count. Shares add up to the global mean on any split of the data, uneven or
empty shards included, so every cross-rank reduction is a plain SUM, never a mean over ranks
(which would weight a rank holding 3 samples like one holding 5).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import sys
import warnings
import weakref
import zlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import Tensor

from ._data import Batch, Shard, whole

_TAG = "metaddp.share"
"""The key of a share's record in its autograd node's ``metadata``."""


@dataclasses.dataclass(frozen=True)
class ShareOf:
    """What a share was made from: ``held`` of ``n`` samples, and ``source``: ``"shard"`` (a
    batch known to be a rank's part), ``"batch"`` (a batch not known as one: whole, or built
    by hand) or ``"count"`` (an integer the caller counted)."""

    held: int
    n: int
    source: str


def _metadata(node: Any) -> dict[str, Any]:
    # An autograd node's dict for its users' records (``torch.autograd.graph.Node.metadata``,
    # a property that torch's stubs type as a method).
    return cast(dict[str, Any], node.metadata)


def share_of(loss: Tensor) -> ShareOf | None:
    """How ``loss`` was made, if :func:`share` made it; ``None`` for any other tensor (a plain
    mean, a sum of shares, a share scaled again)."""
    node = loss.grad_fn
    return None if node is None else _metadata(node).get(_TAG)


@dataclasses.dataclass(frozen=True)
class Logged:
    """A share whose backward ran: what it was made from, where (a CRC of the caller's file
    and line) and when (the order of making, in this process)."""

    made: ShareOf
    site: int
    order: int


class ShareLog:
    """The records of the shares made with :func:`share` whose backward has run.
    ``MetaDDP.sync_grads`` compares them across the ranks on its checked steps: a caller's
    share is what no other check sees (a ``clone()`` loop's query loss, a hand loop's outer
    loss). A process may drive several learners: each opens a window when its step begins
    (:meth:`begin`) and takes the records made since (:meth:`take`), told whether they may
    not all be its own (another learner began a step inside the window) or complete."""

    MOST = 4096  # a process that never sums (no MetaDDP) keeps no longer list

    def __init__(self) -> None:
        self.ran: list[Logged] = []
        self.overflowed = False
        self.paused = 0  # inside ``learner.local()``: one rank's own work
        self.made = itertools.count()  # the order of shares made and steps begun
        # Each learner's open window (where its step began) and its latest beginning; the
        # learners whose window another's take cut into.
        self.opened: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.latest: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.cut: weakref.WeakSet[Any] = weakref.WeakSet()
        # The learners in check mode, which compare the records: without one, none is kept.
        self.checking: weakref.WeakSet[Any] = weakref.WeakSet()

    def backward_ran(self, logged: Logged, grad: Tensor) -> None:
        if self.paused:
            return
        if len(self.ran) >= self.MOST:
            self.overflowed = True
            self.ran.clear()
        self.ran.append(logged)

    def begin(self, owner: Any, *, afresh: bool = False) -> None:
        """``owner``'s step is under way: shares made from now on may be its own; ``afresh``:
        its step starts again here (its gradients were cleared: an attempt that raised, then
        retried), and earlier shares are not its step's."""
        now = next(self.made)
        if afresh:
            self.opened[owner] = now
        else:
            self.opened.setdefault(owner, now)
        self.latest[owner] = now

    def take(self, owner: Any) -> tuple[list[Logged], bool]:
        """The shares whose backward ran that were made since ``owner``'s step began, in
        the order they were made, and whether they may not all be its own or complete
        (another learner began a step meanwhile, another's take cut the window, or records
        were dropped). The window closes."""
        start = self.opened.pop(owner, None)
        unsure = self.overflowed or owner in self.cut
        self.cut.discard(owner)
        if start is None:  # no step began: nothing is its own
            return [], unsure
        unsure = unsure or any(t > start for o, t in self.latest.items() if o is not owner)
        mine = sorted((r for r in self.ran if r.order > start), key=lambda r: r.order)
        self.ran = [r for r in self.ran if r.order < start]  # another's, left for it
        self.overflowed = False
        if mine:
            self.cut.update(o for o, t in self.opened.items() if t < mine[-1].order)
        return mine, unsure

    @contextlib.contextmanager
    def unlogged(self) -> Iterator[None]:
        """Inside the block, backwards of shares are not recorded (one rank's own work)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


LOG = ShareLog()


def share(per_sample: Tensor, n_global: int | Batch) -> Tensor:
    """This rank's share of the mean over ``n_global`` samples.

    ``per_sample`` holds one loss per local sample along dimension 0 (``reduction='none'``);
    any further dimensions are averaged per sample first, so that for ``mse_loss`` the shares
    add up to ``mse_loss(..., reduction='mean')`` on the whole batch. ``n_global`` is the
    global sample count, or the :class:`metaddp.Batch` the losses come from (its own global
    size, so no count is written by hand; the losses must then be one per sample it holds).
    """
    out = own_share(per_sample, n_global)
    made = share_of(out)
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor(out)
    if LOG.checking and made is not None and not wrapped:
        # What the ranks' shares were made from is compared once their backward has run
        # (MetaDDP.sync_grads of a learner in check mode): the library's own shares are of
        # batches agreed on before, a caller's may be of a count or a part no check saw.
        caller = sys._getframe(1)
        site = zlib.crc32(f"{caller.f_code.co_filename}:{caller.f_lineno}".encode())
        logged = Logged(made, site, next(LOG.made))
        out.register_hook(functools.partial(LOG.backward_ran, logged))
    return out


def own_share(per_sample: Tensor, n_global: int | Batch) -> Tensor:
    """:func:`share`, not recorded: the library's own losses, of batches that the ranks
    agreed on before the step's work."""
    if isinstance(n_global, Batch):
        check_per_sample(per_sample, n_global.x.shape[0])
        source = "shard" if isinstance(n_global, Shard) else "batch"
        n_global = n_global.n
    else:
        source = "count"
    n_global = whole(n_global, "the global sample count")
    if per_sample.dim() == 0:
        raise ValueError(
            "expected one loss per sample (shape [n, ...]), got a scalar: compute the loss "
            "with reduction='none' so that metaddp can weigh this rank's samples globally"
        )
    if n_global <= 0:
        raise ValueError(f"the global sample count must be positive, got {n_global}")
    n_local = per_sample.shape[0]
    if n_local > n_global:
        raise ValueError(f"{n_local} local samples cannot be a share of {n_global} global ones")
    out = one_per_sample(per_sample).sum() / n_global
    if out.grad_fn is not None:
        # Where ranks split a batch, what adapts on this share checks what it was made from.
        _metadata(out.grad_fn)[_TAG] = ShareOf(n_local, n_global, source)
    return out


def check_per_sample(losses: Tensor, n_local: int) -> None:
    """Raise unless ``losses`` holds one loss per sample of a shard of ``n_local`` samples.

    A loss reduced over the batch but kept as a dimension (``mean(0)``: shape ``[1]``) would
    otherwise count as one sample, and weigh differently on every number of processes.
    """
    if losses.dim() == 0 or losses.shape[0] != n_local:
        raise ValueError(
            f"the loss function returned shape {tuple(losses.shape)} for {n_local} samples: "
            f"expected one loss per sample (shape [{n_local}, ...]). Compute it with "
            "reduction='none' and without averaging over the batch, so that metaddp can "
            "weigh this rank's samples globally"
        )


def one_per_sample(losses: Tensor) -> Tensor:
    """``losses [n, ...]`` as one loss per sample ``[n]``: further dimensions averaged (so
    that for ``mse_loss`` a sample's loss is its mean over outputs)."""
    return losses.flatten(1).mean(dim=1) if losses.dim() > 1 else losses


NOT_PER_SAMPLE = (
    "the loss function does not give one loss per sample: on a part of a rank's samples (its "
    "first sample, or the rest) it gives other losses for them than on all of them, so it "
    "reads a statistic of its batch (a normalisation by the batch's sum, mean or largest "
    "value, label counts, a variance, prototypes of the batch). Where ranks split a task's "
    "samples each rank sees its own shard only, so the meta-gradient would change with the "
    "number of processes; deterministic mode cuts every task's samples into fixed chunks, on "
    "one process too. Compute such statistics over the whole batch with "
    "md.data.global_sums(..., reduce=learner.reduce) or md.data.class_means, or give each "
    "rank whole tasks (Mesh.create(tasks=world))"
)


class PerSampleCheck:
    """``loss_fn``, checked on its first call with a sample or more where ranks split a
    task's samples: a share is the rank's part of the mean only if each sample's loss depends
    on that sample alone (or on sums over the whole batch). The check cuts the rank's samples
    once more, in its first sample and the rest, calls ``loss_fn`` on each part (no graph)
    and compares: a loss that reads a statistic of its own batch gives other values on one
    part at least. The verdict, a bool on the device, goes to ``note``, which sums it over
    the ranks with the step (every rank judges alike, those with fewer than two samples
    too). Where ``printing(key)`` says so (a checked step's first call of the function), its
    print (:func:`loss_print`) goes to ``note`` too, for the ranks to compare. A loss whose
    call made a collective (:func:`metaddp.data.global_sums`) sums its statistics over the
    ranks itself and is neither cut nor printed. Checked functions are remembered in
    ``seen`` (the function, and whether it may be printed); calls under ``torch.vmap``
    (stacked tasks) are not checked: :meth:`probe` checks outside it.
    """

    def __init__(
        self,
        loss_fn: Any,
        note: Any,
        counting: Any,
        seen: Any,
        *,
        cut: bool = True,
        key: Any = None,
        printing: Any = None,
    ) -> None:
        self.loss_fn, self.note, self.counting, self.seen = loss_fn, note, counting, seen
        self.cut = cut  # whether ranks split a task's samples (else: only the print is noted)
        # What ``seen`` remembers it by: the function, or for a loss built anew on every
        # call (a Bilevel's weighted inner loss) what makes it (its weighting module).
        self.key = _function(loss_fn) if key is None else key
        self.printing = printing if printing is not None else lambda key: False

    @property
    def pending(self) -> bool:
        return self.key not in self.seen

    @property
    def probing(self) -> bool:
        """Whether :meth:`probe` has work: a check pending, or a print wanted."""
        return self.pending or bool(self.seen.get(self.key)) and self.printing(self.key)

    def _print(self, prediction: Tensor, target: Tensor) -> None:
        if self.printing(self.key):
            print_ = loss_print(self.loss_fn, prediction, target)
            self.note("loss_fn", (self.key, print_))

    def __call__(self, prediction: Any, target: Any) -> Any:
        if not _plain(prediction, target):
            return self.loss_fn(prediction, target)
        if not self.pending:
            losses = self.loss_fn(prediction, target)
            if self.seen.get(self.key):  # printable: makes no collective of its own
                self._print(prediction, target)
            return losses
        with self.counting() as made:
            losses = self.loss_fn(prediction, target)
        n = prediction.shape[0]
        if made.calls:  # sums over the ranks of its own: nothing to cut, nor to call again
            self.seen[self.key] = False
            return losses
        self._print(prediction, target)
        if not self.cut:
            self.seen[self.key] = True
        elif n >= 1 and isinstance(losses, Tensor) and losses.dim() and losses.shape[0] == n:
            self.seen[self.key] = True
            self.note("per_sample", self._differs(prediction, target, losses))
        return losses

    def probe(self, prediction: Tensor, target: Tensor) -> None:
        """Check or print on predictions made outside ``torch.vmap`` (a stacked meta-batch's
        first task), where :attr:`probing`."""
        if self.probing:
            with torch.no_grad():
                self(prediction.detach(), target)

    def _differs(self, prediction: Tensor, target: Tensor, losses: Tensor) -> Tensor:
        """Whether the samples' losses change when the batch is cut in two, its first sample
        and the rest, each part given alone: a statistic of the batch (its largest, its sum,
        its counts) differs from a part's on one side at least, wherever its extreme sample
        sits. With one sample, whether it changes when the sample is given with itself and
        two made-up others (a batch's sum doubles at least, and its largest loss is likely
        another's)."""
        n = prediction.shape[0]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a statistic of one sample may warn (var)
            p, t = prediction.detach(), target
            if n >= 2:
                cut = [one_per_sample(self.loss_fn(p[a:b], t[a:b])) for a, b in ((0, 1), (1, n))]
                if [c.shape for c in cut] != [(1,), (n - 1,)]:  # not one loss per sample there
                    return torch.ones(1, dtype=torch.bool, device=losses.device)
                part, whole_ = torch.cat(cut), one_per_sample(losses.detach())
            else:  # beside itself and two made-up others: sums, counts and extremes move
                others = [2 * p + 1, -3 * p - 2] if p.is_floating_point() else [p, p]
                more = self.loss_fn(torch.cat([p, p, *others]), torch.cat([t] * 4))
                part, whole_ = one_per_sample(more)[:1], one_per_sample(losses.detach())
            # The same per-sample operations on fewer rows round alike, or within a few
            # units in the last place where a reduction inside a sample is blocked
            # otherwise: 64 of them. A statistic of another batch moves a loss by far more
            # (1e-4 of it for a variance offset by 1000). A statistic that has no value on
            # a part (a variance of one sample) differs too; a loss that is not finite to
            # begin with is the finiteness check's.
            scale = whole_.abs().max().clamp(min=torch.finfo(whole_.dtype).tiny)
            same = (part - whole_).abs() <= 64 * torch.finfo(whole_.dtype).eps * scale
            return (~same & whole_.isfinite()).any().reshape(1)


def loss_print(loss_fn: Any, prediction: Tensor, target: Tensor) -> Tensor:
    """What ``loss_fn`` computes, as float64 numbers that every rank calling the same
    function with the same settings on inputs of the same shapes gets alike: its losses on
    made-up inputs of the shapes (two samples) and dtypes of ``prediction`` and ``target``,
    summed plainly and with position weights, then a digest of those shapes and dtypes
    (prints are compared only where it agrees). Another loss (Huber for MSE), or a weight
    or setting that differs by rank, gives other numbers. Integer targets are made up as
    classes 0 and 1 in turn (classes every classification loss takes, one at least not an
    ``ignore_index``). A function that fails on made-up
    inputs prints as a fixed pair (it is then not compared); the caller's random state is
    left as it was."""
    device = prediction.device
    shapes = (tuple(prediction.shape[1:]), tuple(target.shape[1:]), prediction.dtype, target.dtype)
    digest = float(zlib.crc32(repr(shapes).encode()))
    failed = torch.tensor([-1.0, -1.0, digest], dtype=torch.float64, device=device)

    def made_up(t: Tensor, k: float) -> Tensor:
        shape = (2, *t.shape[1:])
        if not t.is_floating_point():  # classes 0 and 1, alternating
            return (torch.arange(math.prod(shape), device=t.device) % 2).reshape(shape).to(t.dtype)
        wave = torch.arange(math.prod(shape), dtype=torch.float64, device=t.device)
        return torch.cos(wave * k + 0.5).reshape(shape).to(t.dtype)

    try:
        forked = [device] if device.type == "cuda" else []
        with torch.no_grad(), warnings.catch_warnings(), torch.random.fork_rng(forked):
            warnings.simplefilter("ignore")
            out = loss_fn(made_up(prediction, 1.3), made_up(target, 0.7))
    except Exception:  # a loss that needs real inputs (a mask, an index range)
        return failed
    if not isinstance(out, Tensor) or not out.numel():
        return failed
    f = torch.nan_to_num(out.detach().reshape(-1).to(torch.float64), nan=3.0, posinf=5.0)
    w = torch.cos(torch.arange(f.numel(), dtype=torch.float64, device=f.device))
    return torch.stack([f.sum(), (f * w).sum(), f.new_tensor(digest)]).to(device)


def _function(fn: Any) -> Any:
    """What identifies a loss function across calls (a bound method's function)."""
    return getattr(fn, "__func__", fn)


def _plain(*tensors: Any) -> bool:
    """Plain tensors with a sample dimension, not under a functorch transform."""
    return all(
        isinstance(t, Tensor)
        and t.dim() > 0
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
        for t in tensors
    )
