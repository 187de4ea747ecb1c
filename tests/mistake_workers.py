"""The mistakes a new user makes with the public API, each written as such a user writes it.

Every case builds its own learner (so that each is that learner's first meta-step, the one
metaddp always checks) and returns ``("error", type, message)`` or ``("grad", [...])``: the
meta-gradient it ended with, which the tests compare with :func:`reference_grad`, a
float64 single-process computation that uses no metaddp code path.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

import metaddp as md

N_TASKS, N_SUPPORT, N_QUERY, INNER_LR = 3, 7, 5, 0.1


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def whole_task(i: int) -> md.Task:
    """Global task ``i``, from a seed and ``i`` alone: a sine of its own amplitude and phase."""
    g = md.generator_for(0, i)
    amp, phase = 1 + 4 * torch.rand((), generator=g), 3 * torch.rand((), generator=g)
    xs, xq = (4 * torch.rand(n, 1, generator=g, dtype=torch.float64) - 2 for n in (7, 5))
    return md.Task(
        md.Batch(xs, amp * torch.sin(xs + phase), N_SUPPORT),
        md.Batch(xq, amp * torch.sin(xq + phase), N_QUERY),
    )


def reference_grad(n_tasks: int = N_TASKS) -> list[float]:
    """The one-process float64 meta-gradient of second-order MAML on tasks 0..n-1 (plain
    autograd and mean losses, tests/reference.py)."""
    from reference import maml_meta_grad

    net = make_net()
    tasks = [tuple(whole_task(i)) for i in range(n_tasks)]
    _, grads = maml_meta_grad(
        net, tasks, steps=1, inner_lr=INNER_LR, first_order=False, classification=False
    )
    return torch.cat([g.reshape(-1) for g in grads.values()]).tolist()


def mse(pred, y):
    return F.mse_loss(pred, y, reduction="none")


def _flat_grad(net: nn.Module) -> list[float]:
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()]).tolist()


def _outcome(case) -> tuple:
    try:
        return ("grad", case())
    except (ValueError, RuntimeError, TypeError, FloatingPointError) as e:
        return ("error", type(e).__name__, str(e))


def _learner(tasks: int = 1, check: bool = False):
    net = make_net()
    return net, md.MetaDDP(md.MAML(net, inner_lr=INNER_LR), md.Mesh.create(tasks=tasks), check=check)


def _meta_step(learner, net, tasks) -> list[float]:
    learner.meta_loss(tasks, mse).backward()
    learner.sync_grads()
    return _flat_grad(net)


def _clone_loop(adapt_loss, tasks: int = 1) -> list[float]:
    net, learner = _learner(tasks)
    batch = learner.shard(N_TASKS, whole_task)
    for t in batch:
        fast = learner.clone()
        fast.adapt(adapt_loss(fast, t.support))
        (md.share(mse(fast(t.query.x), t.query.y), t.query) / batch.n).backward()
    learner.sync_grads()
    return _flat_grad(net)


def correct_meta_loss() -> list[float]:
    net, learner = _learner()
    return _meta_step(learner, net, learner.shard(N_TASKS, whole_task))


def correct_clone() -> list[float]:
    return _clone_loop(lambda fast, b: md.share(mse(fast(b.x), b.y), b))


def _hand_loop(inner_grad) -> list[float]:
    """The question's shape written by hand: one inner step per task, ``inner_grad(learner,
    loss, params)`` its gradient, then the query shares and one backward."""
    net, learner = _learner()
    params = dict(net.named_parameters())
    batch = learner.shard(N_TASKS, whole_task)
    total = 0
    for t in batch:
        loss = md.share(mse(md.call(net, params, t.support.x), t.support.y), t.support)
        g = inner_grad(learner, loss, params)
        fast = {k: p - INNER_LR * g[k] for k, p in params.items()}
        total = total + md.share(mse(md.call(net, fast, t.query.x), t.query.y), t.query)
    (total / batch.n).backward()
    learner.sync_grads()
    return _flat_grad(net)


def correct_hand_loop() -> list[float]:
    return _hand_loop(lambda learner, loss, params: learner.grad(loss, params))


def clone_plain_mean() -> list[float]:
    return _clone_loop(lambda fast, b: F.mse_loss(fast(b.x), b.y))


def clone_local_count() -> list[float]:
    return _clone_loop(lambda fast, b: md.share(mse(fast(b.x), b.y), len(b.x)))


def local_own_count() -> list[float]:
    net, learner = _learner()
    r, w = md.rank(), md.world_size()
    tasks = []
    for i in range(N_TASKS):
        s, q = whole_task(i)
        rs, rq = md.shard_range(s.n, r, w), md.shard_range(q.n, r, w)
        xs, ys = s.x[rs.start : rs.stop], s.y[rs.start : rs.stop]
        xq, yq = q.x[rq.start : rq.stop], q.y[rq.start : rq.stop]
        tasks.append(md.Task(md.Batch.local(xs, ys, len(xs)), md.Batch.local(xq, yq, len(xq))))
    return _meta_step(learner, net, tasks)


def _own_tasks() -> list[md.Task]:
    mine = md.shard_range(N_TASKS, md.rank(), md.world_size())
    return [whole_task(i) for i in mine]


def own_tasks_to_shard() -> list[float]:
    net, learner = _learner(tasks=md.world_size())
    return _meta_step(learner, net, learner.shard(_own_tasks()))


def own_tasks_to_shard_samples() -> list[float]:
    net, learner = _learner()
    return _meta_step(learner, net, learner.shard(_own_tasks()))


def own_tasks_to_metabatch() -> list[float]:
    net, learner = _learner(tasks=md.world_size())
    m = learner.mesh
    batch = md.MetaBatch.shard(_own_tasks(), task_index=m.task_index, task_parts=m.tasks)
    return _meta_step(learner, net, batch)


def hand_loop_autograd() -> list[float]:
    def rank_local(learner, loss, params):  # torch.autograd.grad alone: this rank's shard
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        return dict(zip(params, grads, strict=True))

    return _hand_loop(rank_local)


def rank_seeded_sampler() -> list[float]:
    net, learner = _learner()

    def task(i: int) -> md.Task:
        return whole_task(i + 10 * md.rank())  # the sampler seeded with the rank

    return _meta_step(learner, net, learner.shard(N_TASKS, task))


def rank_seeded_sampler_tasks() -> list[float]:
    net, learner = _learner(tasks=md.world_size())

    def task(i: int) -> md.Task:
        return whole_task(i + 10 * md.rank())

    return _meta_step(learner, net, learner.shard(N_TASKS, task))


def global_generator_task() -> list[float]:
    net, learner = _learner()
    torch.manual_seed(1)  # every rank alike

    def task(i: int) -> md.Task:
        xs, xq = torch.rand(7, 1, dtype=torch.float64), torch.rand(5, 1, dtype=torch.float64)
        return md.Task(md.Batch(xs, xs.sin(), 7), md.Batch(xq, xq.sin(), 5))

    return _meta_step(learner, net, learner.shard(N_TASKS, task))


def distributed_sampler() -> list[float]:
    net, learner = _learner(tasks=md.world_size())
    sampler = DistributedSampler(range(7), md.world_size(), md.rank(), shuffle=False)
    return _meta_step(learner, net, [whole_task(i) for i in sampler])


def clone_plain_mean_whole_tasks() -> list[float]:
    # Where every rank holds whole tasks, a plain mean is the task's own mean: exact.
    return _clone_loop(lambda fast, b: F.mse_loss(fast(b.x), b.y), tasks=md.world_size())


def task_counts_differ() -> list[float]:
    net, learner = _learner()
    mine = [t.split(md.rank(), md.world_size()) for t in (whole_task(i) for i in range(N_TASKS))]
    return _meta_step(learner, net, mine[: N_TASKS - md.rank() % 2])


def nan_query_target() -> list[float]:
    net, learner = _learner()

    def task(i: int) -> md.Task:
        s, q = whole_task(i)
        y = q.y.clone()
        if i == 0:
            y[0] = float("nan")  # on the first rank's shard only
        return md.Task(s, md.Batch(q.x, y, q.n))

    return _meta_step(learner, net, learner.shard(N_TASKS, task))


def ddp_inside() -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    net = make_net()
    learner = md.MetaDDP(md.MAML(DistributedDataParallel(net), inner_lr=INNER_LR))
    return _meta_step(learner, net, learner.shard(N_TASKS, whole_task))


def clone_query_own_count() -> list[float]:
    # The support share is right; the query's is of the rank's own count. Check mode
    # compares the caller's shares (docs/guarantees.md: on other steps it is not seen).
    net, learner = _learner(check=True)
    batch = learner.shard(N_TASKS, whole_task)
    for t in batch:
        fast = learner.clone()
        fast.adapt(md.share(mse(fast(t.support.x), t.support.y), t.support))
        (md.share(mse(fast(t.query.x), t.query.y), len(t.query.x)) / batch.n).backward()
    learner.sync_grads()
    return _flat_grad(net)


def _clone_steps(learner, query_loss) -> None:
    """A clone() loop over the meta-batch whose query loss is ``query_loss(fast, t, batch)``,
    backward per task."""
    batch = learner.shard(N_TASKS, whole_task)
    for i, t in enumerate(batch):
        fast = learner.clone()
        fast.adapt(md.share(mse(fast(t.support.x), t.support.y), t.support))
        query_loss(fast, t, batch, i).backward()


def _chunked(fast, t, batch, i):
    # The query's forward in two chunks (memory), each a share of the whole query's count.
    q, k = t.query, (len(t.query.x) + 1) // 2
    parts = ((q.x[:k], q.y[:k]), (q.x[k:], q.y[k:]))
    return sum(md.share(mse(fast(x), y), q.n) for x, y in parts) / batch.n


def clone_query_chunked() -> list[float]:
    net, learner = _learner()
    _clone_steps(learner, _chunked)
    learner.sync_grads()
    return _flat_grad(net)


def clone_query_masked_terms() -> list[float]:
    # A semi-supervised query loss: a labeled term over the task's labeled count, scaled
    # back to the query's mean, and an unlabeled term; a rank holding no labeled sample skips
    # its term, so the ranks make their shares in other orders.
    labeled_at = ({0, 1}, {3, 4}, {1, 3})  # global query indices labeled, per task

    def loss(fast, t, batch, i):
        q, start = t.query, t.query.start or 0
        labeled = torch.tensor([start + j in labeled_at[i] for j in range(len(q.x))])
        per, n_labeled = mse(fast(q.x), q.y), len(labeled_at[i])
        out = md.share(per[~labeled], q.n)
        if labeled.any():
            out = out + md.share(per[labeled], n_labeled) * (n_labeled / q.n)
        return out / batch.n

    net, learner = _learner()
    _clone_steps(learner, loss)
    learner.sync_grads()
    return _flat_grad(net)


def clone_query_over_all_samples() -> list[float]:
    # Each task's query share of the meta-batch's sample count: share(l, q) / batch.n.
    net, learner = _learner()
    _clone_steps(learner, lambda f, t, b, i: md.share(mse(f(t.query.x), t.query.y), b.n * t.query.n))
    learner.sync_grads()
    return _flat_grad(net)


def clone_query_split_by_batch_tasks() -> list[float]:
    # Whole tasks per rank, each query cut in two by Batch.split on the same rank.
    def loss(fast, t, batch, i):
        parts = [md.Batch.split(t.query.x, t.query.y, j, 2) for j in range(2)]
        return sum(md.share(mse(fast(b.x), b.y), b) for b in parts) / batch.n

    net, learner = _learner(tasks=md.world_size())
    _clone_steps(learner, loss)
    learner.sync_grads()
    return _flat_grad(net)


def two_learners_interleaved() -> list[float]:
    # Two learners in one process, their steps interleaved: one splits samples, the other
    # gives each rank whole tasks (a second model trained beside the first).
    net, learner = _learner()
    _, other = _learner(tasks=md.world_size())
    _clone_steps(learner, _chunked)
    _clone_steps(other, _chunked)
    learner.sync_grads()
    other.sync_grads()
    return _flat_grad(net)


def bilevel_outer_weight_by_rank() -> list[float]:
    # The second loss function of a step (Bilevel's outer loss) weighted per rank.
    net, w = make_net(), 1.0 if md.rank() == 0 else 2.0
    outer = lambda p, y: w * mse(p, y)  # noqa: E731
    learner = md.MetaDDP(md.Bilevel(net, inner_loss=mse, outer_loss=outer, inner_lr=INNER_LR))
    learner.meta_loss(learner.shard(N_TASKS, whole_task)).backward()
    learner.sync_grads()
    return _flat_grad(net)


def loss_weight_by_rank_later() -> list[float]:
    # A loss weight read from a per-rank setting that starts to differ at the third step:
    # check mode compares the loss functions on every step, not only on the first.
    net = make_net()
    learner = md.MetaDDP(md.MAML(net, inner_lr=INNER_LR), check=True)
    setting = {"w": 1.0}
    loss = lambda p, y: setting["w"] * mse(p, y)  # noqa: E731
    for step in range(3):
        if step == 2 and md.rank() > 0:
            setting["w"] = 2.0
        net.zero_grad()
        learner.meta_loss(learner.shard(N_TASKS, whole_task), loss).backward()
        learner.sync_grads()
    return _flat_grad(net)


def per_task_loss_task_layout() -> list[float]:
    # Each task's own loss weight (task i's, whichever rank adapts it): in the task layout the
    # ranks run other tasks, so their loss functions differ, rightly. The reference is the
    # same program on one process.
    net, learner = _learner(tasks=md.world_size())
    batch = learner.shard(N_TASKS, whole_task)
    for i, t in zip(batch.indices, batch, strict=True):
        w = 1.0 + i
        loss = lambda p, y, w=w: w * mse(p, y)  # noqa: E731
        fast = learner.adapt(t.support, loss)
        (md.share(loss(learner(t.query.x, fast), t.query.y), t.query) / batch.n).backward()
    learner.sync_grads()
    return _flat_grad(net)


def validation_after_training_task_layout() -> list[float]:
    # Two training tasks (a rank at 3 processes holds none), then a validation meta-loss of
    # another loss function in the same step, its value only.
    net, learner = _learner(tasks=md.world_size())
    learner.meta_loss(learner.shard(2, whole_task), mse).backward()
    learner.meta_loss(learner.shard(3, lambda i: whole_task(50 + i)), lambda p, y: (p - y).abs()).item()
    learner.sync_grads()
    return _flat_grad(net)


def local_evaluation_then_training_and_validation() -> list[float]:
    # Rank 0 evaluates a whole task alone first (learner.local(), whole tasks per rank), then
    # every rank trains and validates with another loss: rank 0's own meta_loss takes no
    # place among the ranks' calls.
    net, learner = _learner(tasks=md.world_size())
    l1 = lambda p, y: (p - y).abs()  # noqa: E731
    if md.rank() == 0:
        with learner.local():
            learner.meta_loss([whole_task(90)], l1).item()
    learner.meta_loss(learner.shard(N_TASKS, whole_task), mse).backward()
    learner.meta_loss(learner.shard(2, lambda i: whole_task(50 + i)), l1).item()
    learner.sync_grads()
    return _flat_grad(net)


def _cut_by_rank(b: md.Batch) -> md.Batch:  # the DDP habit: every rank its rank's slice
    return md.Batch.split(b.x, b.y, md.rank(), md.world_size())


def clone_cut_by_rank_tasks() -> list[float]:
    net, learner = _learner(tasks=md.world_size())
    batch = learner.shard(N_TASKS, whole_task)
    for t in batch:
        fast = learner.clone()
        s, q = _cut_by_rank(t.support), _cut_by_rank(t.query)
        fast.adapt(md.share(mse(fast(s.x), s.y), s))
        (md.share(mse(fast(q.x), q.y), q) / batch.n).backward()
    learner.sync_grads()
    return _flat_grad(net)


def hand_loop_query_cut_by_rank_tasks() -> list[float]:
    # Only the query cut by rank: the inner step is right, the outer share is of a part
    # (compared in check mode).
    net, learner = _learner(tasks=md.world_size(), check=True)
    params = dict(net.named_parameters())
    batch = learner.shard(N_TASKS, whole_task)
    total = 0
    for t in batch:
        loss = md.share(mse(md.call(net, params, t.support.x), t.support.y), t.support)
        g = learner.grad(loss, params)
        fast = {k: p - INNER_LR * g[k] for k, p in params.items()}
        q = _cut_by_rank(t.query)
        total = total + md.share(mse(md.call(net, fast, q.x), q.y), q)
    (total / batch.n).backward()
    learner.sync_grads()
    return _flat_grad(net)


def _loss_weighted_by_rank(tasks: int) -> list[float]:
    net, learner = _learner(tasks)
    w = 1.0 if md.rank() == 0 else 2.0  # a weight read from a node's own config

    def loss(p, y):
        return w * F.mse_loss(p, y, reduction="none")

    learner.meta_loss(learner.shard(N_TASKS, whole_task), loss).backward()
    learner.sync_grads()
    return _flat_grad(net)


def loss_weight_by_rank() -> list[float]:
    return _loss_weighted_by_rank(1)


def loss_weight_by_rank_tasks() -> list[float]:
    return _loss_weighted_by_rank(md.world_size())


def other_loss_by_rank() -> list[float]:
    net, learner = _learner()
    loss = mse if md.rank() == 0 else (lambda p, y: F.huber_loss(p, y, reduction="none"))
    learner.meta_loss(learner.shard(N_TASKS, whole_task), loss).backward()
    learner.sync_grads()
    return _flat_grad(net)


# Global query indices a loss keeps, per task: at 2 processes (query indices 0-2 | 3-4) rank 0
# holds none of task 1's and rank 1 none of task 2's; at 3 (0-1 | 2-3 | 4), ranks 0 and 2.
KEPT = ({0, 1, 2, 3, 4}, {3, 4}, {0, 1, 2})


def _kept(q: md.Batch, i: int) -> torch.Tensor:
    start = q.start or 0
    return torch.tensor([start + j in KEPT[i] for j in range(len(q.x))], dtype=torch.float64)


def query_skipped_where_none_kept() -> list[float]:
    # A filtered query loss, skipped where the rank keeps no sample of it: its backward, and
    # so the adjoints of that task's inner sums, run on the other ranks only.
    net, learner = _learner()
    batch = learner.shard(N_TASKS, whole_task)
    for i, t in enumerate(batch):
        fast = learner.clone()
        fast.adapt(md.share(mse(fast(t.support.x), t.support.y), t.support))
        kept = _kept(t.query, i)
        if kept.any():
            per = mse(fast(t.query.x), t.query.y) * kept[:, None]
            (md.share(per, t.query) / batch.n).backward()
    learner.sync_grads()
    return _flat_grad(net)


def query_skipped_on_a_later_step() -> list[float]:
    # Every task adapted first, then each kept loss's backward; the filter keeps everything
    # but on step 2, an unchecked step, where each rank skips another task's loss: as many
    # adjoints of the same size on every rank, but of other tasks' inner sums.
    net, learner = _learner()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(3):
        opt.zero_grad()
        batch = learner.shard(N_TASKS, whole_task)
        losses = []
        for i, t in enumerate(batch):
            fast = learner.clone()
            fast.adapt(md.share(mse(fast(t.support.x), t.support.y), t.support))
            kept = _kept(t.query, i) if step == 2 else torch.ones(len(t.query.x))
            if kept.any():
                per = mse(fast(t.query.x), t.query.y) * kept[:, None]
                losses.append(md.share(per, t.query) / batch.n)
        for loss in losses:
            loss.backward()
        learner.sync_grads()
        opt.step()
    return _flat_grad(net)


CASES = {
    "correct meta_loss": correct_meta_loss,
    "correct clone": correct_clone,
    "correct hand loop": correct_hand_loop,
    "clone plain mean": clone_plain_mean,
    "clone local count": clone_local_count,
    "Batch.local own count": local_own_count,
    "own tasks to shard (task layout)": own_tasks_to_shard,
    "own tasks to shard (sample layout)": own_tasks_to_shard_samples,
    "own tasks to MetaBatch.shard": own_tasks_to_metabatch,
    "hand loop with autograd.grad": hand_loop_autograd,
    "rank-seeded sampler": rank_seeded_sampler,
    "rank-seeded sampler (task layout)": rank_seeded_sampler_tasks,
    "global generator in make_task": global_generator_task,
    "DistributedSampler over tasks": distributed_sampler,
    "clone plain mean, whole tasks": clone_plain_mean_whole_tasks,
    "task counts differ": task_counts_differ,
    "NaN query target": nan_query_target,
    "DDP inside MAML": ddp_inside,
    "clone query own count": clone_query_own_count,
    "clone cut by rank (task layout)": clone_cut_by_rank_tasks,
    "hand loop query cut by rank (task layout)": hand_loop_query_cut_by_rank_tasks,
    "loss weight by rank": loss_weight_by_rank,
    "loss weight by rank (task layout)": loss_weight_by_rank_tasks,
    "another loss by rank": other_loss_by_rank,
    "clone query in chunks": clone_query_chunked,
    "clone query, masked terms skipped": clone_query_masked_terms,
    "clone query over all samples": clone_query_over_all_samples,
    "clone query split by Batch.split (task layout)": clone_query_split_by_batch_tasks,
    "two learners interleaved": two_learners_interleaved,
    "Bilevel outer loss weight by rank": bilevel_outer_weight_by_rank,
    "loss weight by rank from step 3": loss_weight_by_rank_later,
    "a loss per task (task layout)": per_task_loss_task_layout,
    "a validation loss after training (task layout)": validation_after_training_task_layout,
    "a local evaluation, then training and validation (task layout)": (
        local_evaluation_then_training_and_validation
    ),
    "query loss skipped where a rank keeps none": query_skipped_where_none_kept,
    "query losses skipped by rank on a later step": query_skipped_on_a_later_step,
}


def table() -> dict:
    """Every case's outcome on this rank; ranks must stay in step after each error."""
    out = {}
    for name, case in CASES.items():
        out[name] = _outcome(case)
        if md.rank() == 0 and os.environ.get("MISTAKES_VERBOSE"):
            print(name, out[name][0], out[name][-1] if out[name][0] == "error" else "", flush=True)
        dist.barrier()
    return out
