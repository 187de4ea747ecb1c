"""Task families for meta-training: each task a pure function of (seed, split, global index).

``make(name, **options)`` builds a family by name; :data:`FAMILIES` lists them.
"""

from __future__ import annotations

from typing import Any

from ._family import SPLITS, TaskFamily
from ._fewshot import ConvNet, FewShotImages, rotations
from .omniglot import LayoutError
from .sinusoid import Sinusoid

FAMILIES = ("sinusoid", "digits", "omniglot")


def family_class(name: str) -> type[TaskFamily]:
    """The class of family ``name``, importing optional dependencies only when needed."""
    if name == "sinusoid":
        return Sinusoid
    if name == "digits":
        from .digits import Digits

        return Digits
    if name == "omniglot":
        from .omniglot import Omniglot

        return Omniglot
    raise ValueError(f"unknown task {name!r}; choose from {', '.join(FAMILIES)}")


def make(
    name: str,
    *,
    shots: int,
    query: int,
    ways: int | None = None,
    hidden: int | None = None,
    data: str | None = None,
) -> TaskFamily:
    """Build family ``name`` with the given sizes (``ways`` and ``data`` where they apply)."""
    cls = family_class(name)
    opts: dict[str, Any] = {"shots": shots, "query": query}
    if hidden is not None:
        opts["hidden"] = hidden
    if cls.classification:
        opts["ways"] = ways if ways is not None else cls.defaults["ways"]
    if cls.needs_data:
        opts["root"] = data
    return cls(**opts)


__all__ = [
    "FAMILIES",
    "SPLITS",
    "ConvNet",
    "FewShotImages",
    "LayoutError",
    "Sinusoid",
    "TaskFamily",
    "family_class",
    "make",
    "rotations",
]
