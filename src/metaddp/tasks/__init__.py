"""Task families for meta-training: each task a pure function of (seed, split, global index).

``make(name, **options)`` builds a family by name; :data:`FAMILIES` lists them.
"""

from __future__ import annotations

import importlib
from typing import Any, cast

from ._family import SPLITS, TaskFamily
from ._fewshot import NORMS, ConvNet, FewShotImages, nearest_mean_accuracy, rotations
from ._fonts import FontSetError
from .omniglot import LayoutError
from .sinusoid import Sinusoid

# Each family's module and class, imported when asked for (some need optional packages).
_CLASSES = {
    "sinusoid": "sinusoid.Sinusoid",
    "digits": "digits.Digits",
    "glyphs": "glyphs.Glyphs",
    "omniglot": "omniglot.Omniglot",
    "miniimagenet": "miniimagenet.MiniImageNet",
    "noisy-digits": "noisy.NoisyDigits",
    "noisy-run": "noisy.NoisyRun",
    "sequences": "sequences.Sequences",
    "ttt": "ttt.TTT",
}
FAMILIES = tuple(_CLASSES)


def family_class(name: str) -> type[TaskFamily]:
    """The class of family ``name``, importing optional dependencies only when needed."""
    if name not in _CLASSES:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(FAMILIES)}")
    module, cls = _CLASSES[name].split(".")
    return cast(type[TaskFamily], getattr(importlib.import_module(f".{module}", __name__), cls))


def make(
    name: str,
    *,
    shots: int,
    query: int,
    ways: int | None = None,
    hidden: int | None = None,
    data: str | None = None,
    norm: str | None = None,
    fonts: str | None = None,
    noise: float | None = None,
    keep: str | None = None,
) -> TaskFamily:
    """Build family ``name`` with the given sizes (``ways``, ``data``, ``norm``, ``fonts``,
    ``noise`` and ``keep`` where they apply; ``None``: the family's default)."""
    cls = family_class(name)
    opts: dict[str, Any] = {"shots": shots, "query": query}
    if hidden is not None:
        opts["hidden"] = hidden
    if cls.classification:
        opts["ways"] = ways if ways is not None else cls.defaults["ways"]
    if cls.needs_data or cls.data_option:
        opts["root"] = data
    if norm is not None and "norm" in cls.defaults:
        opts["norm"] = norm
    if fonts is not None:
        cls.font_set(fonts)  # a family without fonts says so
        opts["fonts"] = fonts
    for k, v in (("noise", noise), ("keep", keep)):
        if v is not None:
            if k not in cls.defaults:
                raise ValueError(f"{k} is a setting of noisy-digits and noisy-run, not of {name}")
            opts[k] = v
    return cls(**opts)


__all__ = [
    "FAMILIES",
    "NORMS",
    "SPLITS",
    "ConvNet",
    "FewShotImages",
    "FontSetError",
    "LayoutError",
    "Sinusoid",
    "TaskFamily",
    "family_class",
    "make",
    "nearest_mean_accuracy",
    "rotations",
]
