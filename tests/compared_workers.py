"""The problems of tests/test_algorithms_compared.py, run by every rank of the shared process
groups (``workers.everything``, the session fixture ``worlds``), and a prototypical network
written by hand as docs/algorithms.md shows it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import metaddp as md
from metaddp.testing import scenarios as S

STEPS = 2


def problems() -> list[S.Problem]:
    out = []
    for layout in S.LAYOUTS:
        out += [
            S.Problem(algorithm="boil", layout=layout, steps=STEPS),
            S.Problem(algorithm="protonet", model="conv", layout=layout, n_tasks=3),
            S.Problem(algorithm="protomaml", model="conv", layout=layout, steps=STEPS, n_tasks=3),
            # MAML++ mid-way through its multi-step loss's annealing, first order (meta-step 5
            # of a 150-step run: msl over 10, first order over 50), and past both.
            S.Problem(algorithm="mamlpp", layout=layout, steps=STEPS, schedule_steps=150,
                      meta_step=5),
            S.Problem(algorithm="mamlpp", layout=layout, steps=STEPS, schedule_steps=150,
                      meta_step=60),
            S.Problem(optimizer="adamw", layout=layout, steps=STEPS, inner_lr=0.03),
            S.Problem(optimizer="rmsprop", layout=layout, steps=STEPS, inner_lr=0.01, clip=2.0),
            S.Problem(optimizer="adagrad", layout=layout, steps=STEPS, inner_lr=0.1),
        ]
    out.append(S.Problem(algorithm="boil", model="conv", layout="hybrid", steps=STEPS, n_tasks=3))
    # MAML++ with per-step BatchNorm weights and running statistics (BNWB, BNRS), synchronized
    # over the ranks that split a task.
    for layout in S.LAYOUTS:
        out.append(S.Problem(algorithm="mamlpp", model="conv", batchnorm=True, layout=layout,
                             steps=STEPS, n_tasks=3, inner_lr=0.3, schedule_steps=150,
                             meta_step=5))
    # MAML with tasks stacked through BatchNorm layers that track running statistics: the
    # statistics move as the per-task loop moves them.
    for layout in S.LAYOUTS:
        out.append(S.Problem(model="conv", batchnorm=True, layout=layout, steps=STEPS,
                             n_tasks=3, inner_lr=0.3, batched=True))
    # CAVIA: a context vector adapted from zero, stacked (the MLP's automatic choice), one by
    # one, and rebuilt step by step.
    for layout in S.LAYOUTS:
        out.append(S.Problem(algorithm="cavia", layout=layout, steps=STEPS, inner_lr=0.5))
    out.append(S.Problem(algorithm="cavia", layout="hybrid", steps=STEPS, inner_lr=0.5,
                         batched=False, memory="low"))
    # BOIL takes MAML's second order rebuilt step by step.
    out.append(S.Problem(algorithm="boil", layout="hybrid", steps=STEPS, memory="low"))
    # A chained, clipped adaptive optimizer rebuilt step by step.
    out.append(S.Problem(optimizer="adamw", clip=1.0, layout="sample", steps=STEPS,
                         inner_lr=0.03, memory="low"))
    # A transformer meta-trained with dropout 0.1 on (keyed masks, metaddp.forward): second
    # order in every layout, first order once, and its tasks stacked under vmap, rebuilt step
    # by step (tests/test_transformer.py's reference).
    for layout in S.LAYOUTS:
        out.append(S.Problem(model="transformer", layout=layout, steps=STEPS, n_tasks=3,
                             n_support=7, n_query=6))
    out.append(S.Problem(model="transformer", layout="hybrid", steps=STEPS, n_tasks=3,
                         n_support=7, n_query=6, first_order=True))
    out.append(S.Problem(model="transformer", layout="sample", steps=STEPS, n_tasks=3,
                         n_support=7, n_query=6, batched=True, memory="low"))
    return out


def name(p: S.Problem) -> str:
    what = p.algorithm if p.optimizer == "sgd" else f"{p.optimizer}{'-clip' if p.clip else ''}"
    modes = ("-bn" if p.batchnorm else "") + ("-low" if p.memory == "low" else "")
    modes += {True: "-stacked", False: "-loop", None: ""}[p.batched]
    modes += "-1st" if p.first_order else ""
    return f"{what}-{p.model}-{p.layout}" + (f"-at{p.meta_step}" if p.meta_step else "") + modes


def runs_at(p: S.Problem, world: int) -> bool:
    """Whether ``p`` runs at ``world`` processes: every problem at 1 to 3 (3 cuts every split
    unevenly), at 4 the hybrid layout's, the one mesh (2 task groups x 2 ranks) that 2 and 3
    processes do not make."""
    return world != 4 or p.layout == "hybrid"


def worlds_of(p: S.Problem, results: dict) -> list[int]:
    """The worlds of ``results`` where ``p`` ran, checked to be those :func:`runs_at` names."""
    worlds = [w for w in results if runs_at(p, w)]
    assert worlds == ([1, 2, 3, 4] if p.layout == "hybrid" else [1, 2, 3])
    return worlds


def run_all() -> list[dict | None]:
    """Every problem's result on this rank (``None`` where it does not run, :func:`runs_at`),
    then the hand-written prototypical network's."""
    world = md.world_size()
    return [S.run(p) if runs_at(p, world) else None for p in problems()] + [user_written(USER_PROBLEM)]


USER_PROBLEM = S.Problem(algorithm="protonet", model="conv", layout="sample", n_tasks=3)


def user_written(p: S.Problem) -> dict:
    """A prototypical network as docs/algorithms.md shows it: its own loss through
    md.class_means with learner.reduce, and evaluation by learner.adapt(support)."""
    body = p.build_model().split_head()[0]
    learner = md.MetaDDP(md.ProtoNet(body, ways=3), S.mesh_for(p.layout))
    tasks = learner.shard(p.n_tasks, p.task)
    total = 0.0
    for t in tasks:  # by hand: prototypes of the whole support set, whatever this rank holds
        c, _ = md.class_means(body(t.support.x), t.support.y, 3, reduce=learner.reduce)
        logits = -((body(t.query.x)[:, None] - c[None]) ** 2).sum(-1)
        total = total + md.share(F.cross_entropy(logits, t.query.y, reduction="none"), t.query)
    (total / tasks.n).backward()
    learner.sync_grads()
    by_hand = {k: q.grad.clone() for k, q in body.named_parameters()}
    t = tasks[0]
    fast = learner.adapt(t.support)  # the prototypes, no loss function
    with torch.no_grad():
        logits = learner(t.query.x, fast)
    return {"grads": by_hand, "prototypes": fast["prototypes"].detach(), "rows": logits.shape[0]}
