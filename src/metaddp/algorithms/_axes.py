"""Axis moves for the stacked kernels' vmap rules, which dispatch nothing when there is
nothing to move: every dispatched operation, a no-op permute included, is paid per meta-step
(BENCHMARKS.md, "Dispatched operations")."""

from __future__ import annotations

from torch import Tensor


def moved(t: Tensor, src: int, dst: int) -> Tensor:
    """``t.movedim(src, dst)`` (both non-negative), or ``t`` itself when ``src == dst``."""
    return t if src == dst else t.movedim(src, dst)
