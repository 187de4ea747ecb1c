"""What every rank runs for tests/test_sharded.py, in the shared process groups of
tests/conftest.py (``workers.everything`` at world sizes 1 to 4): meta-steps with sharded
meta-parameters (``MetaDDP(..., shard=True)``), the gather's derivatives to third order,
what each rank holds, what it communicates, and the refusals."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import metaddp as md
from metaddp.distributed._rows import Cut, gather
from metaddp.testing import scenarios as S

# Uneven shards at every world size: the MLP's 16-row layers over 3 ranks, its 1-row head
# (ranks without a row), 13 support and 11 query samples, 3 tasks over 2 task groups. The
# models are tiny: the default gathers all their layers at once, and unit_bytes=0 (PER_LAYER)
# every layer on its own, with graphs keeping every gathered weight as its rows.
PROBLEMS = {
    "maml-2nd-sample": S.Problem("mlp", steps=2, n_tasks=2),
    "maml-1st-sample": S.Problem("mlp", steps=2, n_tasks=2, first_order=True),
    "maml-2nd-hybrid": S.Problem("mlp", steps=2, n_tasks=3, layout="hybrid"),
    "maml-adam-hybrid": S.Problem("mlp", steps=2, n_tasks=3, optimizer="adam", layout="hybrid",
                                  inner_lr=0.03),
    "maml-adamw-hybrid": S.Problem("mlp", steps=2, n_tasks=3, optimizer="adamw",
                                   layout="hybrid", inner_lr=0.03),
    "maml-low-memory": S.Problem("mlp", steps=2, n_tasks=2, memory="low"),
    "conv-batchnorm": S.Problem("conv", steps=2, n_tasks=2, batchnorm=True, running_stats=False),
    "conv-batchnorm-running": S.Problem("conv", steps=1, n_tasks=2, batchnorm=True),
    "transformer": S.Problem("transformer", steps=1, n_tasks=2, n_support=7, n_query=5),
}
PER_LAYER = ("maml-2nd-sample", "maml-low-memory", "conv-batchnorm", "transformer")
PROBLEMS = {k: dataclasses.replace(p, unit_bytes=0) if k in PER_LAYER else p
            for k, p in PROBLEMS.items()}
PROBLEMS["default-units"] = S.Problem("mlp", steps=2, n_tasks=2)
BILEVEL = {
    "bilevel-lookahead": S.BilevelProblem(penalty=False, n_problems=2, unit_bytes=0),
    "bilevel-maml-adam": S.BilevelProblem(penalty=False, start="outer", optimizer="adam",
                                          inner_lr=0.05, layout="hybrid", n_problems=2),
    # Its first steps without a graph read no whole vector: it was refused for a reason
    # that did not hold.
    "bilevel-truncated": S.BilevelProblem(method="truncated", penalty=False, n_problems=2),
}


# At 3 processes (3 ranks on 2 cores, the slowest) MAML, Adam and BatchNorm only.
AT_THREE = ("maml-2nd-sample", "maml-1st-sample", "maml-2nd-hybrid", "maml-adam-hybrid",
            "maml-adamw-hybrid", "conv-batchnorm", "conv-batchnorm-running", "default-units")


def run_all(root: str | None = None) -> dict:
    """Every check at 2 to 4 processes, but at 3 only the AT_THREE problems, the ways of
    running one step (re-gathering, check mode) at 2 and 4, and the refusals at 2 and 3
    (what tests/test_sharded.py reads); at 1, what needs no cut (the gather, the state)."""
    world = md.world_size()
    out = {"orders": third_order(), "held": held()}
    if world in (2, 3):
        out["refusals"] = refusals()
    if root is not None:
        out["dcp"] = checkpoint(root)
    if world in (1, 2):
        out["anil-head"] = anil_head()
    if world == 1:  # one process cuts nothing (test_one_process_shard_is_a_no_op)
        return out
    out["problems"] = {name: S.run(dataclasses.replace(p, shard=True))
                       for name, p in PROBLEMS.items() if world != 3 or name in AT_THREE}
    out["bilevel"] = {name: S.run_bilevel(dataclasses.replace(p, shard=True))
                      for name, p in BILEVEL.items() if world != 3}
    out["stacked"] = stacked()
    if world in (2, 4):
        out["regather"] = regather()
        out["checked"] = checked()
        out["fsdp2"] = fsdp2() if world == 2 else None  # 4.2 s more at 4 on two cores
        out["fsdp2-layouts"] = fsdp2_layouts()
    if root is not None and world in (2, 3):
        out["fsdp2-resume"] = fsdp2_resume(root)
    return out


# Stacked tasks (batched=True, tasks under torch.vmap) on sharded meta-parameters, at the
# world sizes where each says the most in the fewest seconds: second order on the MLP over
# every rank (2, 3; each layer gathered on its own) and memory="low" (2); on the task x
# sample mesh (4: 2 x 2); the transformer with dropout on (keyed masks) at 4, where a rank
# holds one query sample, in both layouts.
STACKED = {
    "mlp-sample": (PROBLEMS["maml-2nd-sample"], (2, 3)),
    "mlp-low-memory": (PROBLEMS["maml-low-memory"], (2,)),
    "mlp-hybrid": (PROBLEMS["maml-2nd-hybrid"], (4,)),  # the layers gathered together
    "transformer-sample": (PROBLEMS["transformer"], (4,)),
    "transformer-hybrid": (dataclasses.replace(PROBLEMS["transformer"], layout="hybrid"), (4,)),
}
STACKED = {k: (dataclasses.replace(p, batched=True), at) for k, (p, at) in STACKED.items()}


def stacked() -> dict:
    """The STACKED problems' sharded meta-steps at their world sizes; at 2, the collectives
    of one sharded MLP step stacked with 2 and with 4 tasks and one by one with 2, and an
    FSDP2 model's step with batched=True in the sample layout."""
    world = md.world_size()
    out: dict = {name: S.run(dataclasses.replace(p, shard=True))
                 for name, (p, at) in STACKED.items() if world in at}
    if world != 2:
        return out
    out["calls"] = {}
    for n_tasks, batched in ((2, True), (4, True), (2, False)):
        p = dataclasses.replace(STACKED["mlp-sample"][0], n_tasks=n_tasks, batched=batched)
        learner = md.MetaDDP(p.build_algorithm(), S.mesh_for(p.layout), shard=True, unit_bytes=0)
        with md.counting() as stats:
            learner.meta_loss(learner.shard(p.n_tasks, p.task), p.loss_fn).backward()
            learner.sync_grads()
        out["calls"][n_tasks, batched] = stats.calls
        learner.release()
    from torch.distributed.device_mesh import init_device_mesh

    net = _fully_sharded(init_device_mesh("cpu", (world,)))
    learner = md.MetaDDP(md.MAML(net, inner_lr=FSDP.inner_lr, steps=FSDP.steps, batched=True),
                         md.Mesh.create())
    out["fsdp2"] = {"loss": _fsdp_step(learner, FSDP), "grads": _full_grads(net)}
    learner.release()
    return out


def checked() -> dict:
    """The transformer's sharded step in check mode (every forward's weights compared across
    the sample group, after each layer's gather): the meta-gradient, gathered."""
    p = dataclasses.replace(PROBLEMS["transformer"], layout="hybrid")
    algorithm = p.build_algorithm()

    def attributes() -> set:
        return {(n, a) for n, m in algorithm.model.named_modules() for a in vars(m)}

    before = attributes()
    learner = md.MetaDDP(algorithm, S.mesh_for(p.layout), shard=True, check=True,
                         unit_bytes=0)
    loss = learner.meta_loss(learner.shard(p.n_tasks, p.task), p.loss_fn)
    loss.backward()
    learner.sync_grads()
    with learner.gathered():
        grads = {k: q.grad.clone() for k, q in learner.module.model.named_parameters()}
    # Nothing is written into the user's model: no attribute, no method, wrapped or not.
    return {"grads": grads, "written": sorted(attributes() ^ before)}


def checkpoint(root: str) -> dict:
    """``learner.sharded_state_dict()`` saved with torch.distributed.checkpoint by the first
    world size that shards (2 processes, into a folder beside ``root`` that every world size
    sees) and loaded by the others: the full weights each time."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    folder = Path(root).parent / "sharded-dcp"
    p = S.Problem("mlp", steps=1, n_tasks=2)
    # 1 x 2 when saved, 1 x 3 and 2 x 2 when loaded (task groups x sample ranks).
    layout = "hybrid" if md.world_size() == 4 else "sample"
    learner = md.MetaDDP(p.build_algorithm(), S.mesh_for(layout), shard=True)
    out: dict = {"dtensors": sum(type(v).__name__ == "DTensor"
                                 for v in learner.sharded_state_dict().values())}
    if md.world_size() == 2:
        with torch.no_grad():  # weights of their own, to tell a load from a fresh build
            for q in learner.parameters():
                q.add_(0.5)
        dcp.save(learner.sharded_state_dict(), checkpoint_id=str(folder))
        out["saved"] = True
    elif md.world_size() > 2 and folder.exists():
        state = learner.sharded_state_dict()
        dcp.load(state, checkpoint_id=str(folder))
        learner.load_sharded_state_dict(state)
        out["loaded"] = True
    with learner.gathered():
        out["weights"] = {k: q.detach().clone() for k, q in learner.module.named_parameters()}
    learner.release()
    return out


def third_order() -> list[list[float]]:
    """Derivatives of orders 1 to 3 of sum_r c_r * sum(W^3), W gathered from shards of
    w = [1, 2, 3, 4, 5] (uneven at 2 to 4 ranks), by each rank's shard; each level a
    share: with C = sum_r c_r, the closed forms are 3C w^2, 6C w and 6C on the rank's rows."""
    r, world = md.rank(), md.world_size()
    cut = Cut(torch.Size([5]), world, r)
    w = cut.take(torch.arange(1.0, 6.0, dtype=torch.float64)).requires_grad_()
    (full,) = gather([w], [cut], None)
    c = (r + 1) / 10
    (g1,) = torch.autograd.grad(c * (full**3).sum(), w, create_graph=True)
    (g2,) = torch.autograd.grad(g1.sum(), w, create_graph=True)
    (g3,) = torch.autograd.grad(g2.sum(), w, allow_unused=True, materialize_grads=True)
    return [full.tolist(), w.tolist(), g1.tolist(), g2.tolist(), g3.tolist()]


def held() -> dict:
    """What one rank holds and sends for a second-order MAML step with Adam as the outer
    optimizer, sharded and replicated: entries of parameters, gradients and optimizer state,
    and bytes communicated by kind."""
    out = {}
    for shard in (False, True):
        p = S.Problem("mlp", steps=2, n_tasks=2, shard=shard)
        learner = md.MetaDDP(p.build_algorithm(), S.mesh_for("sample"), shard=shard)
        opt = torch.optim.Adam(learner.parameters(), lr=1e-3)
        with md.counting() as stats:
            loss = learner.meta_loss(learner.shard(p.n_tasks, p.task), p.loss_fn)
            loss.backward()
            learner.sync_grads()
        # Replicated: torch's own clipping; sharded: the learner's (torch's sees one rank's rows).
        norm = float(learner.clip_grad_norm_(0.01) if shard
                     else torch.nn.utils.clip_grad_norm_(learner.parameters(), 0.01))
        opt.step()
        params = list(learner.parameters())
        state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
        out[shard] = {
            "params": sum(t.numel() for t in params),
            "grads": sum(t.grad.numel() for t in params if t.grad is not None),
            "state": sum(t.numel() for t in state),
            "by_kind": dict(stats.by_kind),
            "loss": float(learner.global_value(loss)),
            "norm": norm,
        }
        with learner.gathered():
            out[shard]["stepped"] = {k: q.detach().clone() for k, q in learner.named_parameters()}
        learner.release()
    return out


def regather() -> dict:
    """The same sharded step with every layer gathered on its own and the graphs keeping
    rows (``unit_bytes=0``), keeping the gathered weights (no re-gather), and with the
    default units (this tiny model's layers all gathered together, kept whole): the same
    meta-gradient; saved weights packed as rows, all-gather bytes and collective calls. Tasks
    one by one: stacked graphs keep the gathered weights whole (test_stacked_tasks_...)."""
    out = {}
    p = S.Problem("mlp", steps=2, n_tasks=2, batched=False)
    for way in ("rows", "whole", "default"):
        learner = md.MetaDDP(p.build_algorithm(), S.mesh_for("sample"), shard=True,
                             **({} if way == "default" else {"unit_bytes": 0}))
        if learner.sharding is not None and way == "whole":
            learner.sharding.regather = None
        for _ in range(2):  # the first forward learns the layers; count the second step
            learner.zero_grad()
            with md.counting() as stats:
                loss = learner.meta_loss(learner.shard(p.n_tasks, p.task), p.loss_fn)
                loss.backward()
                learner.sync_grads()
        with learner.gathered():
            grads = {k: q.grad.clone() for k, q in learner.module.named_parameters()}
        regathers = learner.sharding.regather if learner.sharding else None
        out[way] = {"grads": grads, "gathered": stats.by_kind.get("all_gather", 0),
                    "calls": stats.calls, "packed": regathers.packed if regathers else 0}
    return out


def anil_head() -> dict:
    """ANIL's hand loops on its sharded body: ``clone()`` and ``learner.grad`` by the head's
    fast weights, named as the body's weights are ("weight", "bias") and, at 2 processes,
    shaped as their rows ([4, 8]): the head is whole, so its gradients must be summed, not
    passed as rows. The meta-gradient of each, gathered."""
    out = {}
    for how in ("clone", "grad"):
        torch.manual_seed(0)
        alg = md.ANIL(nn.Linear(8, 8).double(), nn.Linear(8, 4).double(), inner_lr=0.1)
        learner = md.MetaDDP(alg, md.Mesh.create(), shard=md.world_size() > 1)
        g = torch.Generator().manual_seed(1)
        x, y, xq, yq = (torch.randn(n, d, generator=g, dtype=torch.float64)
                        for n, d in ((6, 8), (6, 4), (5, 8), (5, 4)))
        for t in learner.shard([md.Task(md.Batch(x, y, 6), md.Batch(xq, yq, 5))]):
            if how == "clone":
                c = learner.module.clone()
                c.adapt(md.share(S.mse_per_sample(c(t.support.x), t.support.y).mean(1), t.support))
                query = c(t.query.x)
            else:
                fast = alg.fast_weights()
                step = learner.grad(md.share(S.mse_per_sample(alg(t.support.x, fast), t.support.y).mean(1), t.support),
                                    fast)
                query = alg(t.query.x, {k: v - 0.1 * step[k] for k, v in fast.items()})
            md.share(S.mse_per_sample(query, t.query.y).mean(1), t.query).backward()
        learner.sync_grads()
        with learner.gathered():
            out[how] = {k: q.grad.clone() for k, q in alg.named_parameters()}
        learner.release()
    return out


def refusals() -> dict:
    """The error each mistake gives (``None``: it ran)."""
    def outcome(fn) -> str | None:
        try:
            fn()
        except (TypeError, ValueError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    p = S.Problem("mlp", steps=1, n_tasks=2)
    sample = S.mesh_for("sample")
    out = {
        "metasgd": outcome(lambda: md.MetaDDP(md.MetaSGD(p.build_model()), sample, shard=True)),
        "per_step_bn": outcome(lambda: md.MetaDDP(
            md.MAMLPlusPlus(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1)),
                            steps=2), sample, shard=True)),
        "clip": outcome(lambda: md.MetaDDP(
            md.MAML(p.build_model(), optimizer=md.chain(md.clip_by_global_norm(1.0),
                                                        md.sgd(0.1))), sample, shard=True)),
        "learn_lr": outcome(lambda: md.MetaDDP(
            md.MAML(p.build_model(), learn_lr="scalar"), sample, shard=True)),
        "deterministic": outcome(lambda: md.MetaDDP(md.MAML(p.build_model()), sample,
                                                    shard=True, deterministic=True)),
        "bare-model": outcome(lambda: md.MetaDDP(p.build_model(), sample, shard=True)),
        "implicit": outcome(lambda: md.MetaDDP(
            dataclasses.replace(S.BilevelProblem(penalty=False), method="implicit-cg")
            .build_algorithm(), sample, shard=True)),
        "penalty": outcome(lambda: md.MetaDDP(S.BilevelProblem().build_algorithm(), sample,
                                              shard=True)),
        # A factory that reads a learned rate as a whole would get each rank's rows of it.
        "rates-factory": outcome(lambda: md.MetaDDP(md.MetaSGD(
            p.build_model(), optimizer=lambda lr: md.inner.sgd({k: v / v.mean() for k, v in lr.items()})),
            sample, shard=True)),
    }
    learner = md.MetaDDP(md.MAML(p.build_model(), inner_lr=0.1), sample, shard=True)
    model = learner.module.model
    x = torch.zeros(3, 1, dtype=torch.float64)
    out["model(x)"] = outcome(lambda: model(x))
    out["local"] = outcome(lambda: learner.local().__enter__())
    out["batched"] = outcome(lambda: _batched(learner, p))

    def inside() -> None:
        with learner.gathered(), learner.local():
            model(x)

    out["gathered-local"] = outcome(inside)

    def torch_clip() -> None:  # after a sharded step: torch's clipping sees one rank's rows
        loss = learner.meta_loss(learner.shard(p.n_tasks, p.task), p.loss_fn)
        loss.backward()
        learner.sync_grads()
        torch.nn.utils.clip_grad_norm_(learner.parameters(), 1.0)

    out["torch-clip"] = outcome(torch_clip)
    learner.zero_grad()

    def adapt_alone() -> None:  # after a step: one rank adapts on the full weights alone
        with learner.gathered(), learner.local():
            learner.module.adapt(p.task(0).support, p.loss_fn, steps=1)

    out["adapt-alone"] = outcome(adapt_alone)
    learner.release()
    out["released-shape"] = [tuple(q.shape) for q in model.parameters()]
    return out


def _batched(learner: md.MetaDDP, p: S.Problem) -> None:
    algorithm = learner.module
    assert isinstance(algorithm, md.MAML)
    algorithm.batched = True
    try:  # a whole step: stacked tasks on shards run
        learner.meta_loss(learner.shard(p.n_tasks, p.task), p.loss_fn).backward()
        learner.sync_grads()
        learner.zero_grad()
    finally:
        algorithm.batched = None


# FSDP2's fully_shard, adopted (tests/test_sharded.py; the shared groups at 2, 3 and 4).
FSDP = S.Problem("mlp", steps=2, n_tasks=2)
FSDP_LR = 0.01  # the outer AdamW's
# tests/test_transformer.py's problem (dropout 0.1 on), whose reference it writes out.
FSDP_TRANSFORMER = S.Problem(model="transformer", steps=2, n_tasks=3, n_support=7, n_query=6)


def _fully_sharded(device_mesh, **options) -> nn.Module:
    """The problem's MLP, each Linear and the root cut by FSDP2's fully_shard."""
    from torch.distributed.fsdp import fully_shard

    net = FSDP.build_model()
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=device_mesh, **options)
    fully_shard(net, mesh=device_mesh, **options)
    return net


def fsdp2() -> dict:
    """One second-order MAML step of a fully_shard model under MetaDDP (sample layout), the
    outer AdamW built on its DTensor parameters before MetaDDP; then, at 2 processes, the
    error of each setting that is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor, Shard

    device_mesh = init_device_mesh("cpu", (md.world_size(),))
    net = _fully_sharded(device_mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=FSDP_LR)
    learner = md.MetaDDP(md.MAML(net, inner_lr=FSDP.inner_lr, steps=FSDP.steps),
                         md.Mesh.create())
    loss = learner.meta_loss(learner.shard(FSDP.n_tasks, FSDP.task), FSDP.loss_fn)
    loss.backward()
    learner.sync_grads()
    params = dict(net.named_parameters())
    out: dict = {
        "loss": float(learner.global_value(loss)),
        "kinds": {k: (type(q).__name__, type(q.grad).__name__, tuple(q.grad.placements))
                  for k, q in params.items()},
        "local": {k: tuple(q.grad.to_local().shape) for k, q in params.items()},
        "grads": {k: q.grad.full_tensor() for k, q in params.items()},
    }
    opt.step()
    out["stepped"] = {k: q.detach().full_tensor() for k, q in net.named_parameters()}
    out["still"] = all(isinstance(q, DTensor) and q.placements == (Shard(0),)
                       for q in net.parameters())
    out["state"] = sum(isinstance(v, DTensor) for v in learner.sharded_state_dict().values())

    def error(fn) -> str:
        try:
            fn()
        except RuntimeError as e:
            return str(e)
        return "ran"

    out["model(x)"] = error(lambda: net(torch.zeros(3, 1, dtype=torch.float64)))
    out["gathered"] = error(lambda: learner.gathered().__enter__())
    learner.release()
    out["released"] = float(net(torch.zeros(3, 1, dtype=torch.float64)).sum())  # FSDP's own
    # Each layer gathered on its own, graphs keeping rows (unit_bytes=0), and the norms.
    net = _fully_sharded(device_mesh)
    learner = md.MetaDDP(md.MAML(net, inner_lr=FSDP.inner_lr, steps=FSDP.steps),
                         md.Mesh.create(), unit_bytes=0)
    learner.meta_loss(learner.shard(FSDP.n_tasks, FSDP.task), FSDP.loss_fn).backward()
    learner.sync_grads()
    assert learner.sharding is not None and learner.sharding.regather is not None
    out["per_layer"] = {k: q.grad.full_tensor() for k, q in net.named_parameters()}
    out["packed"] = learner.sharding.regather.packed
    out["norms"] = (float(learner.clip_grad_norm_(1e9)),
                    float(torch.nn.utils.clip_grad_norm_(list(net.parameters()), 1e9)))
    learner.release()
    # The same problem as a Bilevel from the model's weights (Unrolled): MAML's meta-gradient.
    net = _fully_sharded(device_mesh)
    learner = md.MetaDDP(md.Bilevel(net, start="outer", steps=FSDP.steps, inner_lr=FSDP.inner_lr),
                         md.Mesh.create())
    learner.meta_loss(learner.shard(FSDP.n_tasks, FSDP.task), FSDP.loss_fn).backward()
    learner.sync_grads()
    out["bilevel"] = {k: q.grad.full_tensor() for k, q in net.named_parameters()}
    learner.release()
    if md.world_size() != 2:  # the refusals once (Shard(1) needs columns that 2 ranks divide)
        return out

    def refused(make_net, mesh=None, algorithm=md.MAML) -> str:
        try:
            md.MetaDDP(algorithm(make_net(), inner_lr=0.1), mesh or md.Mesh.create())
        except (TypeError, ValueError) as e:
            return str(e)
        return "ran"

    f64 = torch.float64
    out["refused"] = {
        "mixed precision": refused(lambda: _fully_sharded(
            device_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=f64, reduce_dtype=f64))),
        "offload": refused(lambda: _fully_sharded(
            device_mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))),
        "Shard(1)": refused(lambda: _fully_sharded(
            device_mesh, shard_placement_fn=lambda q: Shard(1) if q.shape[1:] == (16,) else None)),
        # A 1-D mesh over both ranks, but each task group of the hybrid layout is one rank.
        "mesh": refused(lambda: _fully_sharded(device_mesh), S.mesh_for("hybrid")),
        # ANIL shards its body alone: a head cut by fully_shard is refused by name.
        "ANIL": refused(lambda: _fully_sharded(device_mesh),
                        algorithm=lambda net, inner_lr: md.ANIL(net[:-1], net[-1], inner_lr=inner_lr)),
        "Meta-SGD": refused(lambda: _fully_sharded(device_mesh), algorithm=md.MetaSGD),
    }
    return out


def _fsdp_step(learner, p: S.Problem, step: int = 0) -> float:
    tasks = learner.shard(p.n_tasks, lambda i: p.task(step * p.n_tasks + i))
    loss = learner.meta_loss(tasks, p.loss_fn)
    loss.backward()
    learner.sync_grads()
    return float(learner.global_value(loss))


def _full_grads(net: nn.Module) -> dict:
    return {k.removeprefix("model."): q.grad.full_tensor() for k, q in net.named_parameters()}


def fsdp2_layouts() -> dict:
    """The transformer with dropout on, cut by fully_shard: one second-order MAML step in the
    sample layout (a 1-D mesh over every rank) and in the hybrid layout as HSDP (the 2-D
    task x sample mesh, Replicate() over the task groups and Shard(0) within each); then
    Bilevel(Unrolled) on the HSDP MLP."""
    from torch.distributed.fsdp import fully_shard

    p, out = FSDP_TRANSFORMER, {}
    for layout in ("sample", "hybrid"):
        mesh = S.mesh_for(layout)
        device_mesh = mesh.device_mesh if layout == "hybrid" else mesh.device_mesh["sample"]
        net = p.build_model()
        for part in (net.encoder, net.attention, net):
            fully_shard(part, mesh=device_mesh)
        algorithm = md.MAML(net, inner_lr=p.inner_lr, steps=p.steps)
        algorithm.at_step(0)  # the reference's masks: meta-step 0
        learner = md.MetaDDP(algorithm, mesh)
        loss = _fsdp_step(learner, p)
        out[layout] = {"loss": loss, "grads": _full_grads(net),
                       "placements": {tuple(q.grad.placements) for q in net.parameters()}}
        learner.release()
    mesh = S.mesh_for("hybrid")
    net = _fully_sharded(mesh.device_mesh)
    learner = md.MetaDDP(md.Bilevel(net, start="outer", steps=FSDP.steps, inner_lr=FSDP.inner_lr),
                         mesh)
    _fsdp_step(learner, dataclasses.replace(FSDP, n_tasks=3))
    out["bilevel-hybrid"] = _full_grads(net)
    learner.release()
    return out


def fsdp2_resume(root: str) -> dict | None:
    """An FSDP2 model and its AdamW saved as FSDP2 users save them (``get_state_dict`` and
    torch.distributed.checkpoint) after one meta-step at 2 processes, into a folder beside
    ``root``; loaded at 3 with ``set_state_dict``. Both take the same second meta-step."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder, world = str(Path(root).parent / "fsdp2-dcp"), md.world_size()
    mesh = md.Mesh.create()
    net = _fully_sharded(mesh.device_mesh["sample"])
    opt = torch.optim.AdamW(net.parameters(), lr=FSDP_LR)
    learner = md.MetaDDP(md.MAML(net, inner_lr=FSDP.inner_lr, steps=FSDP.steps), mesh)
    out: dict = {}
    if world == 2:
        _fsdp_step(learner, FSDP, 0)
        opt.step()
        opt.zero_grad()
        model_state, optim_state = get_state_dict(net, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    elif Path(folder).exists():
        model_state, optim_state = get_state_dict(net, opt)  # the shapes to load into
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        learner.release()
        return None
    out["weights"] = {k: q.detach().full_tensor() for k, q in net.named_parameters()}
    _fsdp_step(learner, FSDP, 1)
    opt.step()
    out["next"] = {k: q.detach().full_tensor() for k, q in net.named_parameters()}
    learner.release()
    return out
