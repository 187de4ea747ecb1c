"""Check mode: catch a forgotten reduction in hand-written inner loops, where it happens.

Processes that split one task's samples must run the model on identical weights: the
meta-parameters are broadcast, and every inner gradient is the SUM over those processes.
A loop that adapts with a rank-local gradient (``torch.autograd.grad`` without ``reduce``)
gives each process different fast weights, and a meta-gradient that changes with the number
of processes. In check mode a forward pre-hook on every module that owns parameters compares
the weights it is about to run on (the fast weights, inside ``torch.func.functional_call``)
across those processes, and raises :class:`OutOfSyncError` naming the first tensor that
differs. Off (the default), nothing is registered and nothing is paid.

On: ``MetaDDP(..., check=True)``, or ``METADDP_CHECK=1`` in the environment.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ._collectives import Group, group_size, max_abs_difference

ENV = "METADDP_CHECK"


class OutOfSyncError(RuntimeError):
    """Processes that must hold identical values (weights, sizes) do not."""


def from_env() -> bool:
    """Whether ``METADDP_CHECK`` asks for check mode (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _under_transform(t: Tensor) -> bool:
    # Inside vmap (the stacked executor) tensors are functorch wrappers: a collective there
    # would be batched, so the library's own stacked path is not checked this way.
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


class WeightCheck:
    """Forward pre-hooks comparing each module's weights across ``group`` before it runs,
    registered while :attr:`enabled` (nothing is paid otherwise).

    Args:
        root: the module whose submodules are checked.
        group: the processes that split one task's samples.
        fast_only: compare only weights that are not the modules' own parameters (fast
            weights inside ``torch.func.functional_call``); the meta-parameters themselves are
            kept alike by the wrapper, and a forward on them may be one rank's own work.
    """

    def __init__(self, root: nn.Module, group: Group, *, fast_only: bool = False) -> None:
        self.group = group
        self.fast_only = fast_only
        self.calls = 0  # comparisons made (one collective each)
        self._handles: list[RemovableHandle] = []
        self._modules = (
            []
            if group_size(group) == 1
            else [
                (prefix, module)
                for prefix, module in root.named_modules()
                if any(True for _ in module.parameters(recurse=False))
            ]
        )

    @property
    def enabled(self) -> bool:
        return bool(self._handles)

    @enabled.setter
    def enabled(self, on: bool) -> None:
        if on and not self._handles:
            self._handles = [m.register_forward_pre_hook(self._hook(p)) for p, m in self._modules]
        elif not on:
            self.remove()

    def _hook(self, prefix: str):
        def hook(module: nn.Module, args: object) -> None:
            named = [(n, getattr(module, n)) for n in module._parameters]
            named = [(n, t) for n, t in named if isinstance(t, Tensor)]
            if self.fast_only:
                named = [(n, t) for n, t in named if not isinstance(t, nn.Parameter)]
            if not named or any(_under_transform(t) for _, t in named):
                return
            self.calls += 1
            spread = max_abs_difference([t for _, t in named], self.group)
            for (name, _), d in zip(named, spread, strict=True):
                if d != 0:
                    full = f"{prefix}.{name}" if prefix else name
                    raise OutOfSyncError(
                        f"{full!r} differs across the processes that split one task's samples "
                        f"(max difference {d:.3g}) when the model runs on it. An inner "
                        "gradient was not summed over them: take inner gradients with "
                        "`learner.grad(loss, params)` (torch.autograd.grad followed by the "
                        "sample-axis SUM), or pass them through `learner.reduce`."
                    )

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
