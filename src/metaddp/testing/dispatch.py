"""What a meta-step would cost a GPU, counted on any device: the aten operations it dispatches
(each a kernel launch on a GPU, so a proxy for launch-bound time), and the host reads of
device values among them (each a wait for the device).

``metaddp._host.counting`` counts the library's own reads; this counts every operation that
passes through the dispatcher, the user's included. ``.tolist()`` and ``.numpy()`` on a CPU
tensor read memory without dispatching, so only the library's own count sees those.
"""

from __future__ import annotations

import collections
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# Operations whose result the host needs before it can go on: ``.item()``, ``bool(t)``,
# ``float(t)`` (``_local_scalar_dense``), and those whose output size depends on values.
HOST_READS = frozenset(
    {
        "aten._local_scalar_dense.default",
        "aten.nonzero.default",
        "aten.masked_select.default",
        "aten.equal.default",
        "aten.unique_consecutive.default",
        "aten._unique2.default",
    }
)


class DispatchCounter(TorchDispatchMode):
    """Inside the block: ``ops`` (every dispatched aten operation, by name), ``total`` and
    ``host_reads``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def host_reads(self) -> int:
        return sum(n for op, n in self.ops.items() if op in HOST_READS)
