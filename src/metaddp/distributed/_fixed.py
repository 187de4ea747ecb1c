"""Sums whose bits do not depend on how the summands are split: fixed point.

A floating-point sum depends on the order of its additions, so a gradient summed over 3
samples on one rank and 2 on another differs in its last bits from the same gradient summed
over 5 on one rank. Here every summand is first rounded to a multiple of one power of two
``u`` agreed by all ranks, small enough that every partial sum is an integer multiple of
``u`` below ``2**53 * u``. Such sums are exact in float64, so the local sum and one SUM
all-reduce give the same bits for any split of the summands over ranks and any order of the
additions. The total is rounded to the summands' dtype once.

The scale: for each output entry, ``M`` is the largest ``|x|`` of its summands on any rank
(one MAX all-reduce of its exponent: one byte per entry for float32 summands), ``2**e > M``,
and ``u = 2**(e + h - 53)``, where ``2**h``
(:data:`SUMMANDS`) bounds the number of summands, so that no sum can leave float64's exact
integers. The bound is a constant, not the actual count, because the scale must not depend
on how many summands a rank holds. A summand ``x`` is rounded by ``(x + c) - c`` with
``c = 1.5 * 2**(e + h - 1)``: ``x + c`` lies in the binade of ``c``, whose spacing is ``u``,
so the addition rounds ``x`` to a multiple of ``u`` and the subtraction is exact. Each summand
moves by at most ``u / 2``, at most ``2**-33`` of ``M`` (1.2e-10): far below float32's
rounding, so a float32 result is as accurate as a float32 sum or more. float64 summands are
summed in two such parts (the rounded value and its remainder, on a grid ``2**-33`` finer):
each moves by at most ``2**-66`` of ``M``. A non-finite summand makes its entry non-finite.

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

_MANTISSA = 53  # float64's significand: every integer below 2**53 is exact
_HEADROOM = 20
SUMMANDS = 2**_HEADROOM  # the most summands one output entry may have, over all ranks
_HALF = 1 << 51  # a float64's top significand bit: 1.5 instead of 1
# c's bits for a float32 exponent of 0, to which the exponent moved into place is added.
_F32_C_BITS = ((1023 - 127 + _HEADROOM) << 52) | _HALF
# The header kind of strict mode's check for the MAX (after the Phase values of the SUMs).
_MAX_KIND = 10


def _agree_max(values: Tensor, group: Group) -> Tensor:
    """Elementwise MAX over ``group`` of a 1-d float or ``uint8`` tensor, with an out-of-step
    tag made from this rank's call sequence on the group (shared with every other collective).

    The tag travels as ``[t, -t]`` (or, in ``uint8``, its two bytes and their complements to
    255): the MAX gives the largest and the smallest tag, equal where the ranks agree.
    """
    if group_size(group) == 1:
        return values
    tag = 1 + _next_sequence(group) % _TAG_MODULUS
    small = values.dtype == torch.uint8
    digits = [tag >> 8, tag & 255] if small else [tag]
    top = 255 if small else 0
    tail = digits + [top - d for d in digits]  # exact in uint8 and in any float
    device = comm_device(group)
    flat = torch.cat([values, _host.upload(tail, values)]).to(device)
    if strict():
        _check_header(group, tag, flat.numel(), _MAX_KIND, "fixed-point scale", device)
    _record(flat.numel(), flat.numel() * flat.element_size())
    _guard(lambda: dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group), "fixed-point scale")
    rank, n = group_rank(group), len(digits)

    def verdict(got: list[float]) -> Exception | None:
        hi, lo = got[:n], [top - g for g in got[n:]]
        if hi == lo:
            return None
        number = lambda ds: ds[0] * 256 + ds[1] if small else ds[0]  # noqa: E731
        return CollectiveError(
            f"ranks are out of step at a deterministic sum on rank {rank}: its call tags range "
            f"within {number(lo):g}..{number(hi):g} across ranks. Every rank must run the same "
            "sums in the same order: check that inner-step counts, algorithms and meta-batch "
            "layouts agree."
        )

    _host.check(flat[-2 * n :].clone(), verdict)
    return flat[: -2 * n].to(values.device)


def _exact_sum(values: Tensor, group: Group) -> Tensor:
    # Every partial sum of these float64 multiples of u is exact, so the SUM is the same in
    # any order (launch_sum moves it, tagged as every float sum is).
    if group_size(group) == 1:
        return values
    return launch_sum([values], group, phase=Phase.FORWARD).wait()[0]


def fixed_sum(tensors: Sequence[Tensor], group: Group) -> list[Tensor]:
    """For each ``x: [T, m, *s]``, the sum over dimension 1 and over ``group``: ``[T, *s]``.

    Every tensor has the same ``T``, ``m`` and dtype. Bit-identical for any split of the
    summands over ranks and any order; at most :data:`SUMMANDS` summands per entry over all
    ranks. Not differentiable (see :func:`gather`). Two collectives whatever the number of
    tensors (none on one rank, where the rounding still runs, so one process gives the same
    bits as several). A dozen operations on one buffer holding every tensor, none of them
    mixing dtypes (on the CPU a mixed-dtype elementwise operation is many times slower than
    a cast followed by the same-dtype one, measured).
    """
    tensors = list(tensors)
    if not tensors:
        return []
    rows, width = tensors[0].shape[:2]
    dtype = tensors[0].dtype
    if any(t.shape[:2] != (rows, width) or t.dtype != dtype for t in tensors):
        raise ValueError(
            "fixed_sum: every tensor must have the same dtype and two leading dimensions"
        )
    sizes = [math.prod(t.shape[2:]) for t in tensors]
    flat = torch.cat(
        [t.detach().reshape(rows, width, n) for t, n in zip(tensors, sizes, strict=True)], 2
    )
    wide = flat.double()  # a copy, or ``flat`` itself (the concatenation's own buffer)
    # M per output entry: the largest |x| of its summands on any rank, as 2**(E - bias) <= M,
    # E its biased exponent (a NaN or infinite summand gives the largest E, which MAX keeps).
    # c = 1.5 * 2**(e + h - 1) with 2**(e - 1) <= M < 2**e, written as float64 bits: the
    # exponent field is E moved to float64's bias, plus h; the significand's top bit is the
    # 0.5 of 1.5. Its binade's spacing is u = 2**(e + h - 53). For float32 summands, M = 0
    # or subnormal gives a grid finer than any float32: no rounding, and their float64 sums
    # are exact anyway. (float64's second, finer grid keeps what the first rounds off.)
    if width:  # the largest and the smallest read in place: no |x| buffer
        big = torch.maximum(flat.amax(1), flat.amin(1).neg_())
    else:
        big = flat.new_zeros(rows, flat.shape[2])
    if dtype == torch.float64:
        # The field alone (a zero or NaN maximum may carry a sign): 0..2047, agreed in
        # float32 (exact).
        biased = (big.view(torch.int64) >> 52) & 2047
        if group_size(group) > 1:
            biased = _agree_max(biased.float().reshape(-1), group).view(rows, -1).long()
        # A non-finite M, or one of 2**1004 or more (beyond float64's range once moved),
        # gives the exponent field of all ones: c is NaN, and so is the entry.
        field = (biased + _HEADROOM).clamp_(max=2047)
        bits = (field << 52) | _HALF
    else:
        # One byte per entry: the float32 exponent (0..255) of M. A non-finite M gives a
        # finite c; its infinite or NaN summand stays so through the rounding.
        biased = (big.float().view(torch.int32) >> 23) & 255
        if group_size(group) > 1:
            biased = _agree_max(biased.to(torch.uint8).reshape(-1), group).view(rows, -1)
        bits = (biased.long() << 52) + _F32_C_BITS
    c = bits.view(torch.float64).unsqueeze(1)
    # Round every summand to a multiple of u: one rounding each, the same whatever the
    # order; every sum after it is exact.
    # (In place, where ``wide`` is a copy; float64 keeps ``flat`` for its remainder.)
    high = (wide.add(c) if wide is flat else wide.add_(c)).sub_(c)
    sums = [high.sum(1)]
    if dtype == torch.float64:
        # float64 summands keep more bits than u: the remainder (exact, at most u / 2) is
        # rounded and summed again on a grid 2**(_MANTISSA - _HEADROOM) times finer.
        low = wide.sub_(high)
        c = c.mul_(2.0 ** (_HEADROOM - _MANTISSA))
        sums.append(low.add_(c).sub_(c).sum(1))
    both = torch.cat(sums, 1) if len(sums) > 1 else sums[0]
    total = _exact_sum(both.reshape(-1), group).view(rows, len(sums), -1)
    value = total[:, 0] if len(sums) == 1 else total[:, 0] + total[:, 1]
    parts = value.to(dtype).split(sizes, dim=1)
    return [p.reshape(rows, *t.shape[2:]) for p, t in zip(parts, tensors, strict=True)]


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
