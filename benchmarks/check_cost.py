"""What check mode costs: one sample-parallel meta-step with check mode off and on, side by side.

Two processes (gloo on CPU) split every task's samples. Check mode compares the weights every
module with parameters runs on across the two processes (one small collective per module per
forward) and the tasks' sizes once per meta-step. Printed per case: median seconds per
meta-step (meta_loss + backward + sync_grads) off and on, their ratio, and the collectives
launched per meta-step. Off, nothing is registered: it must match a build without the feature.

    python benchmarks/check_cost.py --repeats 10 --json benchmarks/results/check_cost.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metaddp  # noqa: E402
from common import CONV, SINE, Case, run_record, save_json, step_times  # noqa: E402
from metaddp.distributed.launch import run_local  # noqa: E402


def worker(case: Case, repeats: int) -> dict:
    out = {}
    for check in (False, True):
        net = case.build()
        learner = metaddp.MetaDDP(
            metaddp.MAML(net, inner_lr=case.inner_lr, steps=case.steps),
            metaddp.Mesh.create(tasks=1), check=check)
        tasks = learner.shard(case.tasks())

        def step() -> None:
            net.zero_grad(set_to_none=True)
            learner.meta_loss(tasks, case.loss_fn).backward()
            learner.sync_grads()

        step()  # warm-up
        with metaddp.distributed.counting() as stats:
            step()
        times = step_times(step, repeats)
        out["on" if check else "off"] = dict(median_s=statistics.median(times), calls=stats.calls)
        learner.release()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    cases = {"sinusoid MLP, 25 tasks": dataclasses.replace(SINE, n_tasks=25),
             "Conv-4, 4 tasks": dataclasses.replace(CONV, n_tasks=4)}
    rows = []
    print(f"{'case':<24} {'off s/step':>11} {'on s/step':>10} {'on/off':>7} {'calls off':>9} {'calls on':>9}")
    for name, case in cases.items():
        r = run_local(worker, 2, case, args.repeats, threads=1)[0]
        off, on = r["off"], r["on"]
        ratio = on["median_s"] / off["median_s"]
        print(f"{name:<24} {off['median_s']:>11.4f} {on['median_s']:>10.4f} {ratio:>7.2f} "
              f"{off['calls']:>9} {on['calls']:>9}")
        rows.append(dict(case=name, off=off, on=on, ratio=ratio))
    save_json(args.json, run_record(processes=2, layout="sample", rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
