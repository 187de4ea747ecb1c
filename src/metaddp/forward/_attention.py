"""Exact scaled-dot-product attention, differentiable to any order in memory linear in T.

torch's fused attention kernels have no double backward, so second-order meta-learning
through a transformer needs the math path, whose graph saves the [..., T, T] attention
probabilities (and more at second order): memory quadratic in the sequence length T.

:func:`attention` is built on one autograd function, :class:`_Chunked`, which maps a
per-chunk function over blocks of query rows. A :class:`_Plan` says what the function is
(``fn(rows, *chunk_inputs) -> outputs``), which inputs are cut along the row dimension (-2)
and which are passed whole, and which outputs are rows (concatenated over the chunks) and which
are whole (summed over the chunks). The forward runs ``fn`` one chunk at a time without a graph
and saves only its inputs.

Its backward is the same function applied to another plan, :func:`_vjp_plan`: per chunk,
rebuild ``fn``'s graph and pull the chunk's output gradients through it
(``torch.autograd.grad``). Row inputs get row gradients, whole inputs the sum of the chunks'
gradients; the incoming gradients of row outputs are cut like rows, those of whole outputs
passed whole. Under ``create_graph=True`` that backward is recorded as one more
:class:`_Chunked` node, which again saves only its inputs (the inputs and the incoming
gradients); its own backward is the plan's vector-Jacobian product once more, which rebuilds
the chunk's vector-Jacobian product with its graph (``create_graph`` whenever the caller
records one). So every order composes: each level saves tensors the size of the inputs and
recomputes the attention probabilities of one chunk at a time. The result is exact whatever
the chunk size: rows of attention are independent, and the gradients of whole inputs are sums
over rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ChunkFn = Callable[..., Sequence[Tensor]]
"""``fn(rows, *chunk_inputs) -> outputs``: ``rows`` is the chunk's ``slice`` of query rows."""

DropoutKeep = Callable[[slice], Tensor]
"""``keep(rows)``: the dropout multiplier (0 or 1 / (1 - p)) of the query ``rows``,
broadcastable to [..., rows, S]; a pure function of ``rows``."""

_BLOCK = 2**19
"""Elements of one chunk's [..., chunk, S] block of attention scores, by default."""


@dataclass(frozen=True)
class _Plan:
    """A function mapped over chunks of ``rows`` query rows, ``chunk`` at a time."""

    fn: ChunkFn
    sliced_in: tuple[bool, ...]  # per input: cut along dim -2 (else passed whole)
    sliced_out: tuple[bool, ...]  # per output: rows, concatenated (else whole, summed)
    rows: int
    chunk: int


def _run(plan: _Plan, inputs: Sequence[Tensor | None]) -> tuple[Tensor, ...]:
    """``plan.fn`` over every chunk (no graph), its outputs joined."""
    rows, chunk = plan.rows, plan.chunk
    starts = range(0, rows, chunk) if rows else range(1)
    outs: list[Tensor] = []
    for start in starts:
        r = slice(start, min(start + chunk, rows))
        xs = [
            x[..., r, :] if s and x is not None else x
            for x, s in zip(inputs, plan.sliced_in, strict=True)
        ]
        ys = plan.fn(r, *xs)
        if len(starts) == 1:
            outs = list(ys)
            break
        if not outs:  # the first chunk: room for the rows of every chunk
            outs = [
                y.new_empty((*y.shape[:-2], rows, y.shape[-1])) if s else y
                for y, s in zip(ys, plan.sliced_out, strict=True)
            ]
        for i, (y, s) in enumerate(zip(ys, plan.sliced_out, strict=True)):
            if s:
                outs[i][..., r, :] = y
            elif start:
                outs[i] = outs[i] + y
    # An output that shares memory with an input (a gradient passed through) is copied.
    held = {x.untyped_storage().data_ptr() for x in inputs if x is not None}
    return tuple(y.clone() if y.untyped_storage().data_ptr() in held else y for y in outs)


class _Chunked(torch.autograd.Function):
    """``plan.fn`` mapped over chunks of query rows; saves only its inputs, and its backward
    is another :class:`_Chunked` (:func:`_vjp_plan`)."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, *inputs: Tensor | None) -> tuple[Tensor, ...]:
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs)
        return _run(plan, [None if x is None else x.detach() for x in inputs])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        plan: _Plan = ctx.plan
        inputs = ctx.saved_tensors
        need = tuple(i for i, n in enumerate(ctx.needs_input_grad[1:]) if n)
        have = tuple(j for j, g in enumerate(grads) if g is not None)
        result: list[Tensor | None] = [None] * len(inputs)
        if need and have:
            got = _Chunked.apply(_vjp_plan(plan, need, have), *inputs, *(grads[j] for j in have))
            for i, g in zip(need, got, strict=True):
                result[i] = g
        return (None, *result)


def _vjp_plan(plan: _Plan, need: tuple[int, ...], have: tuple[int, ...]) -> _Plan:
    """The plan of ``plan``'s vector-Jacobian product: inputs ``(*inputs, *grads)`` (the
    gradients of the outputs ``have``), outputs the gradients of the inputs ``need``."""
    n = len(plan.sliced_in)

    def fn(rows: slice, *args: Tensor | None) -> tuple[Tensor, ...]:
        # Recorded (create_graph) when an enclosing level differentiates this one.
        outer = torch.is_grad_enabled()
        xs, gs = list(args[:n]), args[n:]
        with torch.enable_grad():
            leaves: list[Tensor] = []
            for i in need:
                x = xs[i]
                assert x is not None
                # An enclosing level's leaf stays itself, so that this level's gradients are
                # functions of it; else a fresh leaf (every input its own: q may be k).
                x = x if x.requires_grad else x.detach().requires_grad_()
                xs[i] = x
                leaves.append(x)
            ys = plan.fn(rows, *xs)
            pairs = [(ys[j], g) for j, g in zip(have, gs, strict=True) if ys[j].requires_grad]
            if not pairs:
                return tuple(torch.zeros_like(x) for x in leaves)
            return torch.autograd.grad(
                [y for y, _ in pairs],
                leaves,
                [g for _, g in pairs],
                create_graph=outer,
                allow_unused=True,
                materialize_grads=True,
            )

    return _Plan(
        fn,
        sliced_in=plan.sliced_in + tuple(plan.sliced_out[j] for j in have),
        sliced_out=tuple(plan.sliced_in[i] for i in need),
        rows=plan.rows,
        chunk=plan.chunk,
    )


def _attend(
    scale: float, causal: bool, keep: DropoutKeep | None, groups: int, s_len: int
) -> ChunkFn:
    """One chunk of attention: ``fn(rows, q, k, v, mask) -> (out,)``."""

    def fn(rows: slice, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, ...]:
        if groups > 1:
            k = k.repeat_interleave(groups, -3)
            v = v.repeat_interleave(groups, -3)
        s = (q * scale) @ k.transpose(-2, -1)
        if causal:
            n = rows.stop - rows.start
            allowed = torch.ones(n, s_len, dtype=torch.bool, device=s.device)
            s = s.masked_fill(~allowed.tril(rows.start), -math.inf)
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
        # torch.softmax subtracts each row's maximum (stable) and has exact derivatives of every
        # order that keep only its output, where exponentials and a division of our own would
        # keep more [rows, S] blocks. A row masked entirely (maximum -inf) gives zeros, as torch's
        # math path (its ``_safe_softmax``) does: softmax of zeros there, then a zero output row.
        dead = s.detach().amax(-1, keepdim=True) == -math.inf if mask is not None else None
        p = torch.softmax(s if dead is None else s.masked_fill(dead, 0.0), -1)
        if keep is not None:
            p = p * keep(rows)
        out = p @ v
        return (out if dead is None else out.masked_fill(dead, 0.0),)

    return fn


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    dropout_keep: DropoutKeep | None = None,
    chunk: int | None = None,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, differentiable to any order.

    Every order of derivative saves tensors the size of the inputs only, recomputing the
    attention probabilities ``chunk`` query rows at a time (default: a [..., chunk, S] block of
    about 2**22 elements, all rows when that is fewer). Shapes, masks (boolean: True takes
    part; float: added), ``is_causal`` (top-left aligned), ``scale`` (default 1 / sqrt(E)) and
    ``enable_gqa`` are torch's; a row that takes part nowhere gives zeros, as torch's math path.

    Dropout draws no random numbers: when ``dropout_p > 0`` the probabilities are multiplied by
    ``dropout_keep(rows)`` (0 or 1 / (1 - p) per entry, broadcastable to [..., rows, S]), a pure
    function of the query rows, since every backward calls it again. With ``dropout_p == 0`` it
    is not used.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and dropout_keep is None:
        raise ValueError("dropout_p > 0 needs dropout_keep (this kernel draws no random numbers)")
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask must be None when is_causal=True (as torch's)")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    rows, s_len = query.size(-2), key.size(-2)
    groups = 1
    if enable_gqa and query.dim() >= 3 and key.size(-3) != query.size(-3):
        if query.size(-3) % key.size(-3) or value.size(-3) != key.size(-3):
            raise ValueError("enable_gqa: query heads must be a multiple of key and value heads")
        groups = query.size(-3) // key.size(-3)
    if chunk is None:
        per_row = max(math.prod(query.shape[:-2]), math.prod(key.shape[:-2]) * groups) * s_len
        chunk = max(1, _BLOCK // max(per_row, 1))
    chunk = min(chunk, max(rows, 1))
    mask_rows = attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.size(-2) == rows > 1
    plan = _Plan(
        _attend(
            query.size(-1) ** -0.5 if scale is None else scale,
            is_causal,
            dropout_keep if dropout_p > 0 else None,
            groups,
            s_len,
        ),
        sliced_in=(True, False, False, mask_rows),
        sliced_out=(True,),
        rows=rows,
        chunk=chunk,
    )
    (out,) = _Chunked.apply(plan, query, key, value, attn_mask)
    return out
