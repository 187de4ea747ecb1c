"""Few-shot classification of miniImageNet (Vinyals et al. 2016) with the class split of
Ravi & Larochelle 2017: 64 training, 16 validation and 20 test classes of 600 images each.

The folder may hold any of the layouts the dataset is shared in:

- ``train.csv``, ``val.csv``, ``test.csv`` (``filename,label`` rows, Ravi & Larochelle's split
  files) and ``images/<filename>``;
- ``train/``, ``val/``, ``test/``, each ``<class>/<image>`` (.jpg, .jpeg or .png);
- ``mini-imagenet-cache-{train,val,test}.pkl``: pickled dicts ``{"image_data": uint8 array
  [n, 84, 84, 3], "class_dict": {class: [indices]}}``;
- ``miniImageNet_category_split_{train_phase_train,val,test}.pickle``: pickled dicts
  ``{"data": uint8 array [n, 84, 84, 3], "labels": [label per image]}``.

Pickles are read with an unpickler that accepts only numpy arrays and plain containers, so a
file that is not one of these datasets is refused instead of run. Meta-training uses the
training classes, meta-testing the test classes (the validation classes are not used). Images
are 84x84 RGB, kept as bytes (1.1 GB for the 84 classes used). Needs Pillow (the ``images``
extra) for image folders and numpy for pickles.
"""

from __future__ import annotations

import csv
import io
import pickle
from pathlib import Path
from typing import Any, ClassVar

import torch

from ._fewshot import FewShotImages
from .omniglot import LayoutError

SIZE = 84
SPLITS = {"train": "train", "test": "test"}  # the family's split: the dataset's split
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
PICKLE_CACHE = "mini-imagenet-cache-{}.pkl"
PICKLE_SPLIT = {
    "train": "miniImageNet_category_split_train_phase_train.pickle",
    "val": "miniImageNet_category_split_val.pickle",
    "test": "miniImageNet_category_split_test.pickle",
}
EXPECTED = (
    "expected one of: {root}/train.csv, val.csv, test.csv and {root}/images/; "
    "{root}/train/, val/, test/ holding <class>/<image> folders; "
    "{root}/mini-imagenet-cache-train.pkl (and -val, -test); or "
    "{root}/miniImageNet_category_split_train_phase_train.pickle (and _val, _test)"
)


class SafeUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and plain containers, and refuses anything else."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),  # how protocol-2 pickles of Python 2 store bytes
        ("builtins", "dict"),
        ("builtins", "list"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_pickle(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read()
        return SafeUnpickler(io.BytesIO(data), encoding="latin1").load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as e:
        raise LayoutError(f"cannot read {path} as a miniImageNet pickle: {e}") from e


def to_tensor(array: Any, source: Path) -> torch.Tensor:
    """An image array ``[n, H, W, 3]`` (uint8) as ``[n, 3, SIZE, SIZE]`` uint8."""
    images = torch.as_tensor(array)
    if images.dim() != 4 or images.shape[-1] != 3 or images.dtype != torch.uint8:
        raise LayoutError(
            f"{source}: expected uint8 images [n, H, W, 3], got {images.dtype} {list(images.shape)}"
        )
    images = images.permute(0, 3, 1, 2).contiguous()
    if images.shape[-1] != SIZE or images.shape[-2] != SIZE:
        small = torch.nn.functional.interpolate(
            images.float(), size=(SIZE, SIZE), mode="bilinear", antialias=True
        )
        images = small.round().clamp(0, 255).to(torch.uint8)
    return images


def from_cache_pickle(path: Path) -> dict[str, torch.Tensor]:
    data = read_pickle(path)
    if not isinstance(data, dict) or "image_data" not in data or "class_dict" not in data:
        raise LayoutError(f"{path} is not a miniImageNet cache: no image_data and class_dict")
    images = to_tensor(data["image_data"], path)
    return {
        str(c): images[torch.as_tensor(list(idx), dtype=torch.long)]
        for c, idx in sorted(data["class_dict"].items())
    }


def from_split_pickle(path: Path) -> dict[str, torch.Tensor]:
    data = read_pickle(path)
    if not isinstance(data, dict) or "data" not in data or "labels" not in data:
        raise LayoutError(f"{path} is not a miniImageNet split: no data and labels")
    images = to_tensor(data["data"], path)
    labels = torch.as_tensor(list(data["labels"]), dtype=torch.long)
    if labels.shape[0] != images.shape[0]:
        raise LayoutError(f"{path}: {images.shape[0]} images but {labels.shape[0]} labels")
    return {str(int(c)): images[labels == c] for c in torch.unique(labels)}


def read_image(path: Path) -> torch.Tensor:
    """One image file as ``[3, SIZE, SIZE]`` uint8 (resized if needed)."""
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(
            "miniImageNet image folders need Pillow: pip install 'metaddp[images]'"
        ) from e
    try:
        with Image.open(path) as im:
            rgb = im.convert("RGB")
            if rgb.size != (SIZE, SIZE):
                rgb = rgb.resize((SIZE, SIZE), Image.Resampling.LANCZOS)
            data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    except OSError as e:
        raise LayoutError(f"cannot read image {path}: {e}") from e
    return data.view(SIZE, SIZE, 3).permute(2, 0, 1)


def from_files(files: dict[str, list[Path]]) -> dict[str, torch.Tensor]:
    return {c: torch.stack([read_image(p) for p in paths]) for c, paths in sorted(files.items())}


def csv_files(root: Path, split: str) -> dict[str, list[Path]]:
    path = root / f"{split}.csv"
    files: dict[str, list[Path]] = {}
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or not {"filename", "label"} <= set(reader.fieldnames):
                raise LayoutError(
                    f"{path} should have the columns filename,label, has {reader.fieldnames}"
                )
            for row in reader:
                files.setdefault(row["label"], []).append(root / "images" / row["filename"])
    except OSError as e:
        raise LayoutError(f"cannot read {path}: {e}") from e
    missing = [p for ps in files.values() for p in ps if not p.is_file()]
    if missing:
        raise LayoutError(
            f"{len(missing)} image(s) named in {path} are not in {root / 'images'}, "
            f"e.g. {missing[0].name}"
        )
    return files


def folder_files(base: Path) -> dict[str, list[Path]]:
    files = {
        c.name: sorted(p for p in c.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        for c in sorted(base.iterdir())
        if c.is_dir()
    }
    empty = [c for c, ps in files.items() if not ps]
    if not files or empty:
        raise LayoutError(
            f"{base} should hold <class>/<image> folders"
            + (f"; {base / empty[0]} holds no image" if empty else "")
        )
    return files


def layout(root: Path) -> str:
    """Which layout ``root`` holds: "csv", "folders", "cache-pickle" or "split-pickle"."""
    expected = EXPECTED.format(root=root)
    if not root.is_dir():
        raise LayoutError(f"dataset folder {root} does not exist; {expected}")
    if (root / "train.csv").is_file() or (root / "test.csv").is_file():
        if not (root / "images").is_dir():
            raise LayoutError(f"{root} has split CSV files but no images/ folder; {expected}")
        return "csv"
    if (root / PICKLE_CACHE.format("train")).is_file():
        return "cache-pickle"
    if (root / PICKLE_SPLIT["train"]).is_file():
        return "split-pickle"
    if (root / "train").is_dir():
        return "folders"
    raise LayoutError(f"{root} is not in a miniImageNet layout; {expected}")


def split_source(root: Path, kind: str, split: str) -> Path:
    """The file or folder holding ``split`` in layout ``kind`` (checked to exist)."""
    path = {
        "csv": root / f"{split}.csv",
        "folders": root / split,
        "cache-pickle": root / PICKLE_CACHE.format(split),
        "split-pickle": root / PICKLE_SPLIT[split],
    }[kind]
    if not path.exists():
        raise LayoutError(
            f"{root} is in the {kind} layout but {path.name} is missing; "
            + EXPECTED.format(root=root)
        )
    return path


def load_split(root: Path, split: str) -> dict[str, torch.Tensor]:
    """The classes of ``split`` ("train", "val" or "test"): name -> ``uint8 [n, 3, 84, 84]``."""
    kind = layout(root)
    path = split_source(root, kind, split)
    if kind == "csv":
        return from_files(csv_files(root, split))
    if kind == "folders":
        return from_files(folder_files(path))
    if kind == "cache-pickle":
        return from_cache_pickle(path)
    return from_split_pickle(path)


class MiniImageNet(FewShotImages):
    """N-way K-shot miniImageNet read from ``root`` in any layout above.

    The defaults follow Finn et al. 2017: a Conv-4 of 32 channels on 84x84 RGB images, five
    inner steps of 0.01 in training (ten at test), 15 query images per class, 4 tasks per step.
    """

    name: ClassVar[str] = "miniimagenet"
    needs_data: ClassVar[bool] = True
    defaults: ClassVar[dict[str, Any]] = dict(
        FewShotImages.defaults,
        hidden=32,
        inner_lr=0.01,
        inner_steps=5,
        meta_batch=4,
        query=15,
    )

    @classmethod
    def check_data(cls, data: str | None) -> None:
        if data is None:
            raise LayoutError("the miniimagenet task needs --data FOLDER (a miniImageNet layout)")
        root = Path(data)
        kind = layout(root)
        for split in SPLITS.values():
            split_source(root, kind, split)

    def __init__(
        self,
        root: str | Path,
        ways: int = 5,
        shots: int = 1,
        query: int = 15,
        hidden: int = 32,
        norm: str = "batch",
    ) -> None:
        self.check_data(None if root is None else str(root))
        self.root = Path(root)
        classes = {s: load_split(self.root, d) for s, d in SPLITS.items()}
        self.class_names = {s: sorted(c) for s, c in classes.items()}
        pools = {s: [c[name] for name in sorted(c)] for s, c in classes.items()}
        super().__init__(pools, ways=ways, shots=shots, query=query, hidden=hidden, norm=norm)
