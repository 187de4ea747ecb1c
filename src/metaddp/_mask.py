"""Which samples of the batch being computed are real: padding that must count for nothing.

The deterministic executor pads short chunks to one shape; layers that pool over the batch
(BatchNorm's statistics) read :func:`current` and leave the padded samples out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor

_stack: list[Tensor] = []


@contextlib.contextmanager
def sample_mask(mask: Tensor) -> Iterator[None]:
    """Inside the block, ``mask[i]`` (1 or 0) says whether sample ``i`` of the batch is real."""
    _stack.append(mask)
    try:
        yield
    finally:
        _stack.pop()


def current() -> Tensor | None:
    """The innermost :func:`sample_mask`, or ``None`` (every sample is real)."""
    return _stack[-1] if _stack else None
