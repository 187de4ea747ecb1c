"""Sharded weights gathered one layer at a time inside a forward, and freed after it.

A forward through :func:`metaddp.functional.call` on a sharded model (:mod:`._sharded`) may gather
every weight at once, or each layer's as the layer runs. Per layer, a forward pre-hook on
the module gathers the weights it reads (one all-gather per layer), swaps them in for the
shards, and its forward hook swaps the shards back, so the full weights of a layer live
while it runs, and, kept out of the autograd graph by :mod:`._regather`, never longer.

Which module reads which weights is learned from the first forward (run with every weight
gathered): every module that was called gathers its own weights and those of its
descendants that were not (``nn.MultiheadAttention`` reads ``out_proj.weight`` without
calling ``out_proj``); the model itself gathers the rest, and the weights of modules smaller
than ``unit_bytes``, all in one collective (for them a collective costs more than the memory
it saves). Ranks run the same forward, so
their per-layer gathers match in order (their tags check it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.nn.utils._named_member_accessor import swap_tensor
from torch.utils.hooks import RemovableHandle

GatherMany = Callable[[list[str], list[Tensor]], list[Tensor]]


class LayerGather:
    """The per-layer gathering of one sharded model.

    Args:
        model: the model whose trained parameters are sharded.
        shards: name -> the shard shape of every sharded parameter.
        gather: ``gather(names, shards)``, the full tensors (registered for
            :mod:`._regather` by the caller).
        sizes: name -> bytes of the full tensor.
        unit_bytes: a module whose weights come to fewer bytes leaves them to the model,
            which gathers them all at the forward's start in one collective.
    """

    def __init__(
        self,
        model: nn.Module,
        shards: dict[str, Any],
        gather: GatherMany,
        sizes: dict[str, int],
        unit_bytes: int,
    ) -> None:
        self._shards, self._gather = shards, gather
        self._sizes, self._unit_bytes = sizes, unit_bytes
        self._owner_of = {name: name.rpartition(".")[0] for name in shards}
        self._paths = {
            path
            for name in shards
            for path in _ancestors(self._owner_of[name])  # every module above a weight
        }
        self.readers: dict[str, list[str]] | None = None  # module path -> weights it gathers
        self._called: set[str] | None = None  # while the first forward records
        self.forwarding = False  # inside a forward that metaddp.functional.call runs
        self._swapped: list[tuple[int, list[tuple[nn.Module, str, Tensor]]]] = []
        self._handles: list[RemovableHandle] = []
        for path, module in model.named_modules():
            if path in self._paths:
                self._handles.append(
                    module.register_forward_pre_hook(self._pre(path), prepend=True)
                )
                self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def start(self, record: bool) -> None:
        """A forward begins; with ``record`` (the first, every weight gathered already) it
        only notes which modules run."""
        self.forwarding = True
        self._swapped.clear()
        self._called = set() if record else None

    def finish(self) -> None:
        """The forward ended (or raised): after the first, who gathers what."""
        self.forwarding = False
        self._swapped.clear()
        called, self._called = self._called, None
        if called is None:
            return
        readers: dict[str, list[str]] = {}
        for name, owner in self._owner_of.items():
            # The innermost called module at or above the weight's; the model's if none.
            path = next((p for p in _ancestors(owner) if p in called), "")
            readers.setdefault(path, []).append(name)
        small = [
            p
            for p, names in readers.items()
            if p and sum(self._sizes[n] for n in names) < self._unit_bytes
        ]
        for path in small:
            readers.setdefault("", []).extend(readers.pop(path))
        self.readers = readers

    def _pre(self, path: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not self.forwarding:
                return
            if self._called is not None:
                self._called.add(path)
                return
            assert self.readers is not None
            swaps: list[tuple[nn.Module, str, Tensor]] = []
            names, shards = [], []
            for name in self.readers.get(path, ()):
                owner, _, leaf = (name[len(path) + 1 :] if path else name).rpartition(".")
                holder = module.get_submodule(owner)
                t = getattr(holder, leaf)
                if t.shape == self._shards[name]:  # a shard (not full already)
                    names.append(name)
                    shards.append(t)
                    swaps.append((holder, leaf, t))
            if names:
                for (holder, leaf, _), full in zip(swaps, self._gather(names, shards), strict=True):
                    swap_tensor(holder, leaf, full)
            self._swapped.append((id(module), swaps))

        return hook

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.forwarding or self._called is not None:
            return
        if self._swapped and self._swapped[-1][0] == id(module):
            _, swaps = self._swapped.pop()
            for holder, leaf, shard in swaps:  # the full weights go; the graph keeps shards
                swap_tensor(holder, leaf, shard)


def _ancestors(path: str) -> list[str]:
    """``path`` and every module path above it, innermost first, ending with the model's
    (``""``)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)] + [""]
