"""Meta-parameters sharded over the sample axis (ZeRO-3), gathered for compute by a
differentiable all-gather whose adjoint is a reduce-scatter SUM.

[Note: why the gradient of a shard is complete]
Rank ``s`` of a sample group of ``S`` holds rows ``[s*c, (s+1)*c)`` of every sharded tensor
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
inner gradient of its own samples (issue: 0.56 off the one-process meta-gradient).

Inner optimizers are elementwise, so they run on the shards as they are; the meta-gradient
ends as shards; the outer optimizer's state is allocated like its parameters: 1/S each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _host
from .._binding import SHARDED
from ._collectives import (
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
    group_size,
    strict,
)
from ._regather import Regather
from ._units import LayerGather

_TAG_MODULUS = 4093  # as _collectives: world * tag stays exact in float32
DEFAULT_UNIT_BYTES = 2**20


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

    def take(self, full: Tensor) -> Tensor:
        """This rank's rows of ``full`` (a copy)."""
        rows = full.reshape(self.rows, self.width)[self.start : self.start + self.length]
        return rows.reshape(self.local_shape).clone()


def _tag(group: Group, numel: int, phase: Phase) -> tuple[int, float]:
    seq = _next_sequence(group)
    return seq, float(1 + (seq * 31 + numel + int(phase) * 1021) % _TAG_MODULUS)


def _out_of_step(what: str, seq: int, numel: int, rank: int) -> CollectiveError:
    return CollectiveError(
        f"ranks are out of step at {_describe(what, seq, numel)} on rank {rank}: another rank "
        "was at a different collective (the sequence tags disagree). Every rank of a sample "
        "group must run the same forwards and inner steps in the same order"
    )


def _gather(shards: Sequence[Tensor], cuts: Sequence[Cut], group: Group, phase: Phase):
    """Every rank's pieces, concatenated into the full tensors (one all-gather)."""
    world = len(cuts) and cuts[0].parts
    like = shards[0]
    parts: list[Tensor] = []
    for t, cut in zip(shards, cuts, strict=True):
        flat = t.detach().reshape(-1)
        parts.append(flat)
        if cut.piece > flat.numel():
            parts.append(flat.new_zeros(cut.piece - flat.numel()))
    numel = sum(c.piece for c in cuts)
    seq, tag = _tag(group, numel, phase)
    tagged = like.dtype in (torch.float32, torch.float64)
    if tagged:
        parts.append(like.new_full((1,), tag))
    device = comm_device(group)
    send = torch.cat(parts).to(device)
    recv = send.new_empty(world * send.numel())
    what = "the all-gather of sharded weights" + (
        " (in a backward pass)" if phase == Phase.BACKWARD else ""
    )
    if strict():
        _check_header(group, seq, numel, 8 + int(phase), what, device)
    _record(recv.numel(), recv.numel() * recv.element_size(), "all_gather")
    _guard(lambda: dist.all_gather_single(recv, send, group=group), what)
    table = recv.view(world, send.numel()).to(like.device)
    if tagged:
        rank = group_rank(group)

        def verdict(got: list[float]) -> Exception | None:
            return None if all(g == tag for g in got) else _out_of_step(what, seq, numel, rank)

        _host.check(table[:, -1].clone(), verdict)
    out, offset = [], 0
    for cut in cuts:
        block = table[:, offset : offset + cut.piece].reshape(world * cut.per, cut.width)
        out.append(block[: cut.rows].reshape(cut.shape).clone())
        offset += cut.piece
    return out


def _scatter_sum(fulls: Sequence[Tensor], cuts: Sequence[Cut], group: Group, phase: Phase):
    """Each rank's rows of the SUM over ranks of the full tensors (one reduce-scatter)."""
    world = cuts[0].parts
    like = fulls[0]
    numel = sum(c.piece for c in cuts)
    seq, tag = _tag(group, numel, phase)
    tagged = like.dtype in (torch.float32, torch.float64)
    # One buffer, each tensor copied into its columns once (padding rows zero): a gradient
    # the size of the layer is the largest thing here, and it is not copied twice.
    table = like.new_zeros(world, numel + int(tagged))
    offset = 0
    for g, cut in zip(fulls, cuts, strict=True):
        block = table[:, offset : offset + cut.piece].view(world, cut.per, cut.width)
        rows = g.detach().reshape(cut.rows, cut.width)
        if not cut.per:  # a tensor without rows
            continue
        whole = cut.rows // cut.per  # ranks with a full piece; the next one's is shorter
        block[:whole].copy_(rows[: whole * cut.per].view(whole, cut.per, cut.width))
        if whole < world and cut.rows > whole * cut.per:
            block[whole, : cut.rows - whole * cut.per].copy_(rows[whole * cut.per :])
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
    _guard(lambda: dist.reduce_scatter_single(recv, send, group=group), what)
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


_ADJOINT = {Phase.FORWARD: Phase.BACKWARD, Phase.BACKWARD: Phase.FORWARD}


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(cuts, group, phase, *shards):
        return tuple(_gather(shards, cuts, group, phase))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.cuts, ctx.group, ctx.phase = inputs[:3]

    @staticmethod
    def backward(ctx, *grads):
        # The adjoint of the all-gather: each rank's rows of the SUM of every rank's
        # cotangent (the Note above). A Function, so it stays on the graph.
        return (
            None,
            None,
            None,
            *_ScatterSum.apply(ctx.cuts, ctx.group, _ADJOINT[ctx.phase], *grads),
        )


class _ScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(cuts, group, phase, *fulls):
        return tuple(_scatter_sum(fulls, cuts, group, phase))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.cuts, ctx.group, ctx.phase = inputs[:3]

    @staticmethod
    def backward(ctx, *grads):
        # The adjoint of the reduce-scatter SUM: every rank receives every rank's rows.
        return (None, None, None, *_Gather.apply(ctx.cuts, ctx.group, _ADJOINT[ctx.phase], *grads))


def gather(shards: Sequence[Tensor], cuts: Sequence[Cut], group: Group) -> list[Tensor]:
    """The full tensors from every rank's shards: differentiable to any order, with a
    reduce-scatter SUM as the adjoint. One collective per dtype and device."""
    shards = list(shards)
    if not shards:
        return []
    if cuts[0].parts == 1:
        return [s.reshape(c.shape) for s, c in zip(shards, cuts, strict=True)]
    out: list[Tensor | None] = [None] * len(shards)
    for idx in _by_kind(shards):
        got = _Gather.apply(
            tuple(cuts[i] for i in idx), group, Phase.FORWARD, *(shards[i] for i in idx)
        )
        for i, t in zip(idx, got, strict=True):
            out[i] = t
    return out  # type: ignore[return-value]


def scatter_sum(fulls: Sequence[Tensor], cuts: Sequence[Cut], group: Group) -> list[Tensor]:
    """Each rank's rows of the SUM over ranks: differentiable to any order, with the
    all-gather as the adjoint."""
    fulls = list(fulls)
    if not fulls:
        return []
    if cuts[0].parts == 1:
        return [f.reshape(c.local_shape) for f, c in zip(fulls, cuts, strict=True)]
    out: list[Tensor | None] = [None] * len(fulls)
    for idx in _by_kind(fulls):
        got = _ScatterSum.apply(
            tuple(cuts[i] for i in idx), group, Phase.FORWARD, *(fulls[i] for i in idx)
        )
        for i, t in zip(idx, got, strict=True):
            out[i] = t
    return out  # type: ignore[return-value]


def _attr(module: nn.Module, name: str) -> Tensor:
    """The tensor at ``name`` as the module holds it now (inside ``functional_call``: the
    swapped-in one, not a parameter)."""
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf)


def _agree(flag: bool, group: Group) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (one tiny MIN all-reduce)."""
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _by_kind(tensors: Sequence[Tensor]) -> list[list[int]]:
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.dtype, t.device), []).append(i)
    return list(kinds.values())


class Sharding:
    """The trained parameters of one model, each cut over a sample group, and how to gather
    them for a forward.

    Held by the model in its ``metaddp_sharded`` attribute while a :class:`metaddp.MetaDDP`
    with ``shard=True`` wraps it; :func:`metaddp.call` asks it for the full weights of every
    forward. Shard-shaped tensors (the parameters themselves, fast weights made from them)
    are gathered; full-shaped ones pass as they are.
    """

    def __init__(
        self, model: nn.Module, group: Group, *, unit_bytes: int = DEFAULT_UNIT_BYTES
    ) -> None:
        self.group = group
        # Layers smaller than this are gathered together at the forward's start and kept
        # whole in graphs: for them a collective costs more than the memory it saves.
        self.unit_bytes = unit_bytes
        parts, index = group_size(group), group_rank(group)
        # A 0-d parameter (a scalar) has no rows to cut: it stays whole on every rank.
        self.cuts: dict[str, Cut] = {
            name: Cut(p.shape, parts, index)
            for name, p in model.named_parameters()
            if p.requires_grad and p.dim() > 0
        }
        self.parts = parts
        self._model = weakref.ref(model)
        self._full = False  # inside gathered(): the module holds its full weights
        # Saved gathered weights kept in graphs as their shards (None: kept whole).
        self.regather: Regather | None = Regather(self._gather_one)
        # Each layer's weights gathered as it runs (._units), the small ones together.
        self.layers = (
            LayerGather(
                model,
                {n: c.local_shape for n, c in self.cuts.items()},
                self._gather_named,
                {
                    n: math.prod(c.shape) * model.get_parameter(n).element_size()
                    for n, c in self.cuts.items()
                },
                unit_bytes,
            )
            if parts > 1
            else None
        )
        self._armed = False  # metaddp.call is about to run the model
        self._hooks = [
            model.register_forward_pre_hook(self._enter, prepend=True),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    # --- the module's own parameters ----------------------------------------------------

    def cut(self) -> None:
        """Keep only this rank's rows of every sharded parameter (its ``.data``, so the
        parameter objects, and an optimizer built on them, stay the same)."""
        model = self._model()
        assert model is not None
        with torch.no_grad():
            for name, cut in self.cuts.items():
                p = model.get_parameter(name)
                p.data = cut.take(p.data)

    def parameters(self) -> dict[str, nn.Parameter]:
        model = self._model()
        assert model is not None
        return {name: model.get_parameter(name) for name in self.cuts}

    def full(self) -> dict[str, Tensor]:
        """Every sharded parameter's full value (one all-gather; detached)."""
        params = self.parameters()
        with torch.no_grad():
            got = gather(
                [params[n].detach() for n in self.cuts], list(self.cuts.values()), self.group
            )
        return dict(zip(self.cuts, got, strict=True))

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """The full weights in the module for the block (on every rank of the sample group:
        it is a collective), this rank's rows again after it, with the block's changes
        kept."""
        if self._full:
            yield
            return
        if self.regather is not None:  # nothing may hold the parameters at their rows' shape
            self.regather.sweep()
        params, full = self.parameters(), self.full()
        # Gradients too, where every rank has one (the meta-gradient after sync_grads).
        names = [n for n, p in params.items() if p.grad is not None]
        if not _agree(len(names) == len(params), self.group):
            names = []
        cuts = [self.cuts[n] for n in names]
        with torch.no_grad():
            grads = gather([params[n].grad for n in names], cuts, self.group)  # type: ignore[misc]
            for name, p in params.items():
                p.data = full[name]
            for name, g in zip(names, grads, strict=True):
                params[name].grad = g
        self._full = True
        try:
            yield
        finally:
            self._full = False
            with torch.no_grad():
                for name, p in params.items():
                    p.data = self.cuts[name].take(p.data)
                    if p.grad is not None and p.grad.shape == self.cuts[name].shape:
                        p.grad = self.cuts[name].take(p.grad)

    def remove(self) -> None:
        """Give the module its full weights back (a collective) and forget it."""
        model = self._model()
        for h in self._hooks:
            h.remove()
        if self.layers is not None:
            self.layers.remove()
        if model is None:
            return
        full = self.full()
        with torch.no_grad():
            for name, p in self.parameters().items():
                p.data = full[name]
        if getattr(model, SHARDED, None) is self:
            delattr(model, SHARDED)

    # --- forwards -----------------------------------------------------------------------

    def __call__(self, module: nn.Module, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``weights`` with every sharded name full: missing names from the module's own
        parameters, shard-shaped ones gathered (one collective), full ones as they are."""
        out = dict(weights)
        if self._full or self.parts == 1:
            return out
        self._armed = True
        if self.layers is not None and self.layers.readers is not None:
            # Each layer gathers its own as it runs; the model's own shards go through
            # functional_call too, which puts them back whatever the forward does.
            for name in self.cuts:
                if name not in out:
                    out[name] = module.get_parameter(name)
            return out
        names, shards = [], []
        for name, cut in self.cuts.items():
            t = out.get(name)
            if t is None:
                t = module.get_parameter(name)
            if t.shape != cut.local_shape:  # full already (a gathered or given tensor)
                out[name] = t
                continue
            names.append(name)
            shards.append(t)
        cuts = [self.cuts[n] for n in names]
        for name, shard, cut, t in zip(
            names, shards, cuts, gather(shards, cuts, self.group), strict=True
        ):
            out[name] = t
            self._keep_rows(t, shard, cut)
        return out

    def _keep_rows(self, full: Tensor, shard: Tensor, cut: Cut) -> None:
        """Graphs keep ``full`` as its rows, if it is large enough to be worth a gather."""
        if self.regather is not None and full.nbytes >= self.unit_bytes:
            self.regather.register(full, shard, cut)

    def _gather_one(self, shard: Tensor, cut: Cut) -> Tensor:
        return gather([shard], [cut], self.group)[0]

    def _gather_named(self, names: list[str], shards: list[Tensor]) -> list[Tensor]:
        cuts = [self.cuts[n] for n in names]
        fulls = gather(shards, cuts, self.group)
        for full, shard, cut in zip(fulls, shards, cuts, strict=True):
            self._keep_rows(full, shard, cut)
        return fulls

    def saving(self) -> contextlib.AbstractContextManager[object]:
        """Inside the block, graphs keep shards in place of gathered weights and gather
        them again for the backward (:mod:`._regather`)."""
        if self.regather is None:
            return contextlib.nullcontext()
        return self.regather.saving()

    def _enter(self, module: nn.Module, args: Any) -> None:
        # A forward that metaddp.call runs is armed; a direct model(x) would run on this
        # rank's rows, and is refused.
        if self._full or self.parts == 1:
            return
        armed, self._armed = self._armed, False
        if armed:
            if self.layers is not None:
                self.layers.start(record=self.layers.readers is None)
            return
        for name, cut in self.cuts.items():
            if _attr(module, name).shape != cut.shape:
                raise RuntimeError(
                    f"the model's parameters are shards of the sample group's ({name!r} holds "
                    f"{cut.length} of its {cut.rows} rows here): run it through the algorithm "
                    "(learner.meta_loss, learner.adapt, algorithm.predict, metaddp.call), or "
                    "gather them on every rank of the group first: `with learner.gathered():`"
                )
            return

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.layers is not None and self.layers.forwarding:
            self.layers.finish()

    def holding_full(self) -> bool:
        """Inside :meth:`gathered`: the module holds its full weights."""
        return self._full

    # --- inner gradients ----------------------------------------------------------------

    def passed(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The gradients of shards as they are (already the global gradient's rows); any
        tensor not shaped like one of this rank's shards is refused: its gradient would be
        this rank's own."""
        shapes = {c.local_shape for c in self.cuts.values()}
        for t in tensors:
            if t.shape not in shapes:
                raise TypeError(
                    f"an inner gradient of shape {tuple(t.shape)} is not one of this rank's "
                    "shards: with shard=True, inner loops differentiate by the model's sharded "
                    "weights (the algorithm's fast weights), whose gradients the gather has "
                    "summed already; a tensor outside them would keep each rank's own gradient"
                )
        return list(tensors)


def refuse_sharded(module: nn.Module, deterministic: bool) -> nn.Module:
    """The model whose parameters ``MetaDDP(module, shard=True)`` shards, or an error that
    says why it cannot: not an algorithm that declares the sharded layout
    (:class:`metaddp.Supports`), configured with what reads whole weights
    (``sharded_refusal``), deterministic mode, or a model already sharded by FSDP2."""
    from .._types import Supports

    name = type(module).__name__
    supports = getattr(module, "supports", None)
    if not isinstance(supports, Supports) or not hasattr(module, "adapted_module"):
        raise TypeError(
            f"shard=True shards the model of a meta-learning algorithm; {name} is not one: "
            "wrap metaddp.MAML(model, ...) or metaddp.Bilevel(model, ...)"
        )
    supports.refuse(name, sharded=True)
    if deterministic:
        raise ValueError(
            "deterministic=True and shard=True do not combine: deterministic mode holds every "
            "weight whole on every rank"
        )
    why = getattr(module, "sharded_refusal")()  # noqa: B009 (a method of Algorithm)
    if why is not None:
        raise ValueError(f"shard=True: {why}")
    model = getattr(module, "adapted_module")()  # noqa: B009
    if not isinstance(model, nn.Module) or model is not getattr(module, "model", model):
        raise ValueError(f"shard=True: {name} adapts part of its model only")
    return model


def refuse_dtensors(model: nn.Module) -> None:
    """Refuse parameters that are DTensors already (FSDP2's ``fully_shard``, or placements
    of the user's): neither their gathers nor their gradients are exact here."""
    from torch.distributed.tensor import DTensor

    for pname, p in model.named_parameters():
        if isinstance(p, DTensor) or isinstance(p.data, DTensor):
            raise TypeError(
                f"the model's parameter {pname!r} is a DTensor (the model was sharded by FSDP2's "
                "fully_shard or by DTensor placements): FSDP2 frees its gathered weights after "
                "each forward and gives no gradient through autograd.grad(create_graph=True), "
                "and DTensor's full_tensor() keeps each rank's own inner gradient. Pass the "
                "unsharded model and build MetaDDP(algorithm, mesh, shard=True): it shards the "
                "meta-parameters itself, with a gather whose adjoint sums over the ranks"
            )
