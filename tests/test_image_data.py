"""The standard image datasets read from their usual layouts (small generated stand-ins), the
network each paper used, and the pixel nearest-mean baseline."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")

from metaddp._data import Batch, Task  # noqa: E402
from metaddp.tasks import ConvNet, LayoutError, make, nearest_mean_accuracy  # noqa: E402
from metaddp.tasks.miniimagenet import MiniImageNet, layout  # noqa: E402
from metaddp.tasks.omniglot import Omniglot  # noqa: E402

# --- Omniglot, as the official archives unpack -------------------------------------------------


def official_omniglot(root: Path) -> Path:
    """images_background/<alphabet>/characterNN/<id>_<drawer>.png, 20 drawers a character,
    105x105 1-bit images (black strokes on white), as in Lake et al.'s archives."""
    spec = {
        "images_background": {"Alphabet_of_the_Magi": 2, "Korean": 1},
        "images_evaluation": {"Angelic": 2},
    }
    ident = 1
    for sub, alphabets in spec.items():
        for alphabet, n in alphabets.items():
            for c in range(n):
                folder = root / sub / alphabet / f"character{c + 1:02d}"
                folder.mkdir(parents=True)
                for d in range(20):
                    im = Image.new("1", (105, 105), 1)  # white paper
                    for x in range(10 + 3 * c + d, 60 + 3 * c + d):
                        for y in range(50, 55):  # a black stroke, one per character and drawer
                            im.putpixel((x, y), 0)
                    im.save(folder / f"{ident:04d}_{d + 1:02d}.png")
                ident += 1
    return root


def test_omniglot_official_layout(tmp_path):
    root = official_omniglot(tmp_path / "omniglot")
    fam = Omniglot(root, ways=2, shots=1, query=19, rotate=True)
    assert fam.alphabets == {
        "train": {"Alphabet_of_the_Magi": 2, "Korean": 1},
        "test": {"Angelic": 2},
    }
    # 3 background and 2 evaluation characters, each in 4 rotations; 20 drawers each.
    assert [c.shape for c in fam.pools["train"]] == [(20, 1, 28, 28)] * 12
    assert [c.shape for c in fam.pools["test"]] == [(20, 1, 28, 28)] * 8
    img = fam.pools["test"][0][0, 0]
    # Paper is 0 and the stroke is ink: its row of 28 holds the largest values.
    assert float(img[0].max()) == 0.0 and float(img.max()) > 0.4
    assert int(img.sum(1).argmax()) in (13, 14)  # rows 50-54 of 105, resized to 28
    # MAML's Omniglot network: 64 channels on 28x28 (Finn et al. 2017).
    assert fam.hidden == 64 and fam.norm == "batch"


# --- miniImageNet in its four layouts ----------------------------------------------------------

CLASSES = {"train": 3, "val": 2, "test": 3}


def source(side: int = 84) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return {
        split: {
            f"n0{split[:2]}{c:05d}": rng.integers(0, 256, (4, side, side, 3), dtype=np.uint8)
            for c in range(n)
        }
        for split, n in CLASSES.items()
    }


def csv_layout(root: Path, data) -> Path:
    (root / "images").mkdir(parents=True)
    for split, classes in data.items():
        rows = ["filename,label"]
        for wnid, images in classes.items():
            for k, arr in enumerate(images):
                name = f"{wnid}{k:08d}.png"  # PNG: lossless, so the layouts can be compared
                Image.fromarray(arr).save(root / "images" / name)
                rows.append(f"{name},{wnid}")
        (root / f"{split}.csv").write_text("\n".join(rows) + "\n")
    return root


def folder_layout(root: Path, data) -> Path:
    for split, classes in data.items():
        for wnid, images in classes.items():
            (root / split / wnid).mkdir(parents=True)
            for k, arr in enumerate(images):
                Image.fromarray(arr).save(root / split / wnid / f"{k}.png")
    return root


def cache_pickle_layout(root: Path, data) -> Path:
    root.mkdir(parents=True)
    for split, classes in data.items():
        images = np.concatenate(list(classes.values()))
        index = {w: list(range(4 * i, 4 * i + 4)) for i, w in enumerate(classes)}
        with open(root / f"mini-imagenet-cache-{split}.pkl", "wb") as f:
            pickle.dump({"image_data": images, "class_dict": index}, f)
    return root


def split_pickle_layout(root: Path, data) -> Path:
    root.mkdir(parents=True)
    names = {"train": "train_phase_train", "val": "val", "test": "test"}
    offset = {"train": 0, "val": 64, "test": 80}  # the labels of Lee et al.'s files
    for split, classes in data.items():
        images = np.concatenate(list(classes.values()))
        labels = [offset[split] + i for i in range(len(classes)) for _ in range(4)]
        with open(root / f"miniImageNet_category_split_{names[split]}.pickle", "wb") as f:
            pickle.dump({"data": images, "labels": labels}, f, protocol=2)
    return root


LAYOUTS = {
    "csv": csv_layout,
    "folders": folder_layout,
    "cache-pickle": cache_pickle_layout,
    "split-pickle": split_pickle_layout,
}


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_miniimagenet_layouts_give_the_same_classes(tmp_path, kind):
    data = source()
    root = LAYOUTS[kind](tmp_path / kind, data)
    assert layout(root) == kind
    fam = MiniImageNet(root, ways=2, shots=1, query=3)
    for split in ("train", "test"):
        expected = [torch.from_numpy(a).permute(0, 3, 1, 2) for a in data[split].values()]
        assert len(fam.pools[split]) == CLASSES[split]
        for got, want in zip(fam.pools[split], expected, strict=True):
            assert got.dtype == torch.uint8 and torch.equal(got, want)
    task = fam.task(0, 0, "test")
    assert task.support.x.shape == (2, 3, 84, 84) and task.query.x.shape == (6, 3, 84, 84)
    # Finn et al. 2017 on miniImageNet: 32 channels, five inner steps of 0.01.
    d = MiniImageNet.defaults
    assert (d["hidden"], d["inner_steps"], d["inner_lr"], d["query"]) == (32, 5, 0.01, 15)
    assert isinstance(fam.model()[0], nn.Conv2d) and fam.model()[0].in_channels == 3


def test_miniimagenet_images_of_another_size_are_resized(tmp_path):
    root = folder_layout(tmp_path / "small", source(side=40))
    fam = MiniImageNet(root, ways=2, shots=1, query=1)
    assert fam.pools["train"][0].shape == (4, 3, 84, 84)


def test_miniimagenet_wrong_layouts_are_named(tmp_path):
    with pytest.raises(LayoutError, match="does not exist; expected one of"):
        MiniImageNet(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LayoutError, match="is not in a miniImageNet layout; expected one of"):
        MiniImageNet(tmp_path / "empty")
    with pytest.raises(LayoutError, match="needs --data FOLDER"):
        make("miniimagenet", shots=1, query=1)
    data = source(side=8)
    root = csv_layout(tmp_path / "csv", data)
    (root / "images" / sorted((root / "images").iterdir())[0].name).unlink()
    with pytest.raises(LayoutError, match=r"1 image\(s\) named in .*test.csv are not in"):
        MiniImageNet(root)
    (root / "test.csv").write_text("file,class\nx.png,a\n")
    with pytest.raises(LayoutError, match="should have the columns filename,label"):
        MiniImageNet.check_data(str(root)) or MiniImageNet(root)
    root = folder_layout(tmp_path / "folders", data)
    for p in (root / "test").rglob("*.png"):
        p.unlink()
    with pytest.raises(LayoutError, match="holds no image"):
        MiniImageNet(root)
    root = cache_pickle_layout(tmp_path / "pkl", data)
    (root / "mini-imagenet-cache-test.pkl").unlink()
    with pytest.raises(LayoutError, match="cache-pickle layout but mini-imagenet-cache-test.pkl"):
        MiniImageNet(root)
    with open(root / "mini-imagenet-cache-test.pkl", "wb") as f:
        pickle.dump({"images": 1}, f)
    with pytest.raises(LayoutError, match="no image_data and class_dict"):
        MiniImageNet(root)
    # A pickle that would run code is refused, not run.
    with open(root / "mini-imagenet-cache-test.pkl", "wb") as f:
        pickle.dump({"image_data": print, "class_dict": {}}, f)
    with pytest.raises(LayoutError, match="refusing to load builtins.print"):
        MiniImageNet(root)


# --- the network and the baseline --------------------------------------------------------------


def test_conv4_with_and_without_batchnorm():
    torch.manual_seed(0)
    bn = ConvNet(28, 5, hidden=8, norm="batch")
    layers = [m for m in bn if isinstance(m, nn.BatchNorm2d)]
    # Four blocks (28 -> 14 -> 7 -> 3 -> 1), each normalised by its batch's statistics only.
    assert len(layers) == 4 and all(m.running_mean is None for m in layers)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in ConvNet(28, 5, hidden=8, norm="none"))
    assert bn(torch.rand(6, 1, 28, 28)).shape == (6, 5)
    with pytest.raises(ValueError, match="unknown norm 'group'; choose from batch, none"):
        ConvNet(28, 5, norm="group")


def test_nearest_mean_baseline():
    # Two classes whose support means are 0 and 1 everywhere; queries at 0.2, 0.45 (class 0) and
    # 0.55, 0.9 labelled 0, 1: the nearest mean gets three of four right.
    xs = torch.stack([torch.zeros(1, 2, 2), torch.ones(1, 2, 2)])
    xq = torch.stack([torch.full((1, 2, 2), v) for v in (0.2, 0.45, 0.55, 0.9)])
    task = Task(
        Batch(xs, torch.tensor([0, 1]), 2),
        Batch(xq, torch.tensor([0, 0, 0, 1]), 4),
    )
    assert nearest_mean_accuracy(task) == 0.75
