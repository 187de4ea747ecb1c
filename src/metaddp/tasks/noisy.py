"""Data reweighting under label noise, on scikit-learn's handwritten digits (no download).

The 1797 digits (8x8, ten classes) are split once, the same for every run: 600 test images,
100 clean *meta* images, and 1097 training images of which a fraction ``noise`` carry a wrong label,
drawn uniformly from the nine others (symmetric noise, as in Shu et al. 2019). "Task" ``i``
of the training stream is one outer step's data: a batch of ``shots`` training images (the
inner, noisy batch) and ``query`` meta images (the outer, clean batch). Test "task" ``i`` is
the ``i``-th block of 50 test images, scored on the network as trained (no adaptation).

``keep="clean"`` trains on the clean training images alone: the oracle that knows which labels
were flipped, the bound a reweighting can approach.

``noisy-run`` (:class:`NoisyRun`) is the same data as a bilevel problem whose inner problem is
a whole training run: every "task" is the whole noisy training set (the inner problem's data,
drawn in minibatches of ``shots`` per inner step) and the 100 clean meta images (the outer
batch); test task ``i`` is the training set and the ``i``-th block of test images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._data import Batch, Task, generator_for
from .._types import MetaAlgorithm
from ._family import TaskFamily
from .digits import load

TEST, META = 600, 100
TEST_BATCH = 50
KEEPS = ("all", "clean")
SPLIT_STREAM = 97  # the split's own generator stream, apart from the batches'


class NoisyDigits(TaskFamily):
    """Ten-class digits with a fraction of the training labels flipped."""

    name: ClassVar[str] = "noisy-digits"
    classification: ClassVar[bool] = True
    test_tasks: ClassVar[int | None] = TEST // TEST_BATCH
    defaults: ClassVar[dict[str, Any]] = {
        "ways": 10,
        "shots": 32,
        "query": 32,
        "hidden": 64,
        "meta_batch": 1,
        "inner_steps": 1,
        "inner_lr": 0.1,
        "outer_lr": 0.001,
        "eval_steps": 0,
        "eval_tasks": TEST // TEST_BATCH,
        "noise": 0.4,
        "keep": "all",
    }

    def __init__(
        self,
        ways: int = 10,
        shots: int = 32,
        query: int = 32,
        hidden: int = 64,
        noise: float = 0.4,
        keep: str = "all",
    ) -> None:
        if ways != 10:
            raise ValueError(f"noisy-digits classifies all ten digits: drop --ways {ways}")
        if not 0 <= noise < 0.9:
            raise ValueError(f"noise is the fraction of flipped labels, in [0, 0.9), got {noise}")
        if keep not in KEEPS:
            raise ValueError(f"keep must be one of {', '.join(KEEPS)}, got {keep!r}")
        self.shots, self.query, self.hidden = shots, query, hidden
        self.noise, self.keep = float(noise), keep
        images, labels = load()
        # One split and one set of flipped labels for every run: the dataset, not the seed.
        g = generator_for(0, SPLIT_STREAM, 0)
        order = torch.randperm(len(labels), generator=g)
        test, meta, train = order[:TEST], order[TEST : TEST + META], order[TEST + META :]
        flipped = torch.rand(len(train), generator=g) < noise
        shift = torch.randint(1, 10, (len(train),), generator=g)
        noisy = torch.where(flipped, (labels[train] + shift) % 10, labels[train])
        keep_rows = ~flipped if keep == "clean" else torch.ones_like(flipped)
        self.x = {
            "train": images[train][keep_rows].flatten(1),
            "meta": images[meta].flatten(1),
            "test": images[test].flatten(1),
        }
        self.y = {"train": noisy[keep_rows], "meta": labels[meta], "test": labels[test]}
        self.flipped = flipped[keep_rows]
        """Which training images carry a wrong label (for figures; training never reads it)."""

    def describe(self) -> dict[str, Any]:
        return {"noise": self.noise, "keep": self.keep}

    def task(self, seed: int, index: int, split: str = "train") -> Task:
        if split == "test":
            if not 0 <= index < TEST // TEST_BATCH:
                raise ValueError(
                    f"noisy-digits has {TEST // TEST_BATCH} test batches of {TEST_BATCH} images "
                    f"(--eval-tasks at most {TEST // TEST_BATCH}), got index {index}"
                )
            rows = slice(index * TEST_BATCH, (index + 1) * TEST_BATCH)
            x, y = self.x["test"][rows], self.y["test"][rows]
            # The support is never adapted on (eval_steps 0): the test batch itself.
            return Task(Batch(x, y, TEST_BATCH), Batch(x, y, TEST_BATCH))
        return super().task(seed, index, split)

    def sample(self, generator: torch.Generator, split: str) -> Task:
        def draw(pool: str, n: int) -> Batch:
            rows = torch.randperm(len(self.y[pool]), generator=generator)[:n]
            return Batch(self.x[pool][rows], self.y[pool][rows], len(rows))

        return Task(draw("train", self.shots), draw("meta", self.query))

    def _training_losses(self, algorithm: MetaAlgorithm, x: Tensor, y: Tensor) -> Tensor:
        """Each training image's loss under the network the weighting sees (as trained)."""
        with torch.no_grad():
            return self.loss(algorithm(x), y)

    def model(self) -> nn.Module:
        h = self.hidden
        return nn.Sequential(
            nn.Linear(64, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)
        )

    def loss(self, prediction: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(prediction, target, reduction="none")

    def plots(
        self,
        algorithm: MetaAlgorithm,
        *,
        seed: int,
        folder: Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> list[Path]:
        """The learned weight of a training image against its loss, and the weights the
        clean and the flipped training images get (a reweighting run only)."""
        weights = getattr(algorithm, "weights", None)
        if not isinstance(weights, nn.Module):
            return []
        from .._output import pyplot

        x = self.x["train"].to(device=device, dtype=dtype)
        losses = self._training_losses(algorithm, x, self.y["train"].to(device))
        with torch.no_grad():
            w = weights(losses).float().cpu()
            grid = torch.linspace(0, float(losses.max()) * 1.05, 200, dtype=dtype, device=device)
            curve = weights(grid).float().cpu()
        plt = pyplot()
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        left.plot(grid.float().cpu(), curve)
        left.set(xlabel="training loss of an image", ylabel="learned weight", title="weighting")
        for name, mask in (("clean label", ~self.flipped), ("flipped label", self.flipped)):
            if mask.any():
                right.hist(w[mask].numpy(), bins=30, alpha=0.6, label=name)
        right.set(xlabel="weight", ylabel="training images", title="weights of the training set")
        right.legend()
        fig.tight_layout()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "weights.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return [path]


class NoisyRun(NoisyDigits):
    """Data weights learned through a whole training run: the inner problem is ``inner_steps``
    minibatch steps of training from the network's initialisation, the outer loss the trained
    network's loss on the clean meta images. The network itself is never stepped; a
    weighting's hypergradient goes through every step of the run (``metaddp.Replay``)."""

    name: ClassVar[str] = "noisy-run"
    run: ClassVar[bool] = True
    defaults: ClassVar[dict[str, Any]] = {
        **{k: v for k, v in NoisyDigits.defaults.items() if k != "eval_steps"},  # the run's T
        "algorithm": "reweight",
        "shots": 32,  # the minibatch of every inner step
        "query": META,  # every clean meta image, each outer step
        "hidden": 32,
        "inner_steps": 200,  # T: the training run's length
        "inner_lr": 0.1,
        "inner_optimizer": "momentum",
        "memory": "replay",  # under an unrolled hypergradient (the others: "default")
        "outer_lr": 0.01,
        "steps": 100,  # each a whole run and its replay: about a second on a CPU core
        "eval_every": 25,
        "checkpoint_every": 25,
    }

    def __init__(
        self,
        ways: int = 10,
        shots: int = 32,
        query: int = META,
        hidden: int = 32,
        noise: float = 0.4,
        keep: str = "all",
    ) -> None:
        if query != META:
            raise ValueError(
                f"noisy-run scores every step on all {META} clean meta images: drop --query {query}"
            )
        super().__init__(ways, shots, query, hidden, noise, keep)
        if shots > len(self.y["train"]):
            raise ValueError(
                f"--shots {shots} is each inner step's minibatch, from {len(self.y['train'])} "
                "training images: give fewer"
            )

    def task(self, seed: int, index: int, split: str = "train") -> Task:
        if split == "test":
            _, query = super().task(seed, index, "test")
            return Task(self._training_set(), query)
        return super().task(seed, index, split)

    def sample(self, generator: torch.Generator, split: str) -> Task:
        # The same problem every outer step: the run's minibatches are drawn by the inner
        # steps themselves (metaddp.bilevel.Minibatches), from the run's seed.
        return Task(self._training_set(), Batch(self.x["meta"], self.y["meta"], META))

    def _training_losses(self, algorithm: MetaAlgorithm, x: Tensor, y: Tensor) -> Tensor:
        """Each training image's loss at the end of a run with the learned weighting."""
        fast = algorithm.adapt(Batch(x, y, len(y)), self.loss)
        with torch.no_grad():
            return self.loss(algorithm(x, {k: v.detach() for k, v in fast.items()}), y)

    def _training_set(self) -> Batch:
        return Batch(self.x["train"], self.y["train"], len(self.y["train"]))

    def model(self) -> nn.Module:
        h = self.hidden
        return nn.Sequential(nn.Linear(64, h), nn.Tanh(), nn.Linear(h, 10))
