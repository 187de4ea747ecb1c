"""Rows of a tensor over a process group, and the differentiable pair that moves them: an
all-gather whose adjoint is a reduce-scatter SUM, and the reverse.

[Note: why the gradient of a shard is complete]
Rank ``s`` of a group of ``S`` holds rows ``[s*c, (s+1)*c)`` of a tensor
(``c = ceil(rows / S)``; the last pieces shorter or empty, as ``torch.chunk`` and DTensor's
``Shard(0)`` cut). A forward gathers the full tensor ``W = G(w_0, ..., w_{S-1})`` on every
rank of the group. Each rank's loss is its *share*, so the global loss is
``L = sum_r L_r(W)``. The adjoint of "concatenate the pieces, give everyone the result" is
"sum everyone's cotangent, give each its own rows":
``dw_s = sum_r (dL_r/dW)[rows of s]``, a reduce-scatter SUM. So ``autograd.grad`` of a rank's
share by its shard *is* the shard of the global gradient, and no further reduction follows.
The adjoint of the reduce-scatter SUM is the all-gather again. Each Function's backward calls
the other (not a bare collective), so the pair stays on the graph under
``create_graph=True`` and composes to any order of differentiation, as ``_AllReduceSum``.

torch's ``DTensor.full_tensor()`` takes the other adjoint: its backward treats the incoming
gradient as replicated and keeps each rank's own slice, so with shares each rank keeps the
inner gradient of its own samples, the gradient of another problem.

Both collectives carry a sequence tag, as the all-reduces do (:mod:`._collectives`): a rank
at another collective is a :class:`CollectiveError` at the step's read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _host
from ._collectives import (
    _ADJOINT,
    SKIPPED,
    CollectiveError,
    Group,
    Phase,
    _check_header,
    _describe,
    _guard,
    _next_sequence,
    _record,
    comm_device,
    group_rank,
    origin_salt,
    strict,
)

_TAG_MODULUS = 4093  # as _collectives: world * tag stays exact in float32


@dataclasses.dataclass(frozen=True)
class Cut:
    """One tensor's cut over ``parts`` ranks along its first dimension: rank ``index`` holds
    rows ``[start, start + length)``."""

    shape: torch.Size
    parts: int
    index: int

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def width(self) -> int:
        """Entries per row."""
        return math.prod(self.shape[1:])

    @property
    def per(self) -> int:
        """Rows per rank before the last (every rank's padded piece)."""
        return -(-self.rows // self.parts)

    @property
    def start(self) -> int:
        return min(self.index * self.per, self.rows)

    @property
    def length(self) -> int:
        return max(0, min(self.per, self.rows - self.index * self.per))

    @property
    def local_shape(self) -> torch.Size:
        return torch.Size((self.length, *self.shape[1:]))

    @property
    def piece(self) -> int:
        """Entries in every rank's padded piece."""
        return self.per * self.width

    def view(self, full: Tensor) -> Tensor:
        """This rank's rows of ``full`` (a view where ``full`` is contiguous)."""
        rows = full.reshape(self.rows, self.width)[self.start : self.start + self.length]
        return rows.reshape(self.local_shape)

    def take(self, full: Tensor) -> Tensor:
        """This rank's rows of ``full`` (a copy)."""
        return self.view(full).clone()


Tagging = tuple[Phase, int, int]
"""A collective's phase, its tag's salt, and the salt its adjoint's tag takes
(:func:`._collectives.origin_salt`: the adjoint pairs only with the same forward's)."""


def _tag(group: Group, numel: int, how: Tagging) -> tuple[int, float]:
    phase, salt, _ = how
    seq = _next_sequence(group)
    return seq, float(1 + (seq * 31 + numel + int(phase) * 1021 + salt) % _TAG_MODULUS)


def _out_of_step(what: str, seq: int, numel: int, rank: int) -> CollectiveError:
    return CollectiveError(
        f"ranks are out of step at {_describe(what, seq, numel)} on rank {rank}: another rank "
        f"was at a different collective (the sequence tags disagree). {SKIPPED}"
    )


def _gather(shards: Sequence[Tensor], cuts: Sequence[Cut], group: Group, how: Tagging):
    """Every rank's pieces, concatenated into the full tensors (one all-gather)."""
    world = len(cuts) and cuts[0].parts
    like = shards[0]
    numel = sum(c.piece for c in cuts)
    seq, tag = _tag(group, numel, how)
    phase = how[0]
    tagged = like.dtype in (torch.float32, torch.float64)
    device = comm_device(group)
    # Each piece is copied once into the buffer sent (from any strides: a stacked task's rows
    # come transposed), padding zero, and once out of the buffer received.
    send = torch.empty(numel + int(tagged), dtype=like.dtype, device=device)
    offset = 0
    for t, cut in zip(shards, cuts, strict=True):
        n = cut.length * cut.width
        send[offset : offset + n].view(t.shape).copy_(t.detach())
        send[offset + n : offset + cut.piece].zero_()
        offset += cut.piece
    if tagged:
        send[-1] = tag
    recv = send.new_empty(world * send.numel())
    what = "the all-gather of sharded weights" + (
        " (in a backward pass)" if phase == Phase.BACKWARD else ""
    )
    if strict():
        _check_header(group, seq, numel, 8 + int(phase), what, device)
    _record(recv.numel(), recv.numel() * recv.element_size(), "all_gather")
    _guard(lambda: dist.all_gather_single(recv, send, group=group), what)
    table = recv.view(world, send.numel())
    if tagged:
        rank = group_rank(group)

        def verdict(got: list[float]) -> Exception | None:
            return None if all(g == tag for g in got) else _out_of_step(what, seq, numel, rank)

        _host.check(table[:, -1].clone(), verdict)
    out, offset = [], 0
    for cut in cuts:
        full = torch.empty(world, cut.piece, dtype=like.dtype, device=like.device)
        full.copy_(table[:, offset : offset + cut.piece])
        out.append(full.view(world * cut.per, *cut.shape[1:])[: cut.rows])
        offset += cut.piece
    return out


def _scatter_sum(fulls: Sequence[Tensor], cuts: Sequence[Cut], group: Group, how: Tagging):
    """Each rank's rows of the SUM over ranks of the full tensors (one reduce-scatter)."""
    world = cuts[0].parts
    like = fulls[0]
    numel = sum(c.piece for c in cuts)
    seq, tag = _tag(group, numel, how)
    phase = how[0]
    tagged = like.dtype in (torch.float32, torch.float64)
    # One buffer, each tensor copied into its columns once (padding rows zero): a gradient
    # the size of the layer is the largest thing here, and it is not copied twice
    # (from any strides: a stacked task's rows come transposed, and are not copied first).
    table = like.new_empty(world, numel + int(tagged))
    offset = 0
    for g, cut in zip(fulls, cuts, strict=True):
        if not cut.per:  # a tensor without rows
            continue
        rows = g.detach().reshape(cut.shape)
        whole = cut.rows // cut.per  # ranks with a full piece; the next one's is shorter
        block = table[:whole, offset : offset + cut.piece].view(whole, cut.per, *rows.shape[1:])
        block.copy_(rows[: whole * cut.per].unflatten(0, (whole, cut.per)))
        rest = rows[whole * cut.per :]
        if whole < world:
            table[whole, offset : offset + rest.numel()].view(rest.shape).copy_(rest)
            table[whole, offset + rest.numel() : offset + cut.piece].zero_()
            table[whole + 1 :, offset : offset + cut.piece].zero_()
        offset += cut.piece
    if tagged:
        table[:, -1] = tag
    device = comm_device(group)
    send = table.reshape(-1).to(device)
    recv = send.new_empty(send.numel() // world)
    what = "the reduce-scatter SUM of sharded weights' gradients" + (
        " (in a forward pass)" if phase == Phase.FORWARD else ""
    )
    if strict():
        _check_header(group, seq, numel, 16 + int(phase), what, device)
    _record(send.numel(), send.numel() * send.element_size(), "reduce_scatter")
    _guard(lambda: _reduce_scatter(recv, send, world, group), what)
    recv = recv.to(like.device)
    if tagged:
        rank = group_rank(group)

        def verdict(got: list[float]) -> Exception | None:
            return None if got == [world * tag] else _out_of_step(what, seq, numel, rank)

        _host.check(recv[-1:].clone(), verdict)
    out, offset = [], 0
    for cut in cuts:
        out.append(recv[offset : offset + cut.length * cut.width].reshape(cut.local_shape))
        offset += cut.piece
    return out


def _reduce_scatter(recv: Tensor, send: Tensor, world: int, group: Group) -> None:
    """``dist.reduce_scatter_single``, but through gloo as an all-to-all and a sum here, in
    rank order: gloo reduces the whole buffer on every rank (its reduce-scatter costs an
    all-reduce: 16.4 ms for 16 MiB at 2 processes, 9.5 this way; BENCHMARKS.md)."""
    if dist.get_backend(group) != "gloo":
        dist.reduce_scatter_single(recv, send, group=group)
        return
    pieces = torch.empty_like(send)
    dist.all_to_all_single(pieces, send, group=group)
    torch.sum(pieces.view(world, -1), 0, out=recv)


def _adjoint(ctx: Any) -> Tagging:
    """How the adjoint of the collective saved in ``ctx`` is tagged: in the other phase, with
    the salt its forward gave it."""
    phase, _, salt = ctx.how
    return _ADJOINT[phase], salt, origin_salt(ctx.group)


def _stacked(
    function: type[torch.autograd.Function], info: Any, in_dims: tuple, args: tuple
) -> tuple[tuple[Tensor, ...], tuple[int | None, ...]]:
    """``function(cuts, group, how, *tensors)`` under ``torch.vmap`` (tasks stacked along
    a dimension of their own): the same Function on the physical tensors, each vmapped
    dimension moved behind the rows, so that a rank's rows of a stacked ``[T, rows, ...]``
    tensor are a :class:`Cut` of ``[rows, T, ...]``. One collective for every task, and the
    backward, outside ``vmap``, the same pair of Functions."""
    cuts, group, how, *tensors = args
    moved, cuts_now = [], []
    out_dims: list[int | None] = []
    for t, dim, cut in zip(tensors, in_dims[3:], cuts, strict=True):
        if dim is None:  # the same for every task (a weight that is not a fast weight)
            moved.append(t)
            cuts_now.append(cut)
            out_dims.append(None)
            continue
        moved.append(t.movedim(dim, 1))
        shape = torch.Size((cut.rows, info.batch_size, *cut.shape[1:]))
        cuts_now.append(Cut(shape, cut.parts, cut.index))
        out_dims.append(1)
    return function.apply(tuple(cuts_now), group, how, *moved), tuple(out_dims)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(cuts, group, how, *shards):
        return tuple(_gather(shards, cuts, group, how))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.cuts, ctx.group, ctx.how = inputs[:3]

    @staticmethod
    def backward(ctx, *grads):
        # The adjoint of the all-gather: each rank's rows of the SUM of every rank's
        # cotangent (the Note above). A Function, so it stays on the graph.
        return (None, None, None, *_ScatterSum.apply(ctx.cuts, ctx.group, _adjoint(ctx), *grads))

    @staticmethod
    def vmap(info, in_dims, *args):
        return _stacked(_Gather, info, in_dims, args)


class _ScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(cuts, group, how, *fulls):
        return tuple(_scatter_sum(fulls, cuts, group, how))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.cuts, ctx.group, ctx.how = inputs[:3]

    @staticmethod
    def backward(ctx, *grads):
        # The adjoint of the reduce-scatter SUM: every rank receives every rank's rows.
        return (None, None, None, *_Gather.apply(ctx.cuts, ctx.group, _adjoint(ctx), *grads))

    @staticmethod
    def vmap(info, in_dims, *args):
        return _stacked(_ScatterSum, info, in_dims, args)


def gather(shards: Sequence[Tensor], cuts: Sequence[Cut], group: Group) -> list[Tensor]:
    """The full tensors from every rank's shards: differentiable to any order, with a
    reduce-scatter SUM as the adjoint. One collective per dtype and device, under
    ``torch.vmap`` too (for every vmapped slice at once)."""
    if cuts and cuts[0].parts == 1:
        return [s.reshape(c.shape) for s, c in zip(shards, cuts, strict=True)]
    return _by_kind(_Gather, shards, cuts, group)


def _by_kind(
    function: type[torch.autograd.Function],
    tensors: Sequence[Tensor],
    cuts: Sequence[Cut],
    group: Group,
) -> list[Tensor]:
    """``function`` applied to the tensors of each dtype and device together."""
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.dtype, t.device), []).append(i)
    out: list[Tensor] = list(tensors)
    for idx in kinds.values():
        how = (Phase.FORWARD, 0, origin_salt(group))
        got = function.apply(tuple(cuts[i] for i in idx), group, how, *(tensors[i] for i in idx))
        for i, t in zip(idx, got, strict=True):
            out[i] = t
    return out
