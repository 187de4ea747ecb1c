"""Meta-parameters sharded over the sample axis (ZeRO-3): the model keeps each rank's rows of
its trained weights (:mod:`._rows`: the cut, and the gather whose adjoint is a reduce-scatter
SUM), and :class:`Sharding` gathers them for every forward that
:func:`metaddp.functional.call` runs, one layer at a time (:mod:`._units`), with graphs that
keep rows (:mod:`._regather`).

Inner optimizers are elementwise, so they run on the shards as they are; the meta-gradient
ends as shards; the outer optimizer's state is allocated like its parameters: 1/S each.

A model sharded by FSDP2's ``fully_shard`` is *adopted* (:func:`fsdp_refusal` says what
cannot be): its parameters stay its DTensors (``Shard(0)``, cut as :class:`._rows.Cut` cuts),
their local rows are the shards the gather reads (``to_local()``, whose adjoint re-wraps the
rows' gradient as a DTensor without communication), FSDP's own forward hooks are set aside
while MetaDDP wraps the model, and the meta-gradient lands in the DTensors' ``.grad``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._binding import set_sharding, sharding_of
from ._collectives import Group, comm_device, group_rank, group_size
from ._regather import Regather
from ._rows import Cut, gather
from ._units import LayerGather

DEFAULT_UNIT_BYTES = 2**20

ROWS = "metaddp_rows"
"""The metadata key of a state_dict that holds one rank's rows: ``(rank, ranks)``."""


def _attr(module: nn.Module, name: str) -> Tensor:
    """The tensor at ``name`` as the module holds it now (inside ``functional_call``: the
    swapped-in one, not a parameter)."""
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf)


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor. None exists until ``torch.distributed.tensor`` has been
    imported (by FSDP2, or the user), and importing it costs about a second per process:
    where nothing did, the answer is no without it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: Tensor) -> Tensor:
    """A DTensor's local rows (differentiable: the adjoint wraps the rows' gradient back as a
    DTensor of the same placements); any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def as_like(rows: Tensor, like: Tensor) -> Tensor:
    """``rows`` as a DTensor placed as ``like`` (a DTensor parameter), or as they are."""
    if not is_dtensor(like):
        return rows
    from torch.distributed.tensor import DTensor

    assert isinstance(like, DTensor)
    return DTensor.from_local(
        rows,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _agree(flag: bool, group: Group) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (one tiny MIN all-reduce)."""
    t = torch.tensor([float(flag)], device=comm_device(group))  # NCCL: on the GPU
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


class Sharding:
    """The trained parameters of one model, each cut over a sample group, and how to gather
    them for a forward.

    Found beside the model (``metaddp._binding.sharding_of``; nothing is written into it)
    while a :class:`metaddp.MetaDDP` with ``shard=True`` wraps it; :func:`metaddp.functional.call`
    asks it for the full weights of every forward. Shard-shaped tensors (the parameters
    themselves, fast weights made from them) are gathered; full-shaped ones pass as they are.
    """

    def __init__(
        self,
        model: nn.Module,
        group: Group,
        *,
        unit_bytes: int = DEFAULT_UNIT_BYTES,
        adopt: bool = False,
    ) -> None:
        # Built where the group has more than one rank (MetaDDP: a sample axis to cut over),
        # or to adopt a model that FSDP2 cut already (``adopt``: its DTensors' rows).
        self.group = group
        self.adopted = adopt
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
        if adopt:
            for name, cut in self.cuts.items():
                held = local(model.get_parameter(name)).shape
                if held != cut.local_shape:  # not torch.chunk's rows of this rank
                    raise ValueError(
                        f"FSDP2 model: {name!r} holds {tuple(held)} here, not rank "
                        f"{cut.index}'s rows {tuple(cut.local_shape)} of {tuple(cut.shape)} "
                        "cut as Shard(0) over MetaDDP's sample group"
                    )
        self._shard_shapes = {c.local_shape for c in self.cuts.values()}
        self._model = weakref.ref(model)
        self._full = False  # inside gathered(): the module holds its full weights
        # Saved gathered weights kept in graphs as their shards (None: kept whole).
        self.regather: Regather | None = Regather(self._gather_one)
        # Each layer's weights gathered as it runs (._units), the small ones together.
        self.layers = LayerGather(
            model,
            {n: c.local_shape for n, c in self.cuts.items()},
            self._gather_named,
            {
                n: math.prod(c.shape) * model.get_parameter(n).element_size()
                for n, c in self.cuts.items()
            },
            unit_bytes,
        )
        self._armed = False  # metaddp.functional.call is about to run the model
        self.loading_rows = False  # MetaDDP.load_sharded_state_dict loads this rank's rows
        # FSDP2's forward hooks gather into its own buffers and free them after the forward:
        # set aside while metaddp gathers (put back by remove()).
        self._set_aside = _set_aside_fsdp_hooks(model) if adopt else []
        self._hooks = [
            model.register_forward_pre_hook(self._enter, prepend=True),
            model.register_forward_hook(self._leave, always_call=True),
        ]
        if not adopt:  # an FSDP2 model's state is its DTensors: whole, whatever the rank
            self._hooks += [
                # (torch marks these hooks with an attribute, which a bound method cannot take)
                model.register_state_dict_post_hook(functools.partial(self._saved)),
                model.register_load_state_dict_pre_hook(functools.partial(self._loading)),
            ]

    # --- the module's own parameters ----------------------------------------------------

    def cut(self) -> None:
        """Keep only this rank's rows of every sharded parameter (its ``.data``, so the
        parameter objects, and an optimizer built on them, stay the same)."""
        model = self._model()
        assert model is not None
        if self.adopted:  # FSDP2 cut them already
            return
        with torch.no_grad():
            for name, cut in self.cuts.items():
                p = model.get_parameter(name)
                p.data = cut.take(p.data)

    def parameters(self) -> dict[str, nn.Parameter]:
        model = self._model()
        assert model is not None
        return {name: model.get_parameter(name) for name in self.cuts}

    def rows(self) -> dict[str, Tensor]:
        """This rank's rows of every sharded parameter: the parameters, or an adopted
        model's DTensors' local rows (differentiable to the DTensors)."""
        return {name: local(p) for name, p in self.parameters().items()}

    def as_rows(self, t: Tensor, like: Tensor) -> Tensor:
        """``t``, shaped as a whole weight, cut to this rank's rows where ``like`` (the
        weight as this rank holds it) is rows: a learned per-entry rate beside a sharded
        weight. The cut is differentiable, so the rate's gradient reaches this rank's rows
        alone, and the SUM over the mesh that every replicated tensor's gradient takes
        completes it. A 0-d ``t``, or one shaped as ``like``, is returned as it is."""
        if t.dim() == 0 or t.shape == like.shape:
            return t
        cut = Cut(t.shape, group_size(self.group), group_rank(self.group))
        if cut.local_shape != like.shape:
            raise ValueError(
                f"a tensor of shape {tuple(t.shape)} read entry by entry beside a weight held "
                f"as {tuple(like.shape)}: it must be shaped as the whole weight"
            )
        return cut.view(t)

    def rows_of(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``params`` with every sharded one as this rank's rows (:func:`local`)."""
        return {k: local(p) if k in self.cuts else p for k, p in params.items()}

    def full(self) -> dict[str, Tensor]:
        """Every sharded parameter's full value (one all-gather; detached)."""
        params = self.rows()
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
        if self.adopted:
            raise RuntimeError(
                "learner.gathered() on a model sharded by FSDP2's fully_shard: its parameters "
                "are DTensors, which stay sharded. Read whole weights with p.full_tensor(), or "
                "save them with torch.distributed.checkpoint (get_model_state_dict)"
            )
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
        self.layers.remove()
        _put_back(self._set_aside)
        self._set_aside = []
        if model is None:
            return
        if self.adopted:  # the DTensors were never replaced
            if sharding_of(model) is self:
                set_sharding(model, None)
            return
        full = self.full()
        with torch.no_grad():
            for name, p in self.parameters().items():
                p.data = full[name]
        if sharding_of(model) is self:
            set_sharding(model, None)

    # --- forwards -----------------------------------------------------------------------

    def __call__(self, module: nn.Module, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``weights`` with every sharded name full: missing names from the module's own
        parameters, shard-shaped ones gathered (one collective), full ones as they are."""
        out = dict(weights)
        if self._full:
            return out
        self._armed = True
        if self.layers.readers is not None:
            # Each layer gathers its own as it runs; the model's own shards go through
            # functional_call too, which puts them back whatever the forward does.
            for name in self.cuts:
                out[name] = local(out[name] if name in out else module.get_parameter(name))
            return out
        names, shards = [], []
        for name, cut in self.cuts.items():
            t = local(out[name] if name in out else module.get_parameter(name))
            if t.shape != cut.local_shape:  # full already (a gathered or given tensor)
                out[name] = t
                continue
            names.append(name)
            shards.append(t)
        for name, t in zip(names, self._gather_named(names, shards), strict=True):
            out[name] = t
        return out

    def _keep_rows(self, full: Tensor, shard: Tensor, cut: Cut) -> None:
        """Graphs keep ``full`` as its rows, if it is large enough to be worth a gather; not
        under ``torch.vmap`` (stacked tasks), whose kernels save what they derive from a
        weight in layouts that depend on a rank's sample count (a view of the weight at one
        count, an expanded copy at another): ranks would then gather again a different
        number of saved tensors, so the graph keeps the stacked weights whole."""
        if self.regather is None or torch._C._functorch.is_functorch_wrapped_tensor(full):
            return
        if full.nbytes >= self.unit_bytes:
            self.regather.register(full, shard, cut)

    def keeps_rows(self) -> bool:
        """Whether graphs keep some gathered weight as its rows (one of ``unit_bytes`` or
        more), which they do for tasks one by one and not for stacked tasks
        (:meth:`_keep_rows`)."""
        model = self._model()
        return (
            self.regather is not None
            and model is not None
            and any(
                math.prod(c.shape) * model.get_parameter(n).element_size() >= self.unit_bytes
                for n, c in self.cuts.items()
            )
        )

    def whole(self, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``weights`` with every shard-shaped sharded one gathered now (one collective), for
        an algorithm that reads them outside a forward; the others as they are."""
        out = dict(weights)
        names = [n for n, c in self.cuts.items() if n in out and out[n].shape == c.local_shape]
        if self._full or not names:
            return out
        fulls = gather([out[n] for n in names], [self.cuts[n] for n in names], self.group)
        out.update(zip(names, fulls, strict=True))
        return out

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
        # A forward that metaddp.functional.call runs is armed; a direct model(x) would run on this
        # rank's rows, and is refused.
        if self._full:
            return
        armed, self._armed = self._armed, False
        if armed:
            self.layers.start(record=self.layers.readers is None)
            return
        for name, cut in self.cuts.items():
            held = _attr(module, name)
            if is_dtensor(held):
                raise RuntimeError(
                    f"the model was sharded by FSDP2's fully_shard and MetaDDP wraps it ({name!r} "
                    "is a DTensor of rows): run it through the algorithm (learner.meta_loss, "
                    "learner.adapt, metaddp.functional.call), which gathers the rows; "
                    "learner.release() gives the model its FSDP2 forward back"
                )
            if held.shape != cut.shape:
                raise RuntimeError(
                    f"the model's parameters are shards of the sample group's ({name!r} holds "
                    f"{cut.length} of its {cut.rows} rows here): run it through the algorithm "
                    "(learner.meta_loss, learner.adapt, algorithm.predict, "
                    "metaddp.functional.call), or "
                    "gather them on every rank of the group first: `with learner.gathered():`"
                )
            return

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.layers.forwarding:
            self.layers.finish()

    def _saved(self, module: nn.Module, state: Any, prefix: str, metadata: dict) -> None:
        # A state_dict taken outside gathered() holds this rank's rows: it says so in its
        # metadata (kept by torch.save), so that loading it is refused.
        if not self._full:
            metadata[ROWS] = (group_rank(self.group), group_size(self.group))

    def _loading(self, module: nn.Module, state: Any, prefix: str, metadata: dict, *_: Any) -> None:
        # Rows loaded outside gathered() could be any rank's (a copy, .cpu() or .clone(),
        # drops the metadata that says whose): only load_sharded_state_dict loads rows.
        rows = metadata.get(ROWS)
        if rows is None and (self._full or self.loading_rows):
            return
        whose = "" if rows is None else f" (this one holds rank {rows[0]}'s of {rows[1]})"
        raise RuntimeError(
            "load_state_dict on sharded weights, each rank holding its rows"
            f"{whose}: a state taken outside learner.gathered() holds one rank's rows, and "
            "loaded on every rank would give them all that rank's. Load whole weights inside "
            "`with learner.gathered():`, or rows saved with learner.sharded_state_dict() "
            "through torch.distributed.checkpoint with learner.load_sharded_state_dict()"
        )

    def holding_full(self) -> bool:
        """Inside :meth:`gathered`: the module holds its full weights."""
        return self._full

    # --- inner gradients ----------------------------------------------------------------

    def passed(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The gradients of shards as they are (already the global gradient's rows), or of
        every task's shards stacked ``[T, *rows]``; any tensor not shaped like one of this
        rank's shards is refused: its gradient would be this rank's own."""
        shapes = self._shard_shapes
        for t in tensors:
            if t.shape not in shapes and t.shape[1:] not in shapes:
                raise TypeError(
                    f"an inner gradient of shape {tuple(t.shape)} is not one of this rank's "
                    "shards: with shard=True, inner loops differentiate by the model's sharded "
                    "weights (the algorithm's fast weights), whose gradients the gather has "
                    "summed already; a tensor outside them would keep each rank's own gradient"
                )
        return list(tensors)

    def reduced(self, names: Sequence[str], tensors: Sequence[Tensor], total: Any) -> list[Tensor]:
        """The gradients of fast weights by name: a sharded weight's rows as they are (the
        gather has summed them), or its rows of every task stacked ``[T, *rows]``; any other
        (a context vector, a head made per task) summed over the sample group by ``total``,
        as it would be unsharded."""
        for n, t in zip(names, tensors, strict=True):
            rows = self.cuts[n].local_shape if n in self.cuts else None
            if rows is not None and rows not in (t.shape, t.shape[1:]):
                raise TypeError(
                    f"the inner gradient of the sharded weight {n!r} has the whole weight's "
                    f"shape {tuple(t.shape)}: with shard=True, inner loops "
                    "differentiate by this rank's rows (the algorithm's fast weights)"
                )
        out = list(tensors)
        others = [i for i, n in enumerate(names) if n not in self.cuts]
        if others:
            for i, t in zip(others, total([tensors[i] for i in others]), strict=True):
                out[i] = t
        return out


class ShardedReduce:
    """The reductions an algorithm gets where the meta-parameters are sharded: called with
    tensors alone, the gradients of shards as they are (:meth:`Sharding.passed`); by name
    (:meth:`by_name`, inner gradients), the others summed too; :meth:`values`, a SUM of
    statistics (class sums, feature sums), which no gather has made; :meth:`dot`, an inner
    product of rows over the whole weights (conjugate gradient)."""

    def __init__(self, sharding: Sharding, total: Any) -> None:
        self.sharding, self.total = sharding, total

    def __call__(self, tensors: list[Tensor]) -> list[Tensor]:
        return self.sharding.passed(tensors)

    def by_name(self, names: Sequence[str], tensors: Sequence[Tensor]) -> list[Tensor]:
        return self.sharding.reduced(names, tensors, self.total)

    def values(self, tensors: list[Tensor]) -> list[Tensor]:
        return list(self.total(tensors))

    def dot(self, a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
        """The inner product of two lists of this rank's rows, over the whole weights."""
        mine = sum((x * y).sum() for x, y in zip(a, b, strict=True))
        return self.total([torch.as_tensor(mine).reshape(1)])[0][0]


def refuse_sharded(module: nn.Module, deterministic: bool) -> nn.Module:
    """The model whose parameters ``MetaDDP(module, shard=True)`` shards, or an error that
    says why it cannot: not an algorithm that declares the sharded layout
    (:class:`metaddp.algorithms.Supports`), configured with what reads whole weights
    (``sharded_refusal``), or deterministic mode. A model sharded by FSDP2 (adopted) is held
    to the same rules."""
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
    model = getattr(module, "sharded_module")()  # noqa: B009
    if not isinstance(model, nn.Module):
        raise ValueError(f"shard=True: {name} adapts part of its model only")
    return model


def has_dtensors(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2's ``fully_shard``)."""
    return any(is_dtensor(p) or is_dtensor(p.data) for p in model.parameters())


def _ranks(group: Group) -> list[int]:
    if not dist.is_initialized():
        return [0]
    return list(dist.get_process_group_ranks(group or dist.group.WORLD))


def fsdp_refusal(model: nn.Module, task_group: Group, sample_group: Group) -> str | None:
    """Why MetaDDP cannot adopt a model whose parameters are DTensors, or ``None``: it adopts
    FSDP2's ``fully_shard``, every trained parameter a DTensor cut ``Shard(0)`` over a 1-D
    mesh whose group is MetaDDP's sample group, or placed ``(Replicate(), Shard(0))`` on a
    2-D mesh whose axes are its task and sample groups (HSDP), with neither a mixed precision
    policy nor CPU offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import Replicate, Shard

    fix = (
        "; or pass the unsharded model and build MetaDDP(algorithm, mesh, shard=True), "
        "which shards the meta-parameters itself"
    )
    ours = _ranks(sample_group)
    for name, p in model.named_parameters():
        if not is_dtensor(p):
            if p.requires_grad and p.dim() > 0:
                return (
                    f"{name!r} is a plain tensor beside the DTensors of FSDP2's fully_shard: "
                    "apply fully_shard to the root module too, so that every trained "
                    "parameter is sharded" + fix
                )
            continue
        if not p.requires_grad:
            return (
                f"{name!r} is a frozen DTensor (requires_grad=False): MetaDDP gathers trained "
                "parameters only. Freeze it before fully_shard, or leave it trained" + fix
            )
        mesh = p.device_mesh  # type: ignore[attr-defined]
        placements = tuple(p.placements)  # type: ignore[attr-defined]
        # fully_shard's placements on a 1-D mesh, or HSDP's on a 2-D one (replicated over
        # the task groups, sharded within each).
        hsdp = mesh.ndim == 2 and placements == (Replicate(), Shard(0))
        if placements[-1:] != (Shard(0),) or not (mesh.ndim == 1 or hsdp):
            return (
                f"{name!r} is placed {placements} on a {mesh.ndim}-D mesh: MetaDDP adopts "
                "DTensors placed (Shard(0),) on a 1-D mesh (fully_shard's default) or "
                "(Replicate(), Shard(0)) on a 2-D one (HSDP), whose rows it gathers" + fix
            )
        sharded_over = _ranks(mesh.get_group(mesh.ndim - 1))
        groups = [(sharded_over, ours, "sample group", "mesh.device_mesh['sample']")]
        if hsdp:
            groups.append(
                (_ranks(mesh.get_group(0)), _ranks(task_group), "task axis", "mesh.device_mesh")
            )
        for theirs, want, axis, which in groups:
            if theirs != want:
                return (
                    f"{name!r} is sharded over ranks {theirs}, but MetaDDP's {axis} here is "
                    f"ranks {want}: build fully_shard's mesh over the same ranks ({which}, "
                    "where mesh is MetaDDP's md.Mesh)" + fix
                )
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        policy = state._mp_policy
        if any(
            d is not None for d in (policy.param_dtype, policy.reduce_dtype, policy.output_dtype)
        ):
            return (
                f"fully_shard with a mixed precision policy ({policy}): MetaDDP's gathers run "
                "in the parameters' own dtype and would bypass it; build fully_shard without "
                "mp_policy, or use metaddp's own autocast"
            )
        group = state._fsdp_param_group
        if group is not None and isinstance(group.offload_policy, CPUOffloadPolicy):
            return (
                "fully_shard with CPUOffloadPolicy: MetaDDP gathers the rows where they are "
                "held and keeps graphs through them; build fully_shard without offload_policy"
            )
    return None


_Aside = list[tuple[Any, int, Any, bool]]


def _set_aside_fsdp_hooks(model: nn.Module) -> _Aside:
    """Take FSDP2's forward hooks off every module of ``model`` (FSDP's forward would gather
    into its own buffers, which ``functional_call`` does not see, and free them before a
    second backward); what :func:`_put_back` restores."""
    from torch.distributed.fsdp import FSDPModule

    aside: _Aside = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
            for h in getattr(handle, "handles", (handle,)):  # a group's _MultiHandle
                hooks = h.hooks_dict_ref()
                if hooks is not None and h.id in hooks:
                    first = next(iter(hooks)) == h.id  # a prepended hook goes back first
                    aside.append((hooks, h.id, hooks.pop(h.id), first))
    return aside


def _put_back(aside: _Aside) -> None:
    for hooks, key, hook, first in reversed(aside):
        hooks[key] = hook
        if first:
            hooks.move_to_end(key, last=False)
