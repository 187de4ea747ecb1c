"""Dropout that draws the same masks on any number of processes.

A mask entry is a function of a key, never of a generator's state: (seed, meta-step, global
task index, which forward of the task, which dropout call of that forward, the sample's
global index in its batch, the entry's position in the sample). A process holding samples 5
to 9 of a batch draws exactly the masks those samples get on one process, whatever the split,
and a recomputed forward draws the same masks again.

The numbers come from a counter-based hash (``lowbias32``, a bijection on 32 bits, applied
twice) computed with ``int64`` tensor operations on the device: no generator, no host read,
no state that moves. Products are split in 16-bit halves so that no ``int64`` operation
overflows, so every device computes the same bits.

State is explicit and scoped. :func:`meta_batch` holds a meta-batch's keys and :func:`task`
opens a :class:`DrawScope` for one task's work (an algorithm's ``meta_loss`` or ``adapt``);
:func:`keyed_forward` gives one forward on one batch its :class:`ForwardKey`, numbered in the
scope; a rebuilt step re-enters its number (:func:`reserve`, :func:`numbered`), and stacked
tasks or chunks gather their keys by their slot in ``torch.vmap`` (:class:`StackedKey`). The
routing (``_routes``) reads the key when the model calls dropout. Where no scope is open the
model's draws are PyTorch's own (and refused where the work is split); inside a scope, a
forward that cannot be keyed (``clone()``'s, a hand-run one under ``MetaDDP``) refuses to
draw, naming why.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import math
import struct
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` in ``int64`` without overflow: ``c`` is
    split in 16-bit halves, and only the low 16 bits of the high product are kept."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def hash32(x: Tensor) -> Tensor:
    """``lowbias32`` (C. Wellons' hash prospector) of ``int64`` values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def mix(*parts: int) -> tuple[int, int]:
    """Two 32-bit keys from any integers, each taken modulo 2**64 (a cryptographic digest: no
    structure survives)."""
    words = struct.pack(f"<{len(parts)}Q", *(p % 2**64 for p in parts))
    digest = hashlib.blake2b(words, digest_size=8).digest()
    a, b = struct.unpack("<II", digest)
    return a, b


def uniform_bits(key: tuple[int | Tensor, int | Tensor], rows: Tensor, entries: Tensor) -> Tensor:
    """32 random bits (as ``int64``) for every (row, entry) pair: ``[len(rows), *entries]``.

    Args:
        key: the call's two 32-bit keys (:func:`mix`).
        rows: the samples' global indices, ``int64`` ``[n]``.
        entries: the entries' positions within a sample, ``int64``, any shape.
    """
    k0, k1 = key
    r = hash32((rows + k0) & _M32).reshape(-1, *([1] * entries.dim()))
    return hash32(hash32(r ^ (entries & _M32)) ^ k1)


def keep_mask(
    key: tuple[int | Tensor, int | Tensor],
    rows: Tensor,
    entries: Tensor,
    p: float,
    dtype: torch.dtype,
) -> Tensor:
    """Dropout's multiplier: ``1 / (1 - p)`` where an entry is kept (probability ``1 - p``,
    exactly: the threshold is an integer of 32 bits), 0 where dropped."""
    threshold = min(round(p * 2.0**32), 2**32)
    kept = uniform_bits(key, rows, entries) >= threshold
    return kept.to(dtype) * (1.0 / (1.0 - p)) if p < 1 else kept.to(dtype) * 0.0


@dataclasses.dataclass
class DrawScope:
    """One task's work: every forward it runs is numbered here, in the order it runs, which
    is the same on every process that runs the task.

    Attributes:
        seed: the run's seed (the algorithm's ``draw_seed``).
        step: the meta-step.
        task: the task's global index in the meta-batch; ``None`` where it is not known (a
            plain list of tasks split over processes), which refuses to draw.
        stacked: the global indices of tasks run stacked under ``torch.vmap`` (their forwards
            in lockstep, numbered alike), in place of ``task``.
        refuse: why no forward here can be keyed (``None``: they can).
        forwards: forwards numbered so far.
    """

    seed: int
    step: int
    task: int | None
    refuse: str | None = None
    forwards: int = 0
    stacked: tuple[int, ...] | None = None


@dataclasses.dataclass
class ForwardKey:
    """One forward on one batch: where its samples start in the global batch, how many this
    process holds, and the key every dropout call of the forward derives its own from."""

    parts: tuple[int, ...]
    start: int
    rows: int
    calls: int = 0

    def next_call(self) -> tuple[int, int]:
        """The key of the forward's next dropout call (calls are numbered in order)."""
        self.calls += 1
        return mix(*self.parts, self.calls)

    def row_indices(self, device: torch.device) -> Tensor:
        return torch.arange(self.start, self.start + self.rows, device=device, dtype=torch.int64)


@dataclasses.dataclass
class StackedKey:
    """One forward of tasks (or of chunks of tasks) stacked under ``torch.vmap``: each
    one's key parts and the global index of its first sample, and its position in the stack
    as a tensor batched by ``vmap`` (``slot``), so that a dropout call draws each one's own
    masks, the ones its samples get in the loop."""

    parts: list[tuple[int, ...]]
    slot: Tensor
    start: int | list[int]
    rows: int
    calls: int = 0

    def next_call(self) -> tuple[Tensor, Tensor]:
        self.calls += 1
        keys = [mix(*p, self.calls) for p in self.parts]
        table = torch.tensor(keys, dtype=torch.int64, device=self.slot.device)
        mine = table[self.slot]  # this task's row: a gather batched by vmap
        return mine[0], mine[1]

    def row_indices(self, device: torch.device) -> Tensor:
        rows = torch.arange(self.rows, device=device, dtype=torch.int64)
        if isinstance(self.start, int):
            return rows + self.start
        starts = torch.tensor(self.start, dtype=torch.int64, device=self.slot.device)
        return rows + starts[self.slot]  # this one's first sample: batched by vmap


Key = ForwardKey | StackedKey


_SCOPE: contextvars.ContextVar[DrawScope | None] = contextvars.ContextVar(
    "metaddp_draw_scope", default=None
)
_FORWARD: contextvars.ContextVar[Key | None] = contextvars.ContextVar(
    "metaddp_forward_key", default=None
)


@dataclasses.dataclass(frozen=True)
class _MetaBatch:
    seed: int
    step: int
    indices: range | None


_BATCH: contextvars.ContextVar[_MetaBatch | None] = contextvars.ContextVar(
    "metaddp_draw_meta_batch", default=None
)


@contextlib.contextmanager
def _holding(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    """``var`` set to ``value`` inside, what it was after."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextlib.contextmanager
def meta_batch(seed: int, step: int, indices: range | None) -> Iterator[None]:
    """The keys of one meta-batch's work: the seed, the meta-step and the global indices of
    this process's tasks (``None``: not known)."""
    with _holding(_BATCH, _MetaBatch(seed, step, indices)):
        yield


@contextlib.contextmanager
def task(i: int) -> Iterator[None]:
    """Open the draw scope of this process's ``i``-th task of the meta-batch (nothing outside
    :func:`meta_batch`)."""
    batch = _BATCH.get()
    if batch is None:
        yield
        return
    index = None if batch.indices is None else batch.indices[i]
    with _holding(_SCOPE, DrawScope(batch.seed, batch.step, index)):
        yield


@contextlib.contextmanager
def stacked_tasks(count: int) -> Iterator[None]:
    """Open the draw scope of this process's ``count`` tasks run stacked (all of the current
    meta-batch's); nothing outside :func:`meta_batch`."""
    batch = _BATCH.get()
    if batch is None:
        yield
        return
    indices = None if batch.indices is None else tuple(batch.indices[:count])
    scope = DrawScope(batch.seed, batch.step, None, stacked=indices)
    if indices is None:
        scope.refuse = (
            "the tasks' global indices are unknown (a plain list of tasks split over "
            "processes): pass the tasks as a metaddp.MetaBatch (learner.shard(...))"
        )
    with _holding(_SCOPE, scope):
        yield


@contextlib.contextmanager
def stacked_forward(
    slot: Tensor | None, start: int | list[int] | None, rows: int, per_task: int = 1
) -> Iterator[None]:
    """Key the dropout of one stacked forward (inside ``torch.vmap`` over the tasks, ``slot``
    the task's position, batched) in the current scope. With ``per_task`` > 1 the stack holds
    that many chunks of each task in a row (deterministic mode), ``start`` then each chunk's
    first sample."""
    scope = _SCOPE.get()
    if scope is None:
        yield
        return
    number = scope.forwards
    scope.forwards += 1
    key: Key | None = None
    if (
        scope.refuse is None
        and scope.stacked is not None
        and start is not None
        and slot is not None
    ):
        parts: list[tuple[int, ...]] = [
            (scope.seed, scope.step, t, number) for t in scope.stacked for _ in range(per_task)
        ]
        key = StackedKey(parts, slot, start, rows)
    with _holding(_FORWARD, key):
        yield


@contextlib.contextmanager
def unkeyed(why: str) -> Iterator[None]:
    """Inside, every forward refuses dropout, saying ``why`` (a stacked or rebuilt forward,
    whose draws could not be the one-process ones)."""
    outer = _SCOPE.get()
    scope = DrawScope(0, 0, None, why) if outer is None else dataclasses.replace(outer, refuse=why)
    with _holding(_SCOPE, scope):
        yield


def reserve(forwards: int) -> DrawScope | None:
    """Number the next ``forwards`` forwards of the current scope now, for a loop that runs
    them later, or again (a rebuilt inner step in a backward, outside the scope): returns the
    scope as it stood, which :func:`numbered` re-enters; ``None`` outside a scope."""
    scope = _SCOPE.get()
    if scope is None:
        return None
    kept = dataclasses.replace(scope)
    scope.forwards += forwards
    return kept


@contextlib.contextmanager
def numbered(kept: DrawScope | None, number: int) -> Iterator[None]:
    """Inside, the next forward is forward ``number`` of the reserved run (:func:`reserve`),
    whenever it runs: the same masks every time."""
    if kept is None:
        yield
        return
    with _holding(_SCOPE, dataclasses.replace(kept, forwards=kept.forwards + number)):
        yield


def scope_open() -> bool:
    """Whether a draw scope is open (metaddp's own loops are running a forward)."""
    return _SCOPE.get() is not None


def unkeyed_here() -> str | None:
    """Why a draw here could not be keyed: ``None`` inside metaddp's own loops (a scope open
    that refuses nothing), the open scope's refusal, or ``""`` where no scope is open (a
    forward run by hand)."""
    scope = _SCOPE.get()
    if scope is None:
        return ""
    return scope.refuse


def batch_start(batch: Any) -> int | None:
    """The global index of the first sample ``batch`` holds: 0 for a whole batch, a shard's
    own ``start`` where it was cut by metaddp, ``None`` where nobody said."""
    if batch.x.shape[0] == batch.n:
        return 0
    start = getattr(batch, "start", None)
    return start if isinstance(start, int) else None


@contextlib.contextmanager
def keyed_forward(batch: Any, number: int | None = None) -> Iterator[None]:
    """Key the dropout of one forward on ``batch`` inside the current scope (nothing to do
    outside one): the scope's next forward, or forward ``number`` (one outside the loops'
    numbering, which does not advance it)."""
    scope = _SCOPE.get()
    if scope is None:
        yield
        return
    start = batch_start(batch)
    if number is None:
        number = scope.forwards
        scope.forwards += 1
    key = None
    if scope.refuse is None and scope.task is not None and start is not None:
        key = ForwardKey((scope.seed, scope.step, scope.task, number), start, batch.x.shape[0])
    with _holding(_FORWARD, key):
        yield


def current_key(what: str) -> Key | None:
    """The key of the running forward for a draw of ``what``; ``None`` where no scope is
    open (the draw is PyTorch's own). Raises where a scope is open but this forward cannot
    be keyed, naming why."""
    key = _FORWARD.get()
    if key is not None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"{what} in a meta-step recorded as a CUDA graph: the graph would replay the "
                "masks of the step it recorded at every step. Record models without dropout, "
                "or run the step without a CUDA graph (cuda_graphs=False)"
            )
        return key
    scope = _SCOPE.get()
    if scope is None:
        return None
    if scope.refuse is not None:
        why = scope.refuse
    elif scope.task is None and scope.stacked is None:
        why = (
            "the task's global index is unknown (a plain list of tasks split over processes): "
            "pass the tasks as a metaddp.MetaBatch (learner.shard(...))"
        )
    else:
        why = (
            "this forward is not on one of metaddp's batches with a known start (a shard made "
            "with Batch.local(x, y, n) says nothing of where its samples start: give start=, "
            "or cut it with learner.shard or Batch.split), or runs outside metaddp's inner and "
            "query passes"
        )
    raise ValueError(
        f"{what} draws random numbers in a forward whose masks metaddp cannot key to the "
        f"samples: {why}. Set its probability to 0 or call .eval() on the layer"
    )


def dropout_mask(key: Key, x: Tensor, p: float, feature: bool, what: str) -> Tensor:
    """The mask of one dropout call on ``x``, whose first dimension must hold the forward's
    samples (``feature``: one draw per channel, broadcast over the rest)."""
    if x.dim() == 0 or x.shape[0] != key.rows:
        raise ValueError(
            f"{what} on a tensor of shape {tuple(x.shape)}, whose first dimension is not the "
            f"{key.rows} sample(s) this process holds of the batch: metaddp keys each "
            "sample's masks by the first dimension. Build the layers with batch_first=True "
            "(samples first) or set the dropout to 0"
        )
    shape = list(x.shape[1:2]) + [1] * (x.dim() - 2) if feature else list(x.shape[1:])
    entries = torch.arange(math.prod(shape), device=x.device, dtype=torch.int64).reshape(shape)
    rows = key.row_indices(x.device)
    return keep_mask(key.next_call(), rows, entries, p, x.dtype)


def attention_keep(
    key: Key, shape: tuple[int, ...], p: float, dtype: torch.dtype, device: torch.device
) -> Callable[[slice], Tensor]:
    """The dropout multiplier of attention probabilities of ``shape`` ``[N, *heads, L, S]``,
    for a slice of the query rows at a time (recomputed alike every time it is asked for)."""
    if len(shape) < 3 or shape[0] != key.rows:
        raise ValueError(
            f"attention dropout on probabilities of shape {shape}, whose first dimension is "
            f"not the {key.rows} sample(s) this process holds of the batch: metaddp keys each "
            "sample's masks by the first dimension. Put the samples first (batch_first=True) "
            "or set the attention dropout to 0"
        )
    call = key.next_call()
    heads, length, width = math.prod(shape[1:-2]), shape[-2], shape[-1]
    rows = key.row_indices(device)

    def keep(sl: slice) -> Tensor:
        r = range(length)[sl]
        h = torch.arange(heads, device=device, dtype=torch.int64).reshape(-1, 1, 1)
        i = torch.arange(r.start, r.stop, r.step, device=device, dtype=torch.int64)
        j = torch.arange(width, device=device, dtype=torch.int64)
        entries = (h * length + i.reshape(1, -1, 1)) * width + j.reshape(1, 1, -1)
        mask = keep_mask(call, rows, entries, p, dtype)
        return mask.reshape(shape[0], *shape[1:-2], len(r), width)

    return keep
