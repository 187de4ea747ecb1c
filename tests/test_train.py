"""Training runs: the trainer against a plain loop, exact resume, and resume on other process counts.

All training checks of one world size run in one spawned process group (spawning costs
seconds); the runs are tiny (float64 sinusoid MAML, a few steps) so that every number can be
compared exactly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from metaddp.distributed.launch import run_local
from metaddp.tasks import Sinusoid
from metaddp.train import TrainConfig
from workers import train as run  # a run in a folder rank 0 prepares

CFG = TrainConfig(task="sinusoid", algorithm="maml", steps=8, meta_batch=5, inner_steps=2,
                  inner_lr=0.05, outer_lr=0.01, shots=7, query=5, hidden=16, dtype="float64",
                  eval_every=4, eval_tasks=6, eval_steps=3, checkpoint_every=4).resolved()


def worker(root: str, layout: str, resume_from: str | None) -> dict:
    """Every run of one world size: whole; half, then resumed; resumed from another world size.

    After the half run, rank 0 copies its folder to ``root/handoff`` so that another world
    size can resume the same step-4 checkpoint.
    """
    import shutil

    cfg = dataclasses.replace(CFG, layout=layout)
    out = {"full": run(cfg, f"{root}/full", False)}
    out["half"] = run(dataclasses.replace(cfg, steps=4), f"{root}/split", False)
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.copytree(f"{root}/split", f"{root}/handoff")
    out["resumed"] = run(cfg, f"{root}/split", True)
    if resume_from is not None:
        out["cross"] = run(cfg, resume_from, True)
    return out


def plain_maml(cfg: TrainConfig) -> dict:
    """Second-order MAML with Adam, one process, written out without metaddp's machinery."""
    fam = Sinusoid(cfg.shots, cfg.query, cfg.hidden)
    torch.manual_seed(cfg.seed)
    net = fam.model().double()
    opt = torch.optim.Adam(net.parameters(), lr=cfg.outer_lr)

    def adapt(params, x, y, steps, create_graph):
        for _ in range(steps):
            loss = F.mse_loss(torch.func.functional_call(net, params, (x,)), y)
            g = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph)
            params = {n: p - cfg.inner_lr * gi for (n, p), gi in zip(params.items(), g)}
        return params

    losses = []
    for step in range(cfg.steps):
        opt.zero_grad()
        total = 0.0
        for i in range(cfg.meta_batch):
            t = fam.task(cfg.seed, step * cfg.meta_batch + i)
            fast = adapt(dict(net.named_parameters()), t.support.x.double(), t.support.y.double(),
                         cfg.inner_steps, True)
            total = total + F.mse_loss(torch.func.functional_call(net, fast, (t.query.x.double(),)),
                                       t.query.y.double())
        loss = total / cfg.meta_batch
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    before, after = [], []
    for i in range(cfg.eval_tasks):
        t = fam.task(cfg.seed, i, "test")
        params = {n: p.detach().requires_grad_() for n, p in net.named_parameters()}
        for k, acc in ((0, before), (cfg.eval_steps, after)):
            fast = adapt(params, t.support.x.double(), t.support.y.double(), k, False)
            acc.append(float(F.mse_loss(torch.func.functional_call(net, fast, (t.query.x.double(),)).detach(),
                                        t.query.y.double())))
    return {"losses": losses, "weights": {f"model.{n}": p.detach() for n, p in net.named_parameters()},
            "before": sum(before) / len(before), "after": sum(after) / len(after)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    one = run_local(worker, 1, str(root / "w1"), "sample", None)[0]
    # Two processes, task-parallel (5 tasks split 2 + 3), which also resume the one-process
    # run's step-4 checkpoint: another world size and another layout.
    two = run_local(worker, 2, str(root / "w2"), "task", str(root / "w1" / "handoff"))
    return {"root": root, "one": one, "two": two, "plain": plain_maml(CFG)}


def rel(a, b) -> float:
    """Largest difference relative to the largest magnitude (numbers, lists or weight dicts)."""
    if isinstance(a, dict):
        scale = max(float(v.abs().max()) for v in a.values())
        return max(float((a[k] - b[k]).abs().max()) for k in a) / scale
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / a.abs().max())


# Float64 throughout. The trainer and the plain loop add the same numbers in different orders
# (shares of sums versus means; task shards summed across processes), which moves a result by
# a few ulps per operation; measured after eight Adam steps on a 16-unit network: 2e-16. 1e-10
# leaves room for Adam's division by small second moments while any real error (a wrong
# weighting, a missing task, a first-order gradient) shows at 1e-3 or more.
TOL = 1e-10


def test_trainer_matches_plain_maml(runs):
    one, plain = runs["one"], runs["plain"]
    assert len(one["full"]["losses"]) == CFG.steps
    assert rel(plain["losses"], one["full"]["losses"]) < TOL
    assert rel(plain["weights"], one["full"]["weights"]) < TOL
    # Meta-test: the mean query MSE over held-out tasks before and after adaptation.
    assert abs(one["full"]["final"]["test_before"] - plain["before"]) < TOL * plain["before"]
    assert abs(one["full"]["final"]["test_after"] - plain["after"]) < TOL * plain["after"]
    # And the model learned something in eight steps: the meta-loss went down.
    assert one["full"]["losses"][-1] < one["full"]["losses"][0]


@pytest.mark.parametrize("world", ["one", "two"])
def test_resume_on_same_processes_is_bitwise_identical(runs, world):
    r = runs["one"] if world == "one" else runs["two"][0]
    assert r["resumed"]["start"] == 4
    assert r["half"]["losses"] + r["resumed"]["losses"] == r["full"]["losses"]
    for k, v in r["full"]["weights"].items():
        assert torch.equal(v, r["resumed"]["weights"][k]), k
    assert r["resumed"]["final"] == r["full"]["final"]
    # The resumed folder's metrics file has each step once, with the uninterrupted values.
    folder = runs["root"] / ("w1" if world == "one" else "w2")
    split = (folder / "split" / "metrics.csv").read_text().splitlines()
    full = (folder / "full" / "metrics.csv").read_text().splitlines()

    def without_seconds(lines):
        return [[x for i, x in enumerate(line.split(",")) if i != 2] for line in lines]

    assert len(full) == CFG.steps + 1
    assert without_seconds(split) == without_seconds(full)


def test_two_processes_follow_the_one_process_trajectory(runs):
    one, two = runs["one"]["full"], runs["two"]
    for rank_result in two:
        assert rel(one["losses"], rank_result["full"]["losses"]) < TOL
        assert rel(one["weights"], rank_result["full"]["weights"]) < TOL
    # Both ranks hold the same weights, bit for bit (MetaDDP keeps them in step).
    for k, v in two[0]["full"]["weights"].items():
        assert torch.equal(v, two[1]["full"]["weights"][k])
    for key in ("test_before", "test_after", "test_after_ci"):
        assert abs(one["final"][key] - two[0]["full"]["final"][key]) < TOL * abs(one["final"][key])


def test_resume_on_other_process_count_and_layout(runs):
    one, cross = runs["one"]["full"], runs["two"][0]["cross"]
    assert cross["start"] == 4
    assert rel(one["losses"][4:], cross["losses"]) < TOL
    assert rel(one["weights"], cross["weights"]) < TOL
