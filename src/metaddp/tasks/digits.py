"""Few-shot classification of scikit-learn's handwritten digits (no download needed).

``sklearn.datasets.load_digits`` ships 1797 greyscale 8x8 images of the digits 0-9 (about 180
each). Meta-training uses the digits 0-4, each turned by 0/90/180/270 degrees as four classes
(20 classes, as rotations extend Omniglot in Santoro et al. 2016); meta-testing uses the
digits 5-9 upright, never seen in training. Needs the ``digits`` extra (scikit-learn).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ._fewshot import FewShotImages, rotations

TRAIN_DIGITS = (0, 1, 2, 3, 4)
TEST_DIGITS = (5, 6, 7, 8, 9)


def load() -> tuple[torch.Tensor, torch.Tensor]:
    """All digit images ``[1797, 1, 8, 8]`` scaled to [0, 1], and their labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError(
            "the digits task needs scikit-learn: pip install 'metaddp[digits]'"
        ) from e
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(data.target, dtype=torch.long)


class Digits(FewShotImages):
    """N-way K-shot digits: train classes 0-4 with rotations, test classes 5-9 upright."""

    name: ClassVar[str] = "digits"
    defaults: ClassVar[dict[str, Any]] = dict(FewShotImages.defaults, meta_batch=16)

    def __init__(
        self,
        ways: int = 5,
        shots: int = 1,
        query: int = 15,
        hidden: int = 32,
        norm: str = "batch",
    ) -> None:
        images, labels = load()
        pools = {
            "train": [r for d in TRAIN_DIGITS for r in rotations(images[labels == d], True)],
            "test": [images[labels == d] for d in TEST_DIGITS],
        }
        super().__init__(pools, ways=ways, shots=shots, query=query, hidden=hidden, norm=norm)
