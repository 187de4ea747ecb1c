"""Few-shot classification from a folder in the Omniglot layout (Lake et al. 2015).

The folder holds ``images_background/`` (meta-training alphabets) and ``images_evaluation/``
(meta-test alphabets), each ``<alphabet>/<character>/*.png``, as the official archives unpack.
Every character is a class, and, as in Santoro et al. 2016 and Finn et al. 2017, its rotations
by 90, 180 and 270 degrees are three more. Images are read in greyscale, resized to 28x28 and
inverted so that strokes are 1 and paper 0. Needs Pillow (the ``images`` extra).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import torch

from ._fewshot import FewShotImages, rotations

SPLIT_DIRS = {"train": "images_background", "test": "images_evaluation"}
SIZE = 28


class LayoutError(ValueError):
    """The dataset folder is not in the Omniglot layout."""


def characters(root: Path) -> dict[str, list[Path]]:
    """Per split, the character folders of ``root``, checked against the expected layout."""
    expected = (
        f"expected {root}/images_background/<alphabet>/<character>/*.png and "
        f"{root}/images_evaluation/<alphabet>/<character>/*.png"
    )
    if not root.is_dir():
        raise LayoutError(f"dataset folder {root} does not exist; {expected}")
    out: dict[str, list[Path]] = {}
    for split, sub in SPLIT_DIRS.items():
        base = root / sub
        if not base.is_dir():
            raise LayoutError(f"{base} is missing; {expected}")
        chars = sorted(
            c for a in sorted(base.iterdir()) if a.is_dir() for c in a.iterdir() if c.is_dir()
        )
        if not chars:
            raise LayoutError(f"{base} holds no <alphabet>/<character>/ folders; {expected}")
        empty = [c for c in chars if not any(c.glob("*.png"))]
        if empty:
            raise LayoutError(
                f"{len(empty)} character folder(s) hold no .png image, e.g. {empty[0]}; {expected}"
            )
        out[split] = chars
    return out


def load_character(folder: Path) -> torch.Tensor:
    """The images of one character folder as ``[n, 1, 28, 28]`` floats, strokes = 1."""
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError("the omniglot task needs Pillow: pip install 'metaddp[images]'") from e
    images = []
    for path in sorted(folder.glob("*.png")):
        try:
            with Image.open(path) as im:
                g = im.convert("L").resize((SIZE, SIZE), Image.Resampling.LANCZOS)
                data = torch.frombuffer(bytearray(g.tobytes()), dtype=torch.uint8)
        except OSError as e:
            raise LayoutError(f"cannot read image {path}: {e}") from e
        images.append(1.0 - data.float().view(1, SIZE, SIZE) / 255.0)
    return torch.stack(images)


class Omniglot(FewShotImages):
    """N-way K-shot Omniglot-style classification read from ``root``.

    Args:
        root: the folder holding ``images_background`` and ``images_evaluation``.
        rotate: add the 90/180/270-degree rotations of every character as classes.
    """

    name: ClassVar[str] = "omniglot"
    needs_data: ClassVar[bool] = True
    # Finn et al. 2017: 64 channels on 28x28 images.
    defaults: ClassVar[dict[str, Any]] = dict(FewShotImages.defaults, hidden=64)

    @classmethod
    def check_data(cls, data: str | None) -> None:
        if data is None:
            raise LayoutError("the omniglot task needs --data FOLDER (in the Omniglot layout)")
        characters(Path(data))

    def __init__(
        self,
        root: str | Path,
        ways: int = 5,
        shots: int = 1,
        query: int = 15,
        hidden: int = 64,
        rotate: bool = True,
        norm: str = "batch",
    ) -> None:
        if root is None:
            raise LayoutError("the omniglot task needs --data FOLDER (in the Omniglot layout)")
        self.root, self.rotate = Path(root), bool(rotate)
        found = characters(self.root)
        # Per split, alphabet -> characters.
        self.alphabets = {s: dict(Counter(c.parent.name for c in cs)) for s, cs in found.items()}
        pools = {
            split: [r for c in chars for r in rotations(load_character(c), self.rotate)]
            for split, chars in found.items()
        }
        super().__init__(pools, ways=ways, shots=shots, query=query, hidden=hidden, norm=norm)

    def describe(self) -> dict[str, Any]:
        return dict(super().describe(), rotate=self.rotate)
