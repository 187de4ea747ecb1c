"""Splitting global batches and task streams over ranks, by global index only.

Nothing here pads: a shard may be one sample shorter than another, or empty. Every random
choice is a function of a seed and a *global* index, never of the rank, so the data a
meta-batch sees is the same for any number of processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
import operator
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, overload

import torch
from torch import Tensor
from torch.utils._pytree import tree_map
from torch.utils.data import default_collate


def whole(value: Any, what: str) -> int:
    """``value`` as an ``int``; an error for anything that is not a whole number (a float
    count would otherwise be truncated, or divide by a count no batch has)."""
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)
    raise TypeError(f"{what} must be a whole number (an int), got {value!r}")


def at_least(value: object, what: str, least: int = 1) -> None:
    """Refuse anything but a whole number (an ``int``, not a ``bool``) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} needs a whole number >= {least}, got {value!r}")


def positive(value: Any, what: str, *, integer: bool = False) -> Any:
    """``value`` if it is a positive finite number (a whole one with ``integer``); an error
    naming ``what`` otherwise (a negative rate or zero steps would train silently wrong)."""
    if integer:
        value = whole(value, what)
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{what} must be positive and finite, got {value!r}")
    return value


def shard_range(n: int, index: int, parts: int) -> range:
    """Global indices ``[start, stop)`` of part ``index`` of ``n`` items split into ``parts``.

    Contiguous blocks whose sizes differ by at most one; empty when ``n < parts``.
    """
    n, index, parts = whole(n, "a count"), whole(index, "a part"), whole(parts, "a part count")
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts} does not exist")
    if n < 0:
        raise ValueError(f"cannot split {n} items")
    return range(n * index // parts, n * (index + 1) // parts)


def shard(tensor: Tensor, index: int, parts: int) -> Tensor:
    """Part ``index`` of ``parts`` of ``tensor`` along dimension 0 (see :func:`shard_range`)."""
    r = shard_range(tensor.shape[0], index, parts)
    return tensor[r.start : r.stop]


class Chunks(NamedTuple):
    """A batch of ``n`` samples cut by global index into ``n_chunks`` chunks of ``size`` samples
    (the last may be shorter), of which one part of the ranks holds ``mine``.

    The cut depends on ``n`` and the chunk limit alone, never on the number of parts: the
    same samples meet in the same chunk on any number of processes.
    """

    n: int
    size: int
    n_chunks: int
    mine: range

    @classmethod
    def of(cls, n: int, limit: int, index: int = 0, parts: int = 1) -> Chunks:
        """At most ``limit`` chunks of equal size (but the last); part ``index`` of ``parts``
        holds a contiguous run of whole chunks (:func:`shard_range` over chunks)."""
        n, limit = whole(n, "a batch's size"), whole(limit, "a chunk count")
        if limit < 1:
            raise ValueError(f"a batch must be cut into at least one chunk, got {limit}")
        size = max(1, -(-n // limit))
        n_chunks = -(-n // size)
        return cls(n, size, n_chunks, shard_range(n_chunks, index, parts))

    @property
    def samples(self) -> range:
        """The global indices of the samples in this part's chunks."""
        return range(
            min(self.mine.start * self.size, self.n), min(self.mine.stop * self.size, self.n)
        )


class Batch(NamedTuple):
    """This rank's part of a batch of ``n`` samples: inputs ``x``, targets ``y``."""

    x: Tensor
    y: Tensor
    n: int

    @classmethod
    def local(cls, x: Tensor, y: Tensor, n: int, *, start: int | None = None) -> Batch:
        """A shard already cut by the caller; checked for consistent lengths. ``start``, the
        global index of its first sample, lets dropout draw each sample's own masks
        (:mod:`metaddp.forward`); without it a model that draws is refused on it."""
        if x.shape[0] != y.shape[0]:
            raise ValueError(
                f"a shard's inputs and targets disagree in length: {x.shape[0]} inputs, "
                f"{y.shape[0]} targets"
            )
        n = whole(n, "a batch's global size")
        if x.shape[0] > n:
            raise ValueError(f"a shard of {x.shape[0]} samples cannot belong to a batch of {n}")
        if start is not None:
            start = whole(start, "a shard's start")
            if not 0 <= start <= n - x.shape[0]:
                raise ValueError(
                    f"a shard of {x.shape[0]} samples cannot start at {start} in a batch of {n}"
                )
        return Shard.at(x, y, n, start)

    @classmethod
    def split(cls, x: Tensor, y: Tensor, index: int, parts: int) -> Batch:
        """Part ``index`` of ``parts`` of the global batch ``(x, y)`` (the same on every rank)."""
        if x.shape[0] != y.shape[0]:
            raise ValueError(
                f"a batch's inputs and targets disagree in length: {x.shape[0]} inputs, "
                f"{y.shape[0]} targets"
            )
        r = shard_range(x.shape[0], index, parts)
        return Shard.at(x[r.start : r.stop], y[r.start : r.stop], x.shape[0], r.start)

    def whole_where_split(self) -> bool:
        """Whether this batch holds all of its samples without being known as a rank's part
        (a whole batch, or a shard given its own length as ``n``): wrong where several ranks
        split its samples, each of which would add the whole batch."""
        return self.n > 0 and self.x.shape[0] == self.n and not isinstance(self, Shard)


class Shard(Batch):
    """A :class:`Batch` known to be one rank's part of its batch (from :meth:`Batch.split`,
    :meth:`Batch.local` or ``MetaDDP.shard``): it may hold all ``n`` samples, where the other
    ranks hold none. ``start`` is the global index of its first sample, where known."""

    start: int | None = None

    @classmethod
    def at(cls, x: Tensor, y: Tensor, n: int, start: int | None) -> Shard:
        out = cls(x, y, n)
        out.start = start
        return out

    def _replace(self, **changes: Any) -> Shard:
        # The same samples, other tensors (moved, cast): where they start stays known.
        out = super()._replace(**changes)
        out.start = self.start
        return out


class Task(NamedTuple):
    """One task of a meta-batch: a support batch to adapt on, a query batch to score."""

    support: Batch
    query: Batch

    def split(self, index: int, parts: int) -> Task:
        """This rank's part of both batches, when the task's samples are split over ``parts``."""
        s, q = self.support, self.query
        if s.x.shape[0] != s.n or q.x.shape[0] != q.n:
            raise ValueError("only a whole task (not a shard of one) can be split")
        return Task(Batch.split(s.x, s.y, index, parts), Batch.split(q.x, q.y, index, parts))


def _task(value: Any, what: str) -> Task:
    """``value`` if it is a :class:`Task` of two :class:`Batch` es; else an error naming it."""
    if isinstance(value, Task) and all(isinstance(b, Batch) for b in value):
        return value
    raise TypeError(
        f"{what} is a {type(value).__name__}, not a metaddp.Task of two metaddp.Batches: "
        "build it as md.Task(md.Batch(x_support, y_support, n_support), "
        "md.Batch(x_query, y_query, n_query))"
    )


BatchKey = str | tuple[int, str]
"""A batch's name in an error: a text, or (task index, ``"support"`` or ``"query"``)."""


def named_batches(tasks: Sequence[Task]) -> dict[BatchKey, Batch]:
    """Every task's support and query batch, by a key :func:`batch_name` names (made into
    text only for an error: this runs on every step)."""
    out: dict[BatchKey, Batch] = {}
    for i, t in enumerate(tasks):
        out[(i, "support")], out[(i, "query")] = t.support, t.query
    return out


def batch_name(key: BatchKey) -> str:
    return key if isinstance(key, str) else f"task {key[0]}'s {key[1]}"


def check_batches(
    batches: Mapping[BatchKey, Batch], like: Tensor | None, *, whole: bool, dtypes: bool = True
) -> None:
    """Refuse batches that cannot be what they say, before any work (no collective).

    Args:
        batches: the batches by the key an error names them by (:func:`batch_name`).
        like: a parameter of the model the batches go to: a floating-point input of another
            dtype, or an input on another device, is named here rather than deep in a layer.
        whole: every batch must hold all of its ``n`` samples (one process, or ranks that hold
            whole tasks); a batch of 5 samples that says 7 would weigh each sample 5/7.
        dtypes: compare the inputs' dtype with ``like``'s (not under autocast).
    """
    device = None if like is None else like.device
    dtype = like.dtype if like is not None and dtypes and like.is_floating_point() else None
    for key, b in batches.items():
        x, y, n = b
        held = x.shape[0] if x.dim() else 0
        if held != (y.shape[0] if y.dim() else 0) or held > n or (whole and held != n):
            _refuse_sizes(batch_name(key), b, whole)
        if device is not None and x.device != device:
            raise ValueError(
                f"{batch_name(key)} batch is on {x.device}, the model on {device}: move the "
                "task's tensors to the model's device (or the model to theirs)"
            )
        if dtype is not None and x.dtype != dtype and x.is_floating_point():
            raise TypeError(
                f"{batch_name(key)} batch's inputs are {x.dtype}, the model's parameters "
                f"{dtype}: convert one to the other (model.to(dtype) or x.to(dtype))"
            )


def _refuse_sizes(name: str, b: Batch, whole: bool) -> None:
    held, targets = b.x.shape[0] if b.x.dim() else 0, b.y.shape[0] if b.y.dim() else 0
    if held != targets:
        raise ValueError(f"{name} batch has {held} inputs but {targets} targets")
    if held > b.n:
        raise ValueError(f"{name} batch holds {held} samples but says it has {b.n}")
    raise ValueError(
        f"{name} batch holds {held} samples but says it has n={b.n}: on one process "
        "(or where each rank holds whole tasks) a batch holds all of its samples, and "
        "its losses are divided by n. Build it as Batch(x, y, len(x)); "
        "learner.shard(...) cuts a meta-batch for the layout it runs on"
    )


class MetaBatch(Sequence[Task]):
    """This process's tasks of a global meta-batch of :attr:`n` tasks.

    It carries the global task count with it, so that nothing downstream has to be told it
    (and nobody can pass a local count where the global one is meant). Build it with
    :meth:`shard`, or ``MetaDDP.shard`` which fills in the mesh.

    Attributes:
        n: tasks in the global meta-batch.
        indices: the global positions (``0 .. n-1``) of this process's tasks.
        source: what :meth:`shard` built it from: the whole meta-batch (a tuple of every
            task) or ``make_task``; ``None`` for one made by hand. The wrapper's first-step
            check compares it across the ranks.
    """

    source: tuple[Task, ...] | Callable[[int], Task] | None = None

    def __init__(self, tasks: Sequence[Task], n: int, indices: range) -> None:
        if (
            n < 0
            or len(tasks) != len(indices)
            or (len(indices) and not 0 <= indices[0] <= indices[-1] < n)
        ):
            raise ValueError(
                f"{len(tasks)} task(s) at positions {indices} cannot be part of a meta-batch of {n}"
            )
        self.tasks, self.n, self.indices = tuple(tasks), int(n), indices

    @classmethod
    def shard(
        cls,
        tasks: int | Sequence[Task],
        make_task: Callable[[int], Task] | None = None,
        *,
        task_index: int = 0,
        task_parts: int = 1,
        sample_index: int = 0,
        sample_parts: int = 1,
    ) -> MetaBatch:
        """Part ``task_index`` of the meta-batch's tasks, each cut to part ``sample_index``.

        Args:
            tasks: the global meta-batch (a sequence of whole tasks), or its size ``n`` with
                ``make_task(i)`` building whole task ``i`` (then only this part is built).
            make_task: builds global task ``i`` in ``0 .. n-1`` (from a seed and ``i`` alone).
            task_index, task_parts: which of the groups that hold different tasks this is.
            sample_index, sample_parts: which shard of every task's samples this is.
        """
        if isinstance(tasks, (int, numbers.Real)):  # a count (a float one is refused below)
            if make_task is None:
                raise TypeError("MetaBatch.shard(n, make_task): give make_task(i) to build task i")
            n, build = whole(tasks, "a meta-batch's task count"), make_task
        else:
            if make_task is not None:
                raise TypeError("give either the tasks or their number and make_task, not both")
            if isinstance(tasks, MetaBatch):
                # Already one rank's part: cutting it again would make a meta-batch of its
                # tasks alone, of another size on every rank.
                raise ValueError(
                    f"{tasks!r} is already this rank's part of a meta-batch: pass it to "
                    "meta_loss as it is, or shard the whole meta-batch (every task, on every "
                    "rank) once"
                )
            every = tuple(_task(t, f"task {i} of the meta-batch") for i, t in enumerate(tasks))
            n, build = len(every), every.__getitem__
        if n < 1:
            raise ValueError(f"a meta-batch needs at least one task, got {n}")
        mine = shard_range(n, task_index, task_parts)
        out = cls(
            [_task(build(i), f"make_task({i})").split(sample_index, sample_parts) for i in mine],
            n,
            mine,
        )
        out.source = make_task if make_task is not None else every
        return out

    @overload
    def __getitem__(self, i: int) -> Task: ...
    @overload
    def __getitem__(self, i: slice) -> MetaBatch: ...
    def __getitem__(self, i):
        """This process's ``i``-th task; or, for a slice, the meta-batch of the global tasks
        the slice picks (``batch[:k]``: global tasks ``0 .. k-1``, as on one process), this
        process holding those of its own among them."""
        if not isinstance(i, slice):
            return self.tasks[i]
        chosen = range(self.n)[i]
        mine = zip(self.indices, self.tasks, strict=True)
        kept = sorted((chosen.index(g), t) for g, t in mine if g in chosen)
        at = kept[0][0] if kept else 0
        return MetaBatch([t for _, t in kept], len(chosen), range(at, at + len(kept)))

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __reversed__(self) -> Iterator[Task]:
        return reversed(self.tasks)

    def __bool__(self) -> bool:
        return bool(self.tasks)

    def __len__(self) -> int:
        # A count that is the global one at one process and a rank's at several: a meta-loss
        # divided by it would change with the number of processes, so there is none.
        raise TypeError(
            "len() of a MetaBatch is not defined: batch.n is the number of tasks in the global "
            "meta-batch (divide a meta-loss by it), len(batch.tasks) the number this process "
            "holds"
        )

    def __repr__(self) -> str:
        return (
            f"MetaBatch({len(self.tasks)} of {self.n} tasks, "
            f"positions {self.indices.start}..{self.indices.stop - 1})"
        )


def seed_for(seed: int, *index: int) -> int:
    """A 63-bit seed derived from ``seed`` and global indices (stable across runs and ranks)."""
    key = (whole(seed, "a seed"), *(whole(i, "an index") for i in index))
    h = hashlib.blake2b(repr(key).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


KEYED: weakref.WeakSet[torch.Generator] = weakref.WeakSet()
"""The generators :func:`generator_for` made: keyed by global indices, so their draws are
the same on every process (the checked step's watch for ``generator=`` passes them)."""


def generator_for(seed: int, *index: int) -> torch.Generator:
    """A ``torch.Generator`` for the item with these global indices (e.g. step, task)."""
    g = torch.Generator().manual_seed(seed_for(seed, *index))
    KEYED.add(g)
    return g


class ShardSampler(torch.utils.data.Sampler[list[int]]):
    """Batch sampler yielding this rank's indices of each global batch, with no padding.

    The global order is a permutation seeded by ``(seed, epoch)`` (or the identity with
    ``shuffle=False``); every global batch of ``batch_size`` indices is then cut into
    ``parts`` contiguous shards, empty where a batch has fewer samples than ``parts``.
    :meth:`loader` loads them (a plain ``DataLoader(dataset, batch_sampler=...)`` fails on an
    empty shard: torch's default collate cannot make a batch of none); the global size of
    each batch is :meth:`batch_sizes` (the last one may be short unless ``drop_last``).
    """

    def __init__(
        self,
        length: int,
        batch_size: int,
        index: int = 0,
        parts: int = 1,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        length, batch_size = whole(length, "length"), whole(batch_size, "batch_size")
        seed = whole(seed, "seed")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        shard_range(0, index, parts)  # validates index/parts
        self.length, self.batch_size = length, batch_size
        self.index, self.parts = index, parts
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        return torch.randperm(self.length, generator=generator_for(self.seed, self.epoch)).tolist()

    def batch_sizes(self) -> list[int]:
        full, rest = divmod(self.length, self.batch_size)
        return [self.batch_size] * full + ([rest] if rest and not self.drop_last else [])

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        start = 0
        for size in self.batch_sizes():
            glob = order[start : start + size]
            r = shard_range(size, self.index, self.parts)
            yield glob[r.start : r.stop]
            start += size

    def __len__(self) -> int:
        return len(self.batch_sizes())

    def loader(
        self,
        dataset: torch.utils.data.Dataset,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **kwargs: Any,
    ) -> torch.utils.data.DataLoader:
        """A ``DataLoader`` of ``dataset`` over this rank's shards, one per global batch
        (``kwargs`` go to it). An empty shard comes as a batch of zero samples shaped like
        the dataset's items, which ``collate_fn`` (default: torch's ``default_collate``)
        cannot make from none; every rank then takes part in every step."""
        collate = _ShardCollate(dataset, collate_fn or default_collate)
        return torch.utils.data.DataLoader(
            dataset, batch_sampler=self, collate_fn=collate, **kwargs
        )


class _ShardCollate:
    """A collate function that also makes a batch of zero items (a picklable object, for
    loader worker processes)."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate = dataset, collate

    def __call__(self, items: list[Any]) -> Any:
        if items:
            return self.collate(items)
        if len(self.dataset) == 0:
            raise ValueError("an empty dataset has no shape to make an empty batch of")
        like = self.collate([self.dataset[0]])
        return tree_map(lambda t: t[:0] if isinstance(t, Tensor) else t, like)
