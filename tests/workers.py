"""Functions each spawned rank runs (module level, so that spawned processes can import them)."""

import dataclasses
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import compared_workers  # tests/, on sys.path via conftest
import hf_workers  # transformers is imported by its functions, not here
import metaddp as md
import sharded_workers
from metaddp import train as _train
from metaddp.distributed._collectives import _next_sequence
from metaddp.tasks.ttt import TTT
from metaddp.testing import scenarios as S
from metaddp.train import TrainConfig

# Exactness cases: (name, Problem). Sizes chosen so that shards are uneven at every world
# size 2..4, some ranks get empty shards (2 or 3 samples over 3-4 ranks), and task counts do
# not divide the world size (5 tasks; 3 tasks leave a rank without any task at 4 ranks).
CASES = {
    "mlp-1step-2nd-sample": S.Problem("mlp", steps=1, layout="sample"),
    "mlp-3step-1st-sample": S.Problem("mlp", steps=3, first_order=True, layout="sample"),
    "mlp-2step-2nd-task5": S.Problem("mlp", steps=2, layout="task"),
    "mlp-2step-2nd-task3": S.Problem("mlp", n_tasks=3, steps=2, layout="task"),
    "mlp-2step-2nd-empty-shards": S.Problem("mlp", n_support=2, n_query=3, steps=2, layout="sample"),
    "mlp-3step-2nd-hybrid": S.Problem("mlp", n_tasks=3, steps=3, layout="hybrid"),
    "conv-3step-2nd-sample": S.Problem("conv", steps=3, layout="sample"),
    "conv-2step-1st-task": S.Problem("conv", steps=2, first_order=True, layout="task"),
    "conv-2step-2nd-hybrid": S.Problem("conv", steps=2, layout="hybrid"),
    "conv-1step-2nd-empty-shards": S.Problem("conv", n_support=2, n_query=1, steps=1, layout="sample"),
}
# The ttt task family's byte transformer, tiny, with dropout on: ANIL (its default), second
# order; 5 support chunks and 3 query chunks leave ranks without a query chunk at 4 processes.
TTT_PROBLEM = S.Problem("family", family=TTT(shots=5, query=3, hidden=16, chunk=8), algorithm="anil", n_tasks=2,
                        n_support=5, n_query=3, steps=1, inner_lr=0.5)


def third_order() -> list[float]:
    """Derivatives of orders 1-3 of L = sum_r c_r * s^4, s = sum_r x_r, through the all-reduce.

    Each rank holds x_r = r + 1 and the shares c_r, d_r, e_r (weights of the three levels).
    """
    r = md.rank()
    x = torch.tensor(float(r + 1), dtype=torch.float64, requires_grad=True)
    c, d, e = (r + 1) / 10, (r + 2) / 7, (r + 3) / 5
    (s,) = md.all_reduce_sum([x])
    (g,) = torch.autograd.grad(c * s**4, x, create_graph=True)    # 4 C s^3
    (h,) = torch.autograd.grad(d * g, x, create_graph=True)       # 12 C D s^2
    (k,) = torch.autograd.grad(e * h, x)                          # 24 C D E s
    return [float(t.detach()) for t in (s, g, h, k)]


def bucketing() -> dict:
    """Twelve tensors of mixed dtype summed in 64-byte buckets: values and the call count;
    then what only the garbage collector would have freed of them once dropped (their
    buckets, in a reference cycle, until it ran)."""
    import gc

    r = md.rank()
    ts = [torch.full((5,), float(r + i), dtype=torch.float64 if i % 3 else torch.float32)
          for i in range(12)]
    gc.collect()
    gc.disable()
    try:
        with md.counting() as stats:
            out = md.all_reduce_sum(ts, bucket_bytes=64)
        result = {"values": [t.tolist() for t in out], "dtypes": [str(t.dtype) for t in out],
                  "calls": stats.calls}
        md.global_value(torch.ones(()))  # reads the pending tag checks
        del out
        result["cyclic"] = gc.collect()
    finally:
        gc.enable()
    return result


def broadcast_and_errors() -> dict:
    """Construction-time sync, and the errors that every rank raises alike."""
    out = {}
    torch.manual_seed(md.rank())  # deliberately different weights per rank
    net = nn.Linear(3, 2)
    md.MetaDDP(net)
    out["weight"] = net.weight.detach().clone()
    torch.manual_seed(md.rank())
    try:
        md.MetaDDP(nn.Linear(3, 2), broadcast=False)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)

    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(2, 1), nn.Linear(2, 1)

        def forward(self, x):
            return self.used(x)

    for allow in (False, True):
        m = md.MetaDDP(Partly(), allow_unused=allow)
        m(torch.ones(1, 2)).sum().backward()
        try:
            m.sync_grads()
            out[f"unused-{allow}"] = m.module.unused.weight.grad
        except ValueError as e:
            out[f"unused-{allow}"] = str(e)
    try:
        md.MetaDDP(nn.parallel.DistributedDataParallel(nn.Linear(2, 1)))
    except TypeError as e:
        out["ddp"] = str(e)
    try:
        md.Mesh.create(tasks=md.world_size() + 1)
        out["mesh"] = None
    except ValueError as e:
        out["mesh"] = str(e)
    return out


def strict_size_mismatch() -> str:
    """Ranks reduce different sizes; strict mode must name it rather than let gloo abort."""
    md.set_strict(True)
    try:
        md.all_reduce_sum([torch.ones(3 + 2 * md.rank(), dtype=torch.float64)])
    except md.CollectiveError as e:
        return str(e)
    return "no error"


def out_of_step_tag() -> str:
    """Rank 1 is one collective ahead (as after an extra inner step): the tag must catch it."""
    if md.rank() == 1:
        _next_sequence(None)
    try:
        md.all_reduce_sum([torch.ones(4, dtype=torch.float64)])
    except md.CollectiveError as e:
        return str(e)
    return "no error"


def rank_one_leaves() -> str:
    """Rank 1 skips the collective and exits; rank 0 must fail with an explanation, not hang."""
    if md.rank() == 1:
        return "left"
    try:
        md.all_reduce_sum([torch.ones(4)])
    except md.CollectiveError as e:
        return str(e)
    return "no error"


def everything(root: str) -> dict:
    """All checks that share one process group, so each world size is spawned once (the
    session fixture ``worlds`` of tests/conftest.py); ``root``: this world size's folder."""
    return {
        "cases": {name: S.run(p) for name, p in CASES.items()},
        "seed-1st": S.run_seed(S.SeedProblem(second_order=False, iterations=3)),
        "seed-2nd": S.run_seed(S.SeedProblem(second_order=True, iterations=3)),
        "third": third_order(),
        "bucketing": bucketing(),
        "sync": broadcast_and_errors(),
        "quickstart": quickstart_losses(),
        "rank": md.rank(),
        "deterministic": deterministic(root, md.world_size()),
        "compared": compared_workers.run_all(),
        "hf": hf_workers.run_all(),  # world sizes 1 and 2; None without transformers
        "sharded": sharded_workers.run_all(root),
        "ttt": S.run(TTT_PROBLEM),
        # Several task groups (hybrid layout) at 2 and 4 processes only.
        "running": running_statistics_steps() if md.world_size() in (2, 4) else None,
    }


def running_statistics_steps() -> dict:
    """Three meta-steps of the BatchNorm conv model with running statistics, task groups
    adapting other tasks (hybrid layout): the error, if any, and the buffers after."""
    p = S.Problem("conv", steps=1, n_tasks=3, batchnorm=True, layout="hybrid")
    learner = md.MetaDDP(p.build_algorithm(), S.mesh_for(p.layout))
    try:
        for step in range(3):
            learner.zero_grad()
            tasks = learner.shard(p.n_tasks, lambda i, step=step: p.task(step * p.n_tasks + i))
            learner.meta_loss(tasks, p.loss_fn).backward()
            learner.sync_grads()
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None, "task_group": learner.mesh.task_index,
            "buffers": {k: b.clone() for k, b in learner.module.model.named_buffers()}}


def quickstart_losses() -> list[float]:
    import quickstart  # examples/, on sys.path via conftest

    return quickstart.main(steps=3)


def seed_ddp_grad2() -> float:
    import seed_ddp  # examples/, on sys.path via conftest

    return seed_ddp.train()


def half_precision_tags(dtype_name: str) -> list[str]:
    """Half-precision buckets: agreeing ranks sum exactly; a rank one collective ahead is
    caught by the bit tag."""
    dtype = getattr(torch, dtype_name)
    out = []
    summed = md.all_reduce_sum([torch.full((3,), 0.5 + md.rank(), dtype=dtype)])[0]
    out.append(f"sum {summed.tolist()}")
    if md.rank() == 1:
        _next_sequence(None)
    try:
        md.all_reduce_sum([torch.ones(4, dtype=dtype)])
        out.append("no error")
    except md.CollectiveError as e:
        out.append(str(e))
    return out


# --- deterministic mode (tests/test_deterministic.py) ---

F32 = torch.float32
# Sizes make shards uneven at every world size (13 support samples cut into 7 chunks of 2,
# 11 query ones into 6), leave ranks without a chunk (2 support samples: 2 chunks over 3-4
# ranks) and without a task (3 tasks over 4 ranks in the task layout; iMAML's 2 over 3 and
# 4, whose empty ranks still take part in the backward's sums).
CASES_DETERMINISTIC = {
    "mlp-sample": S.Problem("mlp", steps=2, layout="sample"),
    "mlp-task3": S.Problem("mlp", n_tasks=3, steps=1, layout="task"),
    "mlp-hybrid": S.Problem("mlp", n_tasks=3, steps=2, layout="hybrid"),
    "mlp-1st-empty": S.Problem("mlp", n_support=2, n_query=3, first_order=True),
    "metasgd-adam-hybrid": S.Problem("mlp", steps=2, algorithm="metasgd", optimizer="adam",
                                     layout="hybrid"),
    "conv-bn-sample": S.Problem("conv", steps=2, batchnorm=True, running_stats=False),
    "conv-bn-hybrid": S.Problem("conv", n_tasks=3, steps=1, batchnorm=True, running_stats=False,
                                layout="hybrid"),
    "imaml-task-empty": S.Problem("mlp", n_tasks=2, steps=2, algorithm="imaml", layout="task"),
    # Dropout on: every chunk draws its samples' keyed masks.
    "transformer-hybrid": S.Problem("transformer", n_tasks=3, steps=2, n_support=7, n_query=6,
                                    layout="hybrid"),
}
DETERMINISTIC = {k: dataclasses.replace(p, dtype=F32, deterministic=True)
                 for k, p in CASES_DETERMINISTIC.items()}
# The default mode on the same problem: exact to rounding only.
DEFAULT_F32 = dataclasses.replace(CASES_DETERMINISTIC["mlp-sample"], dtype=F32)

TRAIN = TrainConfig(task="sinusoid", algorithm="maml", steps=20, meta_batch=5, inner_steps=2,
                    inner_lr=0.05, outer_lr=0.01, shots=7, query=5, hidden=16,
                    eval_every=10, eval_tasks=4, eval_steps=3, checkpoint_every=10,
                    deterministic=True)
# world size -> layout of its training run: sample, tasks over processes, a 2 x 2 mesh.
TRAIN_LAYOUTS = {1: "sample", 2: "task", 4: "hybrid"}


def train(cfg: TrainConfig, out: str, resume: bool) -> dict:
    """A training run in `out` (rank 0 prepares the folder); its losses, evaluation, first step
    and final weights."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        _train.prepare_folder(Path(out), cfg, resume, force=False)
    if dist.is_initialized():
        dist.barrier()
    r = _train.train(cfg, out, resume=resume, progress=False,
                     backend="gloo" if dist.is_initialized() else None)
    return {k: r[k] for k in ("losses", "final", "start", "weights")}


def deterministic_settings_differ() -> str:
    """Deterministic mode on ranks whose inner learning rates differ (same collectives, same
    sizes): the first step's check must say so before any work, not return diverging
    weights."""
    p = dataclasses.replace(DETERMINISTIC["mlp-sample"], inner_lr=0.1 + 0.01 * dist.get_rank())
    try:
        S.run(p)
    except (md.CollectiveError, md.OutOfSyncError) as e:
        return str(e)
    return "no error"


def deterministic(root: str, world: int) -> dict:
    """Every deterministic-mode check of one world size (tests/test_deterministic.py). Run
    last: the mode turns oneDNN off for the rest of the process."""
    out: dict = {"default": S.run(DEFAULT_F32)}
    out["cases"] = {name: S.run(p) for name, p in DETERMINISTIC.items()}
    if world in TRAIN_LAYOUTS:
        cfg = dataclasses.replace(TRAIN, layout=TRAIN_LAYOUTS[world]).resolved()
        out["full"] = train(cfg, f"{root}/full", False)
        if world == 1:  # a half run whose checkpoint another world size resumes
            train(dataclasses.replace(cfg, steps=10), f"{root}/half", False)
        if world == 2:  # resumes the one-process run's step-10 checkpoint
            if dist.get_rank() == 0:
                shutil.copytree(f"{root}/../w1/half", f"{root}/cross")
            dist.barrier()
            out["cross"] = train(cfg, f"{root}/cross", True)
    if world > 1:
        out["settings_differ"] = deterministic_settings_differ()
    return out




def what_a_rank_starts_with() -> dict:
    """What a started rank sees of its caller and of the interpreter's state."""
    import os

    import metaddp._host as host

    return {"env": os.environ.get("METADDP_LAUNCH_PROBE"), "rank": dist.get_rank(),
            "threads": torch.get_num_threads(), "dtype": str(torch.get_default_dtype()),
            "in_step": host.in_step()}


def freed_memory_kept_mib() -> float:
    """How much of a freed 256 MiB tensor a rank's process still holds (resident MiB)."""
    import resource

    page = resource.getpagesize()

    def resident() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page / 2**20

    before = resident()
    block = torch.ones(64 * 2**20)  # 256 MiB, every page written
    del block
    return resident() - before


def deterministic_sum_out_of_step(dtype_name: str) -> str:
    """Rank 1 skips one collective before a fixed-point sum: what each rank is told."""
    from metaddp.distributed import _collectives, _fixed

    if dist.get_rank() == 1:
        _collectives._next_sequence(None)
    try:
        _fixed.fixed_sum([torch.ones(2, 3, 4, dtype=getattr(torch, dtype_name))], None)
    except _collectives.CollectiveError as e:
        return str(e)
    return "no error"


def summed_gradients_twice(overlap: bool) -> dict:
    """sync_grads() refuses gradients that already hold its SUM; legitimate patterns pass.

    Returns each pattern's first-layer gradient (or the error's text), on this rank.
    """
    torch.manual_seed(0)
    net = nn.Linear(1, 1).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1), md.Mesh.create(), overlap=overlap)
    x = torch.linspace(-1, 1, 8, dtype=torch.float64)[:, None]
    whole = [md.Task(md.Batch(x, 2 * x, 8), md.Batch(x, 3 * x, 8))]
    loss_fn = lambda p, y: (p - y) ** 2  # noqa: E731
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # steps that leave the weights alone

    def step(zero: str | None = "none", syncs: int = 1, backwards: int = 1):
        if zero is not None:
            opt.zero_grad(set_to_none=zero == "none")
        try:
            for _ in range(backwards):
                learner.meta_loss(learner.shard(whole), loss_fn).backward()
            for _ in range(syncs):
                learner.sync_grads()
        except RuntimeError as e:
            return str(e)
        opt.step()
        return net.weight.grad.item()

    return {
        "once": step(),
        "zeroed in place": step(zero="in place"),
        "two backwards, one sync": step(backwards=2),
        "sync twice": step(syncs=2),
        "not zeroed": step(zero=None),
        "after the refusals": step(),
    }


def free_grad_without_reduce() -> list:
    """metaddp.grad and inner_loop on several processes: refused without reduce=, a rank's own
    gradient with identity_reduce given."""
    net = nn.Linear(1, 1).double()
    params = dict(net.named_parameters())
    x = torch.ones(2, 1, dtype=torch.float64)
    loss = md.share((net(x) - x) ** 2, 4)
    out = []
    for call in (lambda: md.grad(loss, params, retain_graph=True),
                 lambda: md.inner_loop(net, params, md.Batch(x, x, 4), lambda p, y: (p - y) ** 2,
                                       steps=1, optimizer=md.sgd(0.1))):
        try:
            call()
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    (own,) = torch.autograd.grad(loss, [params["weight"]], retain_graph=True)
    g = md.grad(loss, params, reduce=md.identity_reduce)
    out.append(bool(torch.equal(g["weight"], own)))
    return out


def captured_leaf() -> dict:
    """A meta-loss that reads a tensor needing a gradient from outside the module: refused on
    every rank (sync_grads() would leave each rank its own shard's gradient), the same search
    again after a refusal; registered on the model, its gradient is the task's at any size.

    Returns each case's error text, or the registered scale's gradient and the loss."""
    torch.manual_seed(0)
    net = nn.Linear(1, 1).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1), md.Mesh.create())
    x = torch.linspace(-1, 1, 8, dtype=torch.float64)[:, None]
    whole = [md.Task(md.Batch(x, 2 * x, 8), md.Batch(x, 3 * x, 8))]
    scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    loss_fn = lambda p, y: scale * (p - y).squeeze(-1) ** 2  # noqa: E731

    def refused(fn, through=learner) -> str:
        try:
            through.meta_loss(learner.shard(whole), fn)
        except ValueError as e:
            return str(e)
        return "accepted"

    out = {"captured": refused(loss_fn), "captured again": refused(loss_fn),
           "captured module": refused(loss_fn, learner.module)}
    # The same tensor as a parameter of the algorithm: summed like any other.
    learner.release()
    alg = md.MAML(net, inner_lr=0.1)
    alg.register_parameter("scale", nn.Parameter(scale.detach().clone()))
    learner = md.MetaDDP(alg, md.Mesh.create())
    registered = lambda p, y: alg.scale * (p - y).squeeze(-1) ** 2  # noqa: E731
    loss = learner.meta_loss(learner.shard(whole), registered)
    loss.backward()
    (total,) = learner.sync_grads(loss.detach().reshape(1))
    out["scale grad"], out["loss"] = alg.scale.grad.item(), total
    learner.release()
    return out


def dropout_keyed() -> dict:
    """A model with dropout in training mode under MetaDDP, samples split: meta_loss and adapt
    key its masks by the samples; clone()'s own forwards and RReLU cannot be keyed and are
    refused; in eval mode dropout is the identity.

    Returns each case's loss and first-layer gradient, or its error text."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 1)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1, steps=2), md.Mesh.create())
    x = torch.linspace(-1, 1, 8, dtype=torch.float64)[:, None]
    whole = [md.Task(md.Batch(x, 2 * x, 8), md.Batch(x, 3 * x, 8)) for _ in range(2)]
    mse = lambda p, y: (p - y).squeeze(-1) ** 2  # noqa: E731

    def refused(call) -> str:
        try:
            call()
        except ValueError as e:
            return str(e)
        return "accepted"

    def step() -> dict:
        net.zero_grad()
        loss = learner.meta_loss(learner.shard(whole), mse)
        loss.backward()
        (total,) = learner.sync_grads(loss.detach().reshape(1))
        return {"loss": total, "grad": net[0].weight.grad.reshape(-1).tolist()}

    out: dict = {"step 0": step(), "step 1": step()}
    mine = learner.shard(whole)
    fast = learner.adapt(mine[0].support, mse)
    out["adapt"] = fast["0.weight"].reshape(-1).tolist()
    out["clone"] = refused(lambda: learner.module.clone()(x))
    out["own forward"] = refused(lambda: learner(x, fast))  # masks of nobody's samples
    with learner.local() as alg:  # one process's own work: PyTorch's masks
        out["local forward"] = refused(lambda: alg(x, fast))
    rrelu = nn.Sequential(nn.Linear(1, 8), nn.RReLU(), nn.Linear(8, 1)).double()
    rough = md.MetaDDP(md.MAML(rrelu, inner_lr=0.1), md.Mesh.create())
    out["rrelu"] = refused(lambda: rough.meta_loss(rough.shard(whole), mse))
    rough.release()
    net.eval()
    out["eval"] = step()
    net.train()
    learner.module.at_step(5 + md.rank())  # ranks told different meta-steps: other masks
    try:
        step()
        out["steps differ"] = "accepted"
    except md.CollectiveError as e:
        out["steps differ"] = str(e)
    learner.release()
    return out


def user_mistakes() -> dict:
    """Mistakes a user makes through the public API, each an error on several processes:
    whole tasks where samples are split, a gradient edited before sync_grads(), an optimizer
    step without sync_grads(), dropout called inside a forward. Returns each case's error text (or
    "accepted"), and a correct step's loss and gradient for comparison."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.1), md.Mesh.create())
    x = torch.linspace(-1, 1, 8, dtype=torch.float64)[:, None]
    whole = [md.Task(md.Batch(x, (2 + i) * x, 8), md.Batch(x, (3 + i) * x, 8)) for i in range(2)]
    mse = lambda p, y: (p - y).squeeze(-1) ** 2  # noqa: E731
    opt = torch.optim.SGD(learner.parameters(), lr=0.01)

    def outcome(call) -> str:
        try:
            call()
        except (ValueError, RuntimeError) as e:
            return str(e)
        return "accepted"

    def step(edit=None) -> None:
        opt.zero_grad()
        learner.meta_loss(learner.shard(whole), mse).backward()
        if edit is not None:
            edit()
        learner.sync_grads()
        opt.step()

    def unsummed() -> None:  # sync_grads() forgotten before the step, then called
        opt.zero_grad()
        learner.meta_loss(learner.shard(whole), mse).backward()
        out.setdefault("unsummed", []).append(outcome(opt.step))
        learner.sync_grads()
        opt.step()

    clip = lambda: torch.nn.utils.clip_grad_norm_(learner.parameters(), 0.01)  # noqa: E731
    out: dict = {}
    unsummed()  # before sums start during the backward (and later, after they do)
    out |= {
        "whole": outcome(lambda: learner.meta_loss(whole, mse)),
        "whole adapt": outcome(lambda: learner.adapt(whole[0].support, mse)),
        "clip at once": outcome(lambda: step(clip)),
    }
    for _ in range(3):  # sums now start during the backward
        step()
    out["clip later"] = outcome(lambda: step(clip))
    out["replaced later"] = outcome(
        lambda: step(lambda: setattr(net[0].weight, "grad", net[0].weight.grad * 2))
    )
    unsummed()

    def clip_on(**options) -> str:  # the sums that start after the backward refuse it too
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
        other = md.MetaDDP(md.MAML(model, inner_lr=0.1), md.Mesh.create(), **options)
        other.meta_loss(other.shard(whole), mse).backward()
        torch.nn.utils.clip_grad_norm_(other.parameters(), 0.01)
        said = outcome(other.sync_grads)
        other.release()
        return said

    out["clip sharded"] = clip_on(shard=True)
    out["clip not overlapped"] = clip_on(overlap=False)

    class Drops(nn.Module):  # dropout called in the forward, not as a layer
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(1, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.b(torch.nn.functional.dropout(self.a(x).tanh(), 0.3, self.training))

    class Noisy(nn.Module):  # a random draw metaddp cannot key
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(1, 1)

        def forward(self, x):
            return self.a(x) + 0.1 * torch.randn_like(x)

    drops = md.MetaDDP(md.MAML(Drops().double(), inner_lr=0.1, batched=False), md.Mesh.create())
    mine = drops.shard(whole)
    # Keyed: this rank's share of the loss (summed over the ranks), and of the adapted weights.
    out["F.dropout"] = float(md.global_value(drops.meta_loss(mine, mse)))
    out["F.dropout module"] = float(md.global_value(drops.module.meta_loss(mine, mse)))
    fast = drops.adapt(mine[0].support, mse)
    out["F.dropout adapt"] = float(fast["a.weight"].detach().sum())
    noisy = md.MetaDDP(md.MAML(Noisy().double(), inner_lr=0.1, batched=False), md.Mesh.create())
    out["randn"] = outcome(lambda: noisy.meta_loss(noisy.shard(whole), mse))
    noisy.release()
    drops.module.eval()
    out["F.dropout eval"] = outcome(lambda: drops.meta_loss(mine, mse))
    drops.release()
    learner.release()
    return out


def clone_loop_growing() -> dict:
    """learn2learn's loop through MetaDDP.clone(): one backward per task, one task per rank
    for three steps, then three; plain SGD. Returns the weights after each step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    alg = md.MetaDDP(md.MAML(net, inner_lr=0.1), md.Mesh.create(tasks=md.world_size()))
    opt = torch.optim.SGD(alg.parameters(), lr=0.05)
    x = torch.linspace(-1, 1, 6, dtype=torch.float64)[:, None]
    out = []
    for t, count in enumerate([2, 2, 2, 6, 6]):
        def task(i: int, t: int = t) -> md.Task:
            return md.Task(md.Batch(x, (1 + i + t) * x.sin(), 6), md.Batch(x, (2 + i) * x, 6))

        batch = alg.shard(count, task)
        opt.zero_grad()
        for tk in batch:
            learner = alg.clone()
            learner.adapt(md.share((learner(tk.support.x) - tk.support.y).squeeze(-1) ** 2,
                                   tk.support))
            q = md.share((learner(tk.query.x) - tk.query.y).squeeze(-1) ** 2, tk.query)
            (q / batch.n).backward()
        alg.sync_grads()
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist())
    alg.release()
    return {"weights": out}


def meetings_at_the_store() -> dict:
    """Two meetings of every rank, then rank 0 alone at a third (the others never come)."""
    import time

    from metaddp.distributed import _mesh

    out = {}
    for name in ("first", "second"):
        start = time.monotonic()
        _mesh._meet_at_store(dist.get_world_size(), 30)
        out[name] = time.monotonic() - start
    dist.barrier()
    if dist.get_rank() == 0:
        start = time.monotonic()
        _mesh._meet_at_store(dist.get_world_size(), 0.3)
        out["alone"] = time.monotonic() - start
    dist.barrier()
    return out
