"""The settings of a training run: defaults, per-task defaults, TOML files, and what must match
for a run to be resumed."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..tasks import family_class

if TYPE_CHECKING:
    from ..algorithms import Settings

DTYPES = ("float32", "float64")
LAYOUTS = ("sample", "task", "hybrid")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (``None``: the task family's default).

    Args:
        task: task family ("sinusoid", "digits", "omniglot").
        algorithm: meta-learning algorithm ("maml", "fomaml", "metasgd", "anil", "reptile",
            "imaml").
        steps: outer steps to train for (in total, counting resumed ones).
        meta_batch: tasks per outer step.
        inner_steps: adaptation steps per task during training.
        inner_lr: inner (adaptation) learning rate.
        outer_lr: Adam's learning rate for the meta-parameters.
        lam: iMAML's proximal strength (the implicit system is I + H / lam).
        shots: support samples per task (per class for classification).
        query: query samples per task (per class for classification).
        ways: classes per task (classification only).
        hidden: width of the network.
        layout: how processes share a meta-batch: "sample" (every process splits every
            task), "task" (tasks split over processes) or "hybrid" (two task groups).
        seed: seeds the network's initialisation and the task stream.
        dtype: "float32" or "float64".
        eval_every: evaluate on held-out tasks every this many steps (0: only at the end).
        eval_tasks: held-out tasks per evaluation.
        eval_steps: adaptation steps at evaluation.
        checkpoint_every: write a checkpoint every this many steps (and at the end).
        data: dataset folder (omniglot).
    """

    task: str = "sinusoid"
    algorithm: str = "maml"
    steps: int = 1000
    meta_batch: int | None = None
    inner_steps: int | None = None
    inner_lr: float | None = None
    outer_lr: float | None = None
    lam: float = 1.0
    shots: int | None = None
    query: int | None = None
    ways: int | None = None
    hidden: int | None = None
    layout: str = "sample"
    seed: int = 0
    dtype: str = "float32"
    eval_every: int = 100
    eval_tasks: int = 100
    eval_steps: int | None = None
    checkpoint_every: int = 100
    data: str | None = None

    # Settings that define the trajectory: a checkpoint resumes only under the same ones.
    # The number of processes, the layout, the length of the run and evaluation may change.
    IDENTITY = (
        "task",
        "algorithm",
        "meta_batch",
        "inner_steps",
        "inner_lr",
        "outer_lr",
        "lam",
        "shots",
        "query",
        "ways",
        "hidden",
        "seed",
        "dtype",
        "data",
    )

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> dict[str, Any]:
        """Check the keys of a config file (or dict) and return them as a dict."""
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            raise ValueError(
                f"{source}: unknown setting(s) {', '.join(unknown)}; known: "
                f"{', '.join(cls.names())}"
            )
        return dict(values)

    def resolved(self) -> TrainConfig:
        """Fill the unset settings with the task family's defaults and check every value."""
        cls = family_class(self.task)
        filled: dict[str, Any] = {
            k: cls.defaults.get(k) if v is None and k != "data" else v
            for k, v in dataclasses.asdict(self).items()
        }
        if not cls.classification:
            filled["ways"] = None
        if filled["eval_steps"] is None:
            filled["eval_steps"] = filled["inner_steps"]
        cfg = TrainConfig(**filled)
        cfg.check()
        return cfg

    def check(self) -> None:
        from ..algorithms import ALGORITHMS

        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"unknown algorithm {self.algorithm!r}; choose from {', '.join(ALGORITHMS)}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose from {', '.join(LAYOUTS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        positive = ("steps", "meta_batch", "shots", "query", "eval_tasks", "checkpoint_every")
        for k in positive:
            if getattr(self, k) is None or getattr(self, k) < 1:
                raise ValueError(f"{k} must be a positive integer, got {getattr(self, k)!r}")
        for k in ("inner_steps", "eval_every", "eval_steps"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} must be >= 0, got {getattr(self, k)!r}")
        for k in ("inner_lr", "outer_lr", "lam"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k} must be positive, got {getattr(self, k)!r}")

    def algorithm_settings(self) -> Settings:
        """What the algorithm registry builds this run's algorithm with."""
        from ..algorithms import Settings

        assert self.inner_lr is not None and self.inner_steps is not None
        # iMAML's CG residual cannot fall far below the dtype's precision.
        return Settings(
            inner_lr=self.inner_lr,
            steps=self.inner_steps,
            lam=self.lam,
            cg_steps=25,
            cg_tol=1e-10 if self.dtype == "float64" else 1e-6,
        )

    def identity(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.IDENTITY}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_toml(path: str | Path) -> dict[str, Any]:
    """Settings from a TOML file of ``key = value`` lines (the names of :class:`TrainConfig`)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    values = values.get("train", values)  # a [train] table, or top-level keys
    return TrainConfig.from_mapping(values, str(path))


def toml_text(values: Mapping[str, Any]) -> str:
    """``key = value`` lines for strings, numbers and booleans (unset values left out)."""
    lines = []
    for k, v in values.items():
        if v is None:
            continue
        lines.append(f"{k} = {json.dumps(v) if isinstance(v, (str, bool)) else repr(v)}")
    return "\n".join(lines) + "\n"
