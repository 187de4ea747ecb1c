"""What the always-on checks cost over a run: 1,000 meta-steps, checked steps against the rest.

Two processes (gloo on CPU) split every task's samples of sinusoid MAML, the layout where the
checks compare most (the meta-batch's size, every batch's global size, the tasks' fingerprints,
``make_task`` built twice, the weights). Every step builds its meta-batch with
``learner.shard(n, make_task)``, then meta_loss, backward, sync_grads and an optimizer step.
The checked steps are the first and 1, 4, 16, 64, 256 (docs/guarantees.md). A second run of
the same 1,000 steps turns the checks off (``schedule.due`` always false), in the same
processes, alternating blocks of 50 steps between the two learners so that both see the
same machine.

Printed: the run's seconds with and without checks, their ratio, and the excess of the
checked steps over the median step (the checks' own cost) as a share of the run.

    python benchmarks/first_step_check.py --json benchmarks/results/first_step_check.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
from quickstart import task  # noqa: E402  (the README's sinusoid task, 10 + 10 samples)

import metaddp as md  # noqa: E402
from common import run_record, save_json  # noqa: E402
from metaddp.distributed.launch import run_local  # noqa: E402

TASKS = 8


def mse(p, y):
    return F.mse_loss(p, y, reduction="none")


def worker(steps: int, block: int) -> dict:
    learners, opts, times = {}, {}, {}
    for name in ("checked", "unchecked"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(),
                            nn.Linear(40, 1))
        learners[name] = md.MetaDDP(md.MAML(net, inner_lr=0.01), md.Mesh.create())
        opts[name] = torch.optim.Adam(learners[name].parameters(), 1e-3)
        times[name] = []
    learners["unchecked"].guards.schedule.due = lambda: False  # the same run, never checked
    due = []
    for start in range(0, steps, block):
        for name, learner in learners.items():
            for step in range(start, min(start + block, steps)):
                if name == "checked":
                    due.append(learner.guards.schedule.due())
                t0 = time.perf_counter()
                batch = learner.shard(TASKS, lambda i, s=step: task(s * TASKS + i))
                opts[name].zero_grad()
                learner.meta_loss(batch, mse).backward()
                learner.sync_grads()
                opts[name].step()
                times[name].append(time.perf_counter() - t0)
    checked = times["checked"]
    median = statistics.median(checked)
    excess = sum(t - median for t, d in zip(checked, due) if d)
    return dict(checked_s=sum(checked), unchecked_s=sum(times["unchecked"]),
                checked_steps=[i for i, d in enumerate(due) if d], median_step_s=median,
                excess_s=excess, excess_share=excess / sum(checked))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    r = run_local(worker, 2, args.steps, args.block, threads=1)[0]
    print(f"{args.steps} steps, 2 processes, sample layout, sinusoid MAML ({TASKS} tasks)")
    print(f"checked steps: {r['checked_steps']}")
    print(f"run: {r['checked_s']:.2f} s with the checks, {r['unchecked_s']:.2f} s without "
          f"({r['checked_s'] / r['unchecked_s']:.3f}x)")
    print(f"checked steps' excess over the median step ({1e3 * r['median_step_s']:.2f} ms): "
          f"{1e3 * r['excess_s']:.1f} ms, {100 * r['excess_share']:.2f}% of the run")
    if args.json:
        save_json(args.json, run_record(args=vars(args) | {"json": str(args.json)}, result=r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
