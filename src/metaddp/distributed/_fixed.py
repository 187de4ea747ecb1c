"""Sums whose bits do not depend on how the summands are split: fixed point in 64-bit integers.

A floating-point sum depends on the order of its additions, so a gradient summed over 3
samples on one rank and 2 on another differs in its last bits from the same gradient summed
over 5 on one rank. Integer addition is associative: here every summand is converted to an
``int64`` multiple of a power of two agreed by all ranks, the integers are added (locally,
then by one SUM all-reduce), and the total is converted back once. Any split of the summands
over ranks, and any order, gives the same bits.

The scale: for each output row, ``M`` is the largest ``|x|`` of its summands on any rank (one
MAX all-reduce), ``2**e > M``, and a summand becomes the integer part of
``x * 2**(62 - h - e)``, where ``2**h`` (:data:`SUMMANDS`) bounds the number of summands, so no
sum can overflow. The bound is a constant, not the actual count, because the scale must not
depend on how many summands a rank holds. The total is exact to ``2**-(62 - h)`` of ``M``
(2e-13): far below float32's rounding, so the result is as accurate as a float32 sum or
more. A non-finite summand makes its row NaN.

Two differentiable forms are adjoint to each other, so they compose to any order:

* :class:`_Gather`: ``[T, m, ...] -> [T, ...]``, the sum over the ``m`` local summands of each
  row and over the group's ranks; every rank gets the same total.
* :class:`_Spread`: ``[T, ...] -> [T, m, ...]``, copies of a value every rank holds alike.

Nothing here knows what is summed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _host
from ._collectives import (
    _TAG_MODULUS,
    CollectiveError,
    Group,
    Phase,
    _check_header,
    _guard,
    _next_sequence,
    _record,
    comm_device,
    group_rank,
    group_size,
    launch_sum,
    strict,
)

_BITS = 62  # |every partial sum| < 2**62 < 2**63
_HEADROOM = 20
SUMMANDS = 2**_HEADROOM  # the most summands one output entry may have, over all ranks
# The header kind of strict mode's check for the MAX (after the Phase values of the SUMs).
_MAX_KIND = 10


def _agree_max(values: Tensor, group: Group) -> Tensor:
    """Elementwise MAX over ``group`` of a 1-d float64 tensor, with an out-of-step tag made
    from this rank's call sequence on the group (shared with every other collective)."""
    if group_size(group) == 1:
        return values
    tag = float(1 + _next_sequence(group) % _TAG_MODULUS)
    device = comm_device(group)
    tag_t = torch.tensor([tag, -tag], dtype=torch.float64, device=values.device)
    flat = torch.cat([values, tag_t]).to(device)
    if strict():
        _check_header(group, int(tag), flat.numel(), _MAX_KIND, "fixed-point scale", device)
    _record(flat.numel(), flat.numel() * 8)
    _guard(lambda: dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group), "fixed-point scale")
    rank = group_rank(group)

    def verdict(got: list[float]) -> Exception | None:
        hi, lo = got[0], -got[1]
        if hi == lo:
            return None
        return CollectiveError(
            f"ranks are out of step at a deterministic sum on rank {rank}: its call tags range "
            f"{lo:g}..{hi:g} across ranks. Every rank must run the same sums in the same order: "
            "check that inner-step counts, algorithms and meta-batch layouts agree."
        )

    _host.check(flat[-2:].clone(), verdict)
    return flat[:-2].to(values.device)


def _int_sum(ints: Tensor, group: Group) -> Tensor:
    # An integer SUM is exact in any order; launch_sum moves it (untagged: int64).
    if group_size(group) == 1:
        return ints
    return launch_sum([ints], group, phase=Phase.FORWARD).wait()[0]


def fixed_sum(tensors: Sequence[Tensor], group: Group) -> list[Tensor]:
    """For each ``x: [T, m, *s]``, the sum over dimension 1 and over ``group``: ``[T, *s]``.

    Every tensor has the same ``T`` and ``m``. Bit-identical for any split of the summands
    over ranks and any order; at most :data:`SUMMANDS` summands per entry over all ranks.
    Not differentiable (see :func:`gather`). Two collectives whatever the number of tensors
    (none on one rank, where the conversion still runs, so one process gives the same bits
    as several). A fixed number of operations on one buffer holding every tensor.
    """
    tensors = list(tensors)
    if not tensors:
        return []
    rows, width = tensors[0].shape[:2]
    if any(t.shape[:2] != (rows, width) for t in tensors):
        raise ValueError("fixed_sum: every tensor must have the same two leading dimensions")
    sizes = [math.prod(t.shape[2:]) for t in tensors]
    device = tensors[0].device
    flat = torch.cat(
        [t.detach().reshape(rows, width, n) for t, n in zip(tensors, sizes, strict=True)], 2
    )
    seg = _segments(tuple(sizes), device)  # which tensor each column belongs to
    # One scale per output row and tensor: M = max |x| over its summands on every rank.
    col = flat.abs().amax(1) if width else flat.new_zeros(rows, flat.shape[2])
    col = col.double()
    local = col.new_zeros(rows, len(sizes)).scatter_reduce_(
        1, seg.expand(rows, -1), col, "amax", include_self=True
    )
    # NaN would be lost by MAX on some backends: carry "not finite" as +inf.
    local = torch.nan_to_num(local, nan=math.inf, posinf=math.inf)
    m = _agree_max(local.reshape(-1), group).view(rows, len(sizes))
    finite = torch.isfinite(m)
    _, e = torch.frexp(torch.where(finite, m, torch.zeros_like(m)))  # m < 2**e
    # Every summand of a (row, tensor) is scaled by 2**k; the way back multiplies by 2**-k,
    # NaN where a summand was not finite. Powers of two: exact in float64.
    k = (_BITS - _HEADROOM) - e.to(torch.float64)
    down = torch.where(finite, torch.exp2(-k), torch.full_like(k, math.nan))
    down = down.index_select(1, seg[0])
    # The conversion truncates toward zero: one rounding, the same whatever the order. A
    # non-finite summand gives garbage integers here, which ``down`` turns into NaN.
    ints = _scaled(flat, k, seg[0]).to(torch.int64).sum(1)
    total = _int_sum(ints.reshape(-1), group).view(rows, -1)
    value = total.double().mul_(down)
    parts = value.split(sizes, dim=1)
    return [p.reshape(rows, *t.shape[2:]).to(t.dtype) for p, t in zip(parts, tensors, strict=True)]


def _scaled(flat: Tensor, k: Tensor, seg: Tensor) -> Tensor:
    """``flat * 2**k`` (``k`` per row and tensor, ``seg`` the tensor of each column), exact.

    float32 (and half-precision) summands are scaled in float32, by two powers of two that
    each stay in its range (``|k| <= 190`` for any float32 row maximum): exact, as scaling by
    a power of two is, and 10x faster on the CPU than converting the buffer to float64 first
    (measured). Other dtypes are scaled in float64.
    """
    columns = lambda t: t.index_select(1, seg).unsqueeze(1)  # noqa: E731
    if flat.dtype in (torch.float32, torch.bfloat16, torch.float16):
        half = torch.floor(k / 2)
        first, second = torch.exp2(half).float(), torch.exp2(k - half).float()
        return flat.float().mul(columns(first)).mul_(columns(second))
    return flat.double().mul_(columns(torch.exp2(k)))


_segment_cache: dict[tuple, Tensor] = {}


def _segments(sizes: tuple[int, ...], device: torch.device) -> Tensor:
    """``[1, sum(sizes)]``: the index of the tensor each column comes from (made on the
    device, cached: no host-to-device copy in a step)."""
    key = (sizes, device)
    if key not in _segment_cache:
        _segment_cache[key] = torch.cat(
            [torch.full((n,), i, dtype=torch.int64, device=device) for i, n in enumerate(sizes)]
        ).unsqueeze(0)
    return _segment_cache[key]


class _Gather(torch.autograd.Function):
    """``[T, m, *s] -> [T, *s]``: :func:`fixed_sum`; its adjoint is :class:`_Spread`."""

    @staticmethod
    def forward(group, *tensors):
        return tuple(fixed_sum(tensors, group))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[0]
        ctx.widths = [t.shape[1] for t in inputs[1:]]

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_Spread.apply(ctx.group, ctx.widths, *grads))


class _Spread(torch.autograd.Function):
    """``[T, *s] -> [T, m, *s]``: ``m`` copies of a value every rank holds alike; its adjoint
    is :class:`_Gather` (the sum of every copy's adjoint, on every rank)."""

    @staticmethod
    def forward(group, widths, *tensors):
        return tuple(
            t.unsqueeze(1).expand(t.shape[0], m, *t.shape[1:]).contiguous()
            for t, m in zip(tensors, widths, strict=True)
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_Gather.apply(ctx.group, *grads))


def gather(tensors: Sequence[Tensor], group: Group) -> list[Tensor]:
    """Differentiable :func:`fixed_sum` (``[T, m, *s] -> [T, *s]``); backward: copies."""
    return list(_Gather.apply(group, *tensors))


def spread(tensors: Sequence[Tensor], widths: Sequence[int], group: Group) -> list[Tensor]:
    """Differentiable copies (``[T, *s] -> [T, m, *s]``, ``m`` from ``widths``) of values every
    rank of ``group`` holds alike; backward: :func:`fixed_sum` of the copies' adjoints."""
    return list(_Spread.apply(group, list(widths), *tensors))
