"""What a stacked meta-batch saves when its inner optimizer is applied without ``torch.vmap``.

With the tasks stacked, each task's optimizer update runs under ``torch.vmap`` (the update may
look across a whole tensor). ``sgd`` and ``adam`` with float rates are ``rowwise``: entry by
entry, so applied to the stacked weights directly they give the same bits. This times one
second-order MAML meta-step of the sinusoid MLP (25 tasks, stacked, one thread) both ways,
alternated in one process (every round runs every variant, so outside load falls on them
alike), for ``memory="default"`` and ``memory="low"`` and several K. The meta-gradients of
the two ways are checked equal bit for bit before any time is trusted.

    python benchmarks/rowwise_cost.py --json benchmarks/results/rowwise_cost.json
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metaddp  # noqa: E402
from common import SINE, run_record, save_json  # noqa: E402

OPTIMIZERS = {"sgd": lambda: metaddp.inner.sgd(SINE.inner_lr),
              "adam": lambda: metaddp.inner.adam(SINE.inner_lr)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="1,5,25")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--optimizers", default="sgd,adam")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tasks = SINE.tasks()
    rows = []
    print(f"{'optimizer':>9} {'K':>3} {'memory':>8} {'vmap ms':>8} {'rowwise ms':>10} "
          f"{'ratio best':>10} {'ratio med':>9}")
    for opt_name in args.optimizers.split(","):
        for steps in map(int, args.steps.split(",")):
            variants, grads = {}, {}
            for memory in ("default", "low"):
                for rowwise in (False, True):
                    net = SINE.build()
                    opt = OPTIMIZERS[opt_name]()
                    if not rowwise:  # another function: the optimizer then runs under vmap
                        opt = metaddp.inner.InnerOptimizer(opt.init, functools.partial(opt.update))
                    alg = metaddp.MAML(net, steps=steps, optimizer=opt, batched=True,
                                       memory=memory)

                    def step(net=net, alg=alg) -> None:
                        net.zero_grad(set_to_none=True)
                        alg.meta_loss(tasks, SINE.loss_fn).backward()

                    step()
                    grads[memory, rowwise] = [p.grad.clone() for p in net.parameters()]
                    variants[memory, rowwise] = step
            for memory in ("default", "low"):
                same = all(torch.equal(a, b) for a, b in
                           zip(grads[memory, False], grads[memory, True], strict=True))
                if not same:
                    raise SystemExit(f"{opt_name} K={steps} {memory}: the two ways differ")
            times: dict = {v: [] for v in variants}
            rounds = max(3, args.rounds * 5 // (steps + 4))  # about equal time per K
            for _ in range(rounds):
                for v, step in variants.items():
                    t0 = time.perf_counter()
                    step()
                    times[v].append(time.perf_counter() - t0)
            for memory in ("default", "low"):
                vm, rw = times[memory, False], times[memory, True]
                row = dict(optimizer=opt_name, steps=steps, memory=memory, rounds=rounds,
                           vmap_best=min(vm), rowwise_best=min(rw),
                           vmap_median=statistics.median(vm),
                           rowwise_median=statistics.median(rw))
                rows.append(row)
                print(f"{opt_name:>9} {steps:>3} {memory:>8} {min(vm) * 1e3:8.2f} "
                      f"{min(rw) * 1e3:10.2f} {min(rw) / min(vm):10.2f} "
                      f"{statistics.median(rw) / statistics.median(vm):9.2f}")
            low, default = (times["low", True], times["default", True])
            print(f"{'':>9} {'':>3} low / default with rowwise: best "
                  f"{min(low) / min(default):.2f}, medians "
                  f"{statistics.median(low) / statistics.median(default):.2f}")
    save_json(args.json, run_record(rows=rows, threads=1, tasks=SINE.n_tasks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
