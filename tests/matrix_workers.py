"""The algorithm x mode x layout matrix, generated from the algorithms' declarations (each
class's ``supports``, MAML's ``stackable``, the constructors' parameters): every cell run on
this rank, as tests/test_matrix.py compares across world sizes."""

from __future__ import annotations

import dataclasses
import inspect

import torch

import metaddp as md
from metaddp.algorithms import MAML
from metaddp.testing import scenarios as S

ALGORITHMS = ("maml", "fomaml", "metasgd", "anil", "boil", "reptile", "imaml", "mamlpp", "protonet",
              "protomaml", "cavia")
MODES = ("loop", "stacked", "low", "deterministic", "sharded", "dropout", "check", "clone")
LAYOUTS = ("sample", "task")
CONV = {"protonet", "protomaml"}  # classification: the prototypes need classes


def problem(algorithm: str, mode: str, layout: str) -> S.Problem:
    p = S.Problem(model="conv" if algorithm in CONV else "mlp", algorithm=algorithm, layout=layout,
                  steps=2, n_tasks=3, n_support=7, n_query=5)
    return dataclasses.replace(p, memory="low" if mode == "low" else "default",
                               deterministic=mode == "deterministic", shard=mode == "sharded",
                               dropout=0.25 if mode == "dropout" else 0.0, check=mode == "check")


def offered(algorithm: str, mode: str) -> bool:
    """Whether the cell is a setting the algorithm takes at all: every constructor takes
    ``batched=`` and ``memory=`` (and refuses them, with its reason, where its class does not
    declare them: ``supports``); ``clone()`` is a method of the algorithms with inner steps."""
    alg = problem(algorithm, "loop", "sample").build_algorithm()
    if mode in ("stacked", "low"):
        return takes(type(alg), {"stacked": "batched", "low": "memory"}[mode])
    if mode == "clone":  # a hand loop over learner.clone(): the algorithms with inner steps to take
        try:
            alg.clone(reduce=lambda grads: grads)  # one process's: nothing to sum
        except TypeError:
            return False
    return True


def takes(cls: type, name: str) -> bool:
    """Whether ``cls(...)`` takes the keyword ``name``: in its own signature, or in one of
    the classes its ``**settings`` are passed on to."""
    for c in cls.__mro__:
        params = inspect.signature(c.__init__).parameters  # type: ignore[misc]
        if name in params:
            return True
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return False
    return False


def declared(algorithm: str, mode: str) -> bool:
    """Whether the algorithm's class declares the cell: a mode column of its ``supports``;
    stacked tasks where it is MAML's own loss (``stackable``)."""
    alg = problem(algorithm, "loop", "sample").build_algorithm()
    if mode == "stacked":
        return alg.supports.stacked and (not isinstance(alg, MAML) or alg.stackable)
    column = {"low": "low_memory", "deterministic": "deterministic", "sharded": "sharded"}.get(mode)
    return column is None or getattr(alg.supports, column)


def cell(algorithm: str, mode: str, layout: str) -> dict:
    """One meta-step of the cell: where it was refused (``"built"``: the algorithm or the
    wrapper refused to be built; ``"step"``: later) and why, or its meta-gradient."""
    p = problem(algorithm, mode, layout)
    try:
        alg = p.build_algorithm()
        if mode in ("loop", "stacked"):  # where the class declares no stacking: refused here
            alg.batched = mode == "stacked"
        learner = md.MetaDDP(alg, md.Mesh.for_layout(layout), deterministic=p.deterministic,
                             shard=p.shard, check=p.check)
    except (ValueError, TypeError) as e:
        return {"refused": "built", "why": f"{type(e).__name__}: {e}"}
    try:
        if mode == "clone":
            hand_loop(learner, p)
        else:
            learner.meta_loss(learner.shard(p.n_tasks, p.task), p.loss_fn).backward()
        learner.sync_grads()
        with learner.gathered():
            grads = S.meta_gradient(learner.module)
    except (ValueError, TypeError, RuntimeError) as e:
        return {"refused": "step", "why": f"{type(e).__name__}: {e}"}
    finally:
        learner.release()
    return {"grads": grads}


def hand_loop(learner: md.MetaDDP, p: S.Problem) -> None:
    """The meta-step written as docs/migration.md writes a learn2learn loop: a clone per
    task, ``steps`` adaptations on its support share, its query share backward."""
    batch = learner.shard(p.n_tasks, p.task)
    for task in batch:
        s, q = task.support, task.query
        clone = learner.clone()
        for _ in range(p.steps):
            clone.adapt(md.share(p.loss_fn(clone(s.x), s.y), s))
        (md.share(p.loss_fn(clone(q.x), q.y), q) / batch.n).backward()


def keys() -> list[tuple[str, str, str]]:
    """Every offered cell's (algorithm, mode, layout), in one order."""
    return [(a, m, l) for a in ALGORITHMS for m in MODES for l in LAYOUTS if offered(a, m)]


def sample(every: int) -> list[tuple[str, str, str]]:
    """Every ``every``-th cell of :func:`keys` and every deterministic cell (its bits are
    compared at each world size): all of them at ``every=1``."""
    return [k for i, k in enumerate(keys()) if i % every == 0 or k[1] == "deterministic"]


def every_cell(every: int = 1) -> dict:
    torch.manual_seed(0)
    return {key: cell(*key) for key in sample(every)}
