"""Autograd graphs that keep shards, not gathered weights: saved-tensor hooks that pack a
gathered weight as its shard and gather it again when the backward needs it.

A forward on sharded meta-parameters gathers the full weights (:mod:`._sharded`), and every
layer saves its weight for the backward; second order keeps each inner step's graph, and
the backward of every inner step's gradient saves the weights again. Kept as they are, the
graph would hold a full copy of the weights per forward, whatever the sharding. Here a saved
tensor that is (a view of) a gathered weight is replaced by a handle holding the shard it
was gathered from; unpacking gathers it again, differentiably when the backward builds a
graph (``create_graph=True``), so higher orders reach the shard exactly as the first
gather did. The weights then live for the forward that gathered them, and again for the
backward node that reads them: one more all-gather per saved weight in every backward, the
price ZeRO-3 pays for its memory.

Ranks of a sample group run the same graph, so their backward passes unpack in the same
order and the gathers match (their tags check it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

Gather = Callable[[Tensor, Any], Tensor]


@dataclasses.dataclass(frozen=True)
class _Handle:
    """What the graph keeps of a saved gathered weight: its shard and the view it was."""

    shard: Tensor
    cut: Any
    size: torch.Size
    stride: tuple[int, ...]
    offset: Any
    requires_grad: bool


class Regather:
    """The hooks and the gathered weights they recognise, by storage: a weak reference to
    each gathered weight's storage (``StorageWeakRef``, which sees the storage itself, not
    a Python object that the autograd engine may drop while it keeps the tensor).

    Args:
        gather: ``gather(shard, cut)``, the full tensor (differentiable in grad mode).
    """

    def __init__(self, gather: Gather) -> None:
        self._gather = gather
        self._live: dict[int, tuple[StorageWeakRef, Tensor, Any]] = {}
        self._since_sweep = 0
        self.packed = 0  # saved weights kept as shards so far

    def register(self, full: Tensor, shard: Tensor, cut: Any) -> None:
        """``full`` was gathered from ``shard``: a saved view of it is packed as the shard."""
        storage = full.untyped_storage()
        self._live[storage.data_ptr()] = (StorageWeakRef(storage), shard, cut)
        self._since_sweep += 1
        if self._since_sweep >= 64:
            self.sweep()

    def sweep(self) -> None:
        """Forget the weights already freed, and the shards their entries hold: a shard
        computed from the parameters keeps their gradient accumulators alive, which would
        then refuse the parameters at another shape (``learner.gathered()``)."""
        self._since_sweep = 0
        for ptr in [k for k, v in self._live.items() if v[0].expired()]:
            del self._live[ptr]

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The hooks for the block; what they registered and was freed is forgotten after."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self.sweep()

    def _pack(self, t: Tensor) -> Any:
        if not self._live or t.layout != torch.strided:
            return t
        ptr = t.untyped_storage().data_ptr()
        entry = self._live.get(ptr)
        if entry is None:
            return t
        if entry[0].expired():  # another tensor now at a freed weight's address
            del self._live[ptr]
            return t
        if t.dtype != entry[1].dtype:
            return t
        self.packed += 1
        return _Handle(
            entry[1], entry[2], t.size(), t.stride(), t.storage_offset(), t.requires_grad
        )

    def _unpack(self, packed: Any) -> Tensor:
        if not isinstance(packed, _Handle):
            return packed
        full = self._gather(packed.shard, packed.cut)
        self.register(full, packed.shard, packed.cut)  # saved again by a double backward
        if not packed.requires_grad:
            full = full.detach()
        if full.size() == packed.size and packed.offset == 0 and full.stride() == packed.stride:
            return full
        return full.as_strided(packed.size, packed.stride, packed.offset)
