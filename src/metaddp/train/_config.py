"""The settings of a training run: defaults, per-task defaults, TOML files, and what must match
for a run to be resumed."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import textwrap
import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..algorithms import ALGORITHMS, METHODS, having
from ..algorithms.registry import INNER_OPTIMIZERS as _BY_NAME
from ..algorithms.registry import SUPPORTS
from ..tasks import FAMILIES, NORMS, TaskFamily, family_class, make
from ..tasks.noisy import KEEPS

if TYPE_CHECKING:
    from ..algorithms import Algorithm, Settings

DTYPES = ("float32", "float64")
LAYOUTS = ("sample", "task", "hybrid")
MEMORY_MODES = ("default", "low", "replay")
INNER_OPTIMIZERS = tuple(_BY_NAME)  # the registry's names
AUTOCASTS = ("bf16", "fp16")
OUTER_SCHEDULES = ("constant", "cosine")
CLASSIFIERS = ("protonet", "protomaml")  # algorithms whose loss needs classes
# Which algorithms fit which tasks, declared once: the bilevel ones (data reweighting and the
# plain training it is measured against) train the task that is a bilevel problem, and adapt
# nothing; the classifiers need every class in every support, which N-way K-shot tasks hold and
# the bilevel task's random batches may not; the other (meta-learning) algorithms train any task.
BILEVEL = ("reweight", "erm")
BILEVEL_TASKS = ("noisy-digits", "noisy-run")
# A task whose inner problem is a whole training run takes only what learns through one.
RUN_ALGORITHMS = ("reweight",)
RUN_METHODS = ("unrolled", "truncated")  # the methods that differentiate a run step by step
# The settings a task family fills (--show-settings and the help's table print them).
SHOWN = ("meta_batch", "inner_steps", "inner_lr", "outer_lr", "shots", "query", "ways", "hidden")


def setting(
    default: Any,
    text: str,
    *,
    choices: Collection[str] | None = None,
    flags: str | None = "train",
    identity: bool = True,
    fallback: Any = None,
    metavar: str | None = None,
    negatable: bool = False,
) -> Any:
    """A field of :class:`TrainConfig`: a setting declared once. ``text`` says what it does
    (its flag's help in ``metaddp train --help`` and its entry in the class's docstring, which
    names the other settings by their flags, ``--inner-steps``), ``choices`` the values it takes,
    ``fallback`` its default where the task family sets none; ``identity``: a checkpoint resumes
    only under the same value; ``flags``: the help's group of its flag (``None``: no flag),
    ``metavar`` the flag's placeholder, ``negatable`` whether a ``--no-`` flag turns it off.
    The default is said after the text, unless the text names it ``(the default)``."""
    shown = default if default is not None else fallback
    if shown is not None and not isinstance(shown, bool) and "(the default" not in text:
        text += f" (default: {shown})"
    return dataclasses.field(
        default=default,
        metadata={
            "help": text,
            "choices": choices,
            "flags": flags,
            "identity": identity,
            "fallback": fallback,
            "metavar": metavar,
            "negatable": negatable,
        },
    )


def _all_but(capability: str) -> str:
    """Which algorithms declare ``capability``: "every algorithm", or "every algorithm but ..."."""
    left = [a for a in ALGORITHMS if a not in having(capability)]
    return "every algorithm" + (" but " + ", ".join(left) if left else "")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # The docstring is written from the fields' texts (below the class).

    task: str = setting(
        "sinusoid", "task family, taken from the run when resuming", choices=FAMILIES, flags=None
    )
    algorithm: str | None = setting(
        None,
        "the algorithm; noisy-run trains reweight only, and ttt defaults to anil",
        choices=ALGORITHMS,
        fallback="maml",
    )
    steps: int | None = setting(
        None,
        "outer steps in total, a resumed run's included",
        identity=False,
        fallback=1000,
    )
    meta_batch: int | None = setting(None, "tasks per outer step")
    inner_steps: int | None = setting(None, "adaptation steps per task in training")
    inner_lr: float | None = setting(None, "inner (adaptation) learning rate")
    outer_lr: float | None = setting(None, "Adam's learning rate for the meta-parameters")
    outer_schedule: str = setting(
        "constant",
        "constant, or cosine: the outer rate anneals from --outer-lr to 0 over --steps (cosine "
        "annealing without restarts, as MAML++ trains)",
        choices=OUTER_SCHEDULES,
    )
    lam: float = setting(1.0, "iMAML's proximal strength (the implicit system is I + H / lam)")
    shots: int | None = setting(None, "support samples per task (per class for classification)")
    query: int | None = setting(None, "query samples per task (per class for classification)")
    ways: int | None = setting(None, "classes per task (classification tasks only)")
    hidden: int | None = setting(None, "width of the network")
    layout: str = setting(
        "sample",
        "how processes share a meta-batch. sample: every process splits every task; task: tasks "
        "split over processes; hybrid: two task groups, each splitting its tasks",
        choices=LAYOUTS,
        flags="processes",
        identity=False,
    )
    seed: int = setting(0, "seeds the network's initialisation and the task stream")
    dtype: str = setting("float32", "the run's floating-point type", choices=DTYPES)
    eval_every: int | None = setting(
        None,
        "evaluate on held-out tasks every this many steps (0: only at the end of the run)",
        flags="output",
        identity=False,
        fallback=100,
    )
    eval_tasks: int | None = setting(
        None,
        "held-out tasks per evaluation (default: 100; noisy-digits: its 12 test batches)",
        flags="output",
        identity=False,
    )
    eval_steps: int | None = setting(
        None,
        "adaptation steps at evaluation (default: --inner-steps)",
        flags="output",
        identity=False,
    )
    checkpoint_every: int | None = setting(
        None,
        "write a checkpoint every this many steps, and at the end",
        flags="output",
        identity=False,
        fallback=100,
    )
    data: str | None = setting(
        None, "dataset folder (omniglot, miniimagenet), or the glyph cache folder (glyphs)"
    )
    memory: str | None = setting(
        None,
        "default (the default; noisy-run: replay): keep every inner step's graph; low: "
        "rebuild them one at a time in the backward, the same meta-gradient in memory that "
        "does not grow with --inner-steps; replay: keep a tree of O(log) of the steps' "
        "weights, not every step's (metaddp.Replay)",
        choices=MEMORY_MODES,
        identity=False,
        fallback="default",
    )
    inner_optimizer: str | None = setting(
        None,
        "the differentiable inner optimizer, at --inner-lr",
        choices=INNER_OPTIMIZERS,
        fallback="sgd",
    )
    inner_clip: float | None = setting(
        None,
        "clip every inner gradient to this global norm before the inner optimizer (the whole "
        "task's gradient, on any number of processes; default: no clipping)",
        metavar="NORM",
    )
    autocast: str | None = setting(
        None,
        "forward passes under torch.autocast in this precision, meta-gradients in --dtype "
        f"({_all_but('autocast')}; default: off)",
        choices=AUTOCASTS,
    )
    norm: str | None = setting(
        None,
        "image tasks: batch (the default), BatchNorm in every block, synchronized over the "
        "processes that share a task, or none",
        choices=NORMS,
    )
    fonts: str | None = setting(
        None,
        "glyphs: all (the default: matplotlib's and the system's fonts), matplotlib, or the "
        "identity of a font set (file names and hashes), as a run records it: a resume checks "
        "that they are all here",
    )
    deterministic: bool = setting(
        False,
        "the same bits at any --nproc and --layout: weights, losses and evaluations "
        f"(MetaDDP(deterministic=True); {_all_but('deterministic')}; costs in BENCHMARKS.md)",
    )
    chunks: int = setting(
        8,
        "with --deterministic: the most chunks a batch is cut into; keep it fixed across the "
        "runs to compare",
    )
    cuda_graphs: bool | None = setting(
        None,
        "record the meta-step once in a CUDA graph and replay it "
        "(metaddp.distributed.CapturedStep): the same arithmetic, less launch cost "
        f"({_all_but('capture')}; CUDA, one process or NCCL). By default on wherever the run "
        "can; --cuda-graphs requires it (an error where it cannot), --no-cuda-graphs turns it "
        "off",
        identity=False,
        negatable=True,
    )
    shard: bool = setting(
        False,
        "keep only each process's rows of the meta-parameters, their gradients and Adam's "
        "state, cut over the processes that split each task (ZeRO-3, MetaDDP(shard=True); "
        f"{_all_but('sharded')}): the same numbers, to rounding, in 1/N of the memory for them. "
        "Needs --layout sample, or hybrid with more than one process per task group (4 or more "
        "processes); on one process it cuts nothing. Checkpoints are then sharded "
        "(torch.distributed.checkpoint) and resume at any --nproc; --no-shard resumes one "
        "replicated",
        flags="processes",
        identity=False,
        negatable=True,
    )
    noise: float | None = setting(
        None, "noisy-digits: the fraction of training labels flipped (default: 0.4)"
    )
    keep: str | None = setting(
        None,
        "noisy-digits: train on all images (the default) or on the clean ones only (the oracle)",
        choices=KEEPS,
    )
    method: str | None = setting(
        None, "reweight: the hypergradient method (default: unrolled)", choices=METHODS
    )

    # Settings that define the trajectory (a checkpoint resumes only under the same ones), from
    # the fields: the number of processes, the layout, the length of the run and evaluation may
    # change.
    IDENTITY: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        for k, v in self.to_dict().items():
            check_type(k, v)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, Any], source: str, flags: Collection[str] = ()
    ) -> dict[str, Any]:
        """Check the keys and value types of a config file (or dict); return them as a dict.
        ``flags``: the names of the command's flags that are not settings (``nproc``)."""
        if not isinstance(values, Mapping):
            raise ValueError(
                f"{source}: expected settings by name (a table), got a {type(values).__name__}"
            )
        unknown = sorted(set(values) - set(cls.names()))
        if given := [k for k in unknown if k in flags]:
            words = ", ".join(f"--{k.replace('_', '-')}" for k in given)
            raise ValueError(
                f"{source}: {', '.join(given)} {'is a flag' if len(given) == 1 else 'are flags'} "
                f"of the command line ({words}), not a setting a config file holds: give "
                f"{'it' if len(given) == 1 else 'them'} on the command line"
            )
        if unknown:
            raise ValueError(
                f"{source}: unknown setting(s) {', '.join(unknown)}; known: "
                f"{', '.join(cls.names())}"
            )
        for k, v in values.items():
            try:
                check_type(k, v)
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None
        return dict(values)

    def resolved(self) -> TrainConfig:
        """Fill the unset settings with the task family's defaults and check every value."""
        cls = family_class(self.task)
        filled: dict[str, Any] = {
            k: cls.defaults.get(k) if v is None and k not in ("data", "fonts", "method") else v
            for k, v in dataclasses.asdict(self).items()
        }
        if not cls.classification:
            if self.ways is not None:
                raise ValueError(f"ways is a setting of classification tasks, not of {self.task}")
            filled["ways"] = None
        cls.refuse_unread_data(self.data)
        if "norm" not in cls.defaults and self.norm is not None:
            raise ValueError(f"norm is a setting of the image tasks, not of {self.task}")
        # The fonts' identity replaces "all" or "matplotlib"; a recorded one must be found here.
        filled["fonts"] = cls.font_set(self.fonts)
        for k, v in FALLBACK.items():  # where the task family has no default of its own
            if filled[k] is None:
                filled[k] = v
        if filled["algorithm"] == "reweight" and filled["method"] is None:
            filled["method"] = "unrolled"
        if self.memory is None and (
            filled["method"] not in (None, "unrolled") or self.deterministic
        ):
            # A family's tree of states is for the unrolled method, in the default mode.
            filled["memory"] = "default"
        if filled["eval_tasks"] is None:
            filled["eval_tasks"] = cls.defaults.get("eval_tasks", 100)
        if filled["eval_steps"] is None:
            filled["eval_steps"] = filled["inner_steps"]
        cfg = TrainConfig(**filled)
        cfg.check()
        if cls.test_tasks is not None and filled["eval_tasks"] > cls.test_tasks:
            raise ValueError(
                f"{self.task} has {cls.test_tasks} test batches of held-out data: eval_tasks at "
                f"most {cls.test_tasks}, got {filled['eval_tasks']}"
            )
        return cfg

    @staticmethod
    def algorithms_for(task: str) -> tuple[str, ...]:
        """The algorithms that train ``task`` (:data:`BILEVEL`, :data:`CLASSIFIERS`)."""
        family = family_class(task)
        if family.run:
            return RUN_ALGORITHMS
        return tuple(
            a
            for a in ALGORITHMS
            if (a not in BILEVEL or task in BILEVEL_TASKS)
            and (a not in CLASSIFIERS or (family.classification and task not in BILEVEL_TASKS))
        )

    @staticmethod
    def adapts(algorithm: str | None) -> bool:
        """Whether ``algorithm`` adapts to each task (meta-learning), rather than training one
        network on weighted or plain batches (:data:`BILEVEL`)."""
        return algorithm not in BILEVEL

    def lines(self) -> list[str]:
        """The resolved settings in two lines (the start of a run, ``--show-settings``)."""
        eval_note = (
            f"every {self.eval_every} steps and at the end"
            if self.eval_every
            else "at the end only (eval_every 0)"
        )
        what = ", ".join(
            f"{k} {getattr(self, k)}"
            for k in ("steps", *SHOWN, "seed", "dtype")
            if getattr(self, k) is not None
        )
        how = ", ".join(
            f"{k.replace('_', ' ')} {getattr(self, k)}"
            for k, plain in (("method", None), ("inner_optimizer", "sgd"), ("memory", "default"))
            if getattr(self, k) != plain
        )
        return [
            f"{self.algorithm} on {self.task}: {what}" + (f"; {how}" if how else ""),
            f"evaluation on {self.eval_tasks} held-out tasks ({self.eval_steps} adaptation "
            f"steps) {eval_note}; "
            f"checkpoint every {self.checkpoint_every} steps; layout {self.layout}",
        ]

    @classmethod
    def defaults_table(cls) -> str:
        """Each task's default settings, one row per task (the help's epilog)."""
        rows: list[tuple[str, ...]] = [("task", *SHOWN, "eval_steps", "algorithms")]
        for task in FAMILIES:
            d = dict(family_class(task).defaults)
            d.setdefault("eval_steps", d.get("inner_steps"))
            takes = cls.algorithms_for(task)
            left = [a for a in ALGORITHMS if a not in takes]
            rows.append(
                (
                    task,
                    *(str(d.get(k, "-")) for k in (*SHOWN, "eval_steps")),
                    "all but " + ", ".join(left) if left else "all",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        return "\n".join(
            "  " + " ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + " " + r[-1]
            for r in rows
        )

    def check(self) -> None:
        for f in SETTINGS:  # the values a setting takes; None where its default is the task's
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices is not None and value not in choices:
                if value is None and f.metadata["fallback"] is None:
                    continue
                what = "memory mode" if f.name == "memory" else f.name.replace("_", " ")
                raise ValueError(f"unknown {what} {value!r}; choose from {', '.join(choices)}")
        if self.inner_clip is not None and not self.inner_clip > 0:
            raise ValueError(f"inner_clip must be a norm > 0, got {self.inner_clip!r}")
        if self.method is not None:
            if self.algorithm != "reweight":
                raise ValueError(
                    f"method is the hypergradient of reweight, not of {self.algorithm}"
                )
            if family_class(self.task).run and self.method not in RUN_METHODS:
                raise ValueError(
                    f"{self.task}'s inner problem is a training run of minibatch steps, which "
                    f"{self.method} cannot differentiate (it reads one inner objective at the "
                    f"solution): choose --method {' or '.join(RUN_METHODS)}"
                )
        if self.algorithm in CLASSIFIERS and self.algorithm not in self.algorithms_for(self.task):
            raise ValueError(
                f"{self.algorithm} scores classes against their prototypes, made from every "
                f"class's support samples: it trains on N-way K-shot tasks, not {self.task}"
            )
        if self.task == "noisy-digits" and self.eval_steps:
            raise ValueError(
                "noisy-digits scores the trained network as it is: eval_steps must be 0, got "
                f"{self.eval_steps}"
            )
        if family_class(self.task).run and not self.eval_steps:
            raise ValueError(
                f"{self.task} scores a training run of eval_steps steps (with and without what "
                "was learned): eval_steps must be >= 1, got 0"
            )
        positive = (
            "steps",
            "meta_batch",
            "shots",
            "query",
            "hidden",
            "eval_tasks",
            "checkpoint_every",
            "chunks",
            "inner_steps",
        )
        for k in positive:
            if getattr(self, k) is None or getattr(self, k) < 1:
                raise ValueError(f"{k} must be a positive integer, got {getattr(self, k)!r}")
        for k in ("eval_every", "eval_steps"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} must be >= 0, got {getattr(self, k)!r}")
        if not -(2**63) <= self.seed < 2**64:  # what torch.manual_seed takes
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        # What each algorithm offers is declared on its class (metaddp.algorithms.Supports).
        for k, plain, capability in (
            ("inner_optimizer", "sgd", "inner_optimizer"),
            ("inner_clip", None, "inner_optimizer"),
            ("autocast", None, "autocast"),
        ):
            if getattr(self, k) != plain and self.algorithm not in having(capability):
                raise ValueError(
                    f"{k} is a setting of {', '.join(having(capability))}, not of {self.algorithm}"
                )
        if self.memory != "default" and self.algorithm not in having("low_memory"):
            reason = dict(SUPPORTS[str(self.algorithm)].why).get("low_memory", "")
            raise ValueError(
                f"memory={self.memory!r} is not a setting of {self.algorithm}"
                + (f" ({reason})" if reason else "")
                + f"; it is one of {', '.join(having('low_memory'))}"
            )
        # memory low with autocast fp16: the built algorithm refuses it where its steps are
        # rebuilt without the loss scaling (second order), and runs it where they are not.
        if self.deterministic:
            if self.algorithm not in having("deterministic"):
                raise ValueError(
                    f"deterministic runs train {', '.join(having('deterministic'))}, not "
                    f"{self.algorithm}"
                )
            if self.memory != "default" or self.autocast is not None:
                raise ValueError(
                    "deterministic runs keep every inner step's graph in the run's dtype: "
                    "drop memory/autocast"
                )
        if self.shard and (why := self._not_shardable()):
            raise ValueError(why)
        if self.cuda_graphs:
            if why := self._not_recordable():
                raise ValueError(why)
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    "cuda_graphs records CUDA graphs: no CUDA device is available (leave it "
                    "out, or resume such a run with --no-cuda-graphs)"
                )
        for k in ("inner_lr", "outer_lr", "lam"):
            if not (getattr(self, k) > 0 and math.isfinite(getattr(self, k))):
                raise ValueError(f"{k} must be a positive finite number, got {getattr(self, k)!r}")
        if self.algorithm not in (takes := self.algorithms_for(self.task)):
            raise ValueError(
                f"{self.algorithm} does not train {self.task}: {self.task} takes {', '.join(takes)}"
            )

    def _not_shardable(self) -> str | None:
        """Why these settings' meta-parameters cannot be sharded, or ``None``. What only the
        built algorithm knows is asked of it too (:meth:`check_algorithm`)."""
        if self.algorithm not in having("sharded"):
            return (
                f"shard cuts the meta-parameters of {', '.join(having('sharded'))}, not of "
                f"{self.algorithm}: drop shard"
            )
        if self.deterministic:
            return (
                "deterministic runs hold every weight whole on every process: drop shard or "
                "deterministic"
            )
        if self.inner_clip is not None:
            return (
                "inner_clip clips by the norm of whole inner gradients, of which a sharded "
                "process holds its rows only: drop inner_clip or shard"
            )
        if self.autocast == "fp16":
            return (
                "autocast fp16 scales the inner loss and skips a step by a verdict over every "
                "entry, of which a sharded process holds its rows only: use autocast bf16, or "
                "drop shard"
            )
        if self.method not in (None, "unrolled"):
            return (
                f"{self.method} takes norms and dot products of whole vectors, of which a "
                "sharded process holds its rows only: shard takes method unrolled"
            )
        return None

    def build(self, model: Any) -> Algorithm:
        """This run's algorithm around ``model`` (a resolved configuration's)."""
        from ..algorithms import build

        assert self.algorithm is not None, "resolve the settings first"
        return build(self.algorithm, model, self.algorithm_settings())

    def check_algorithm(self, algorithm: Any) -> None:
        """The rules that need the built algorithm: with :attr:`shard` or
        :attr:`deterministic`, its own refusal of the mode (``Algorithm.sharded_refusal``,
        ``Algorithm.deterministic_refusal``)."""
        for on, rule in ((self.shard, "sharded"), (self.deterministic, "deterministic")):
            refusal = getattr(algorithm, f"{rule}_refusal", None)
            if on and callable(refusal) and (why := refusal()) is not None:
                raise ValueError(f"{'shard' if rule == 'sharded' else rule}: {why}")

    def samples_per_task(self, world: int) -> int:
        """How many processes split each task on ``world`` processes under :attr:`layout`
        (``Mesh.for_layout``)."""
        if self.layout == "task":
            return 1
        if self.layout == "hybrid" and world % 2 == 0:
            return world // 2
        return world

    def _not_recordable(self) -> str | None:
        """Why these settings' meta-step cannot be recorded in a CUDA graph, or ``None``."""
        if self.algorithm not in having("capture"):
            return f"cuda_graphs records {', '.join(having('capture'))} steps, not {self.algorithm}"
        if self.deterministic:
            return "deterministic runs keep per-step state on the host: drop cuda_graphs"
        if self.shard:
            return "the sharded layout's gathers are not recorded in CUDA graphs: drop cuda_graphs"
        if self.method == "implicit-cg":
            return (
                "implicit-cg's conjugate gradient reads its residual on the host, which a "
                "CUDA graph cannot record: drop cuda_graphs or use another --method"
            )
        if self.task in ("sequences", "ttt"):
            return (
                f"the {self.task} task's transformer draws dropout masks keyed by the meta-step, "
                "which a CUDA graph would replay unchanged: drop cuda_graphs"
            )
        return None

    def records_graphs(self, device: Any) -> bool:
        """Whether a run on ``device`` records its meta-step in a CUDA graph: where asked, or
        by default wherever it can (CUDA, an algorithm and settings a graph can record, and
        not check mode, whose hooks read the host)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        from ..distributed import check_mode_from_env

        return (
            device.type == "cuda" and self._not_recordable() is None and not check_mode_from_env()
        )

    def check_for(self, asked: Collection[str], world: int) -> None:
        """The rules that need more than the settings' values: which of them were ``asked``
        for (settings with a value either way, which only some runs read: set for another
        run, refused) and the number of processes ``world`` the run starts on."""
        if "lam" in asked and self.algorithm != "imaml":
            raise ValueError(f"lam is iMAML's proximal strength: {self.algorithm} does not take it")
        if "chunks" in asked and not self.deterministic:
            raise ValueError("chunks cuts batches in deterministic runs only: add --deterministic")
        if self.layout == "hybrid" and world > 1 and world % 2:
            raise ValueError(
                f"--layout hybrid makes two task groups of equal size, which {world} processes "
                "cannot form: start an even number of processes, or use --layout sample or task"
            )
        if self.shard and world > 1 and self.samples_per_task(world) == 1:
            raise ValueError(
                f"shard cuts the meta-parameters over the processes that split each task, and "
                f"--layout {self.layout} on {world} processes gives every task to one process: "
                "use --layout sample, or hybrid with more than one process per task group (4 or "
                "more processes), or drop shard (--no-shard)"
            )

    def family(self) -> TaskFamily:
        """The task family these settings describe (building it runs the family's checks,
        e.g. enough classes for ``ways``)."""
        assert self.shots is not None and self.query is not None  # filled by resolved()
        return make(
            self.task,
            shots=self.shots,
            query=self.query,
            ways=self.ways,
            hidden=self.hidden,
            data=self.data,
            norm=self.norm,
            fonts=self.fonts,
            noise=self.noise,
            keep=self.keep,
        )

    def algorithm_settings(self) -> Settings:
        """What the algorithm registry builds this run's algorithm with."""
        from ..algorithms import Settings

        assert self.inner_lr is not None and self.inner_steps is not None
        assert self.memory is not None and self.inner_optimizer is not None
        # iMAML's CG residual cannot fall far below the dtype's precision.
        return Settings(
            inner_lr=self.inner_lr,
            steps=self.inner_steps,
            lam=self.lam,
            cg_steps=25,
            cg_tol=1e-10 if self.dtype == "float64" else 1e-6,
            memory=self.memory,
            optimizer=self.inner_optimizer,
            clip=self.inner_clip,
            ways=self.ways,
            schedule_steps=self.steps,
            autocast=self.autocast,
            method=self.method or "unrolled",
            minibatch=self.shots if family_class(self.task).run else None,
            seed=self.seed,
        )

    def outer_lr_at(self, step: int) -> float:
        """The outer learning rate of step ``step`` (0-based) under :attr:`outer_schedule`:
        a function of the step alone, so a resumed run continues the same schedule."""
        assert self.outer_lr is not None and self.steps is not None
        if self.outer_schedule == "constant":
            return self.outer_lr
        return 0.5 * self.outer_lr * (1 + math.cos(math.pi * step / self.steps))

    def identity(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.IDENTITY}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SETTINGS = dataclasses.fields(TrainConfig)
TrainConfig.IDENTITY = tuple(f.name for f in SETTINGS if f.metadata["identity"])
# The settings' defaults where a task family sets none.
FALLBACK = {f.name: f.metadata["fallback"] for f in SETTINGS if f.metadata["fallback"] is not None}


def _docstring() -> str:
    """:class:`TrainConfig`'s docstring, from its fields' texts (naming settings, not flags)."""
    names = {f.name for f in SETTINGS}

    def named(flag: re.Match) -> str:
        name = flag[1].replace("-", "_")
        return f"``{name}``" if name in names else flag[0]

    lines = [
        "Everything that defines a training run (``None``: the task family's default); each",
        "setting is also one of ``metaddp train``'s (``inner_clip``: ``--inner-clip``).",
        "",
        "Args:",
    ]
    for f in SETTINGS:
        text = re.sub(r"--([a-z][a-z-]*)", named, f.metadata["help"])
        if f.metadata["choices"] is not None:
            text += f"; one of {', '.join(f.metadata['choices'])}"
        if not f.metadata["identity"]:
            text += "; not part of the identity: a resume may change it"
        lines.append(
            textwrap.fill(
                f"{f.name}: {text}.", 96, initial_indent="    ", subsequent_indent="        "
            )
        )
    return "\n".join(lines) + "\n"


TrainConfig.__doc__ = _docstring()


# What each setting holds, from the field's annotation ("int | None" -> int).
KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "str": ((str,), "a string"),
    "bool": ((bool,), "true or false"),
}


def check_type(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` has the type of setting ``name`` (a bool is not a
    number)."""
    annotation = str({f.name: f.type for f in SETTINGS}[name])
    if value is None and "None" in annotation:
        return
    kind = annotation.split(" | ")[0]
    types, what = KINDS[kind]
    if (isinstance(value, bool) and kind != "bool") or not isinstance(value, types):
        raise ValueError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")


def read_toml(path: str | Path, flags: Collection[str] = ()) -> dict[str, Any]:
    """Settings from a TOML file: ``key = value`` lines (the names of :class:`TrainConfig`),
    either all at top level or all under a ``[train]`` table. ``flags``: the names of the
    command's flags that are not settings (``nproc``), which a file naming one is told."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    table = isinstance(values.get("train"), dict)
    if table:
        others = sorted(k for k, v in values.items() if k != "train" and not isinstance(v, dict))
        if others:
            raise ValueError(
                f"config file {path} has {', '.join(others)} outside its [train] table, where "
                "they would be ignored: put every setting under [train], or drop the [train] line"
            )
    held = values["train"] if table else values
    tables = {k: v for k, v in values.items() if isinstance(v, dict) and v is not held}
    tables |= {f"train.{k}": v for k, v in held.items() if table and isinstance(v, dict)}
    if tables:  # e.g. [model] or [train.model]: a setting there would be ignored
        name, inside = min(tables.items())
        one = len(inside) == 1
        what = f"{', '.join(inside)} {'is' if one else 'are'} in" if inside else "there is an empty"
        where = "under [train]" if table else "at top level (or every setting under [train])"
        raise ValueError(
            f"config file {path}: {what} table [{name}], which metaddp train does not read: "
            f"put {'it' if one else 'settings'} {where}"
        )
    return TrainConfig.from_mapping(held, f"config file {path}", flags)


def toml_text(values: Mapping[str, Any]) -> str:
    """``key = value`` lines for strings, numbers and booleans (unset values left out)."""
    lines = []
    for k, v in values.items():
        if v is None:
            continue
        lines.append(f"{k} = {json.dumps(v) if isinstance(v, (str, bool)) else repr(v)}")
    return "\n".join(lines) + "\n"
