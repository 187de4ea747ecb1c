"""Cost growth: time and peak memory of one meta-step against inner steps and meta-batch size.

Time: median over ``--repeats`` rounds, implementations interleaved round-robin at every
point. Memory: each (implementation, point) runs once in a fresh process, which reports its
peak resident memory during the step minus its resident memory just before it (model, data
and libraries already loaded, the peak reset): the memory the meta-step itself needed,
graph included, up to what the allocator reuses from the warm-up step.

    python benchmarks/growth.py --repeats 7 --json benchmarks/results/growth.json
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    SINE,
    available,
    current_rss_mib,
    median_ms,
    peak_rss_mib,
    reset_peak_rss,
    run_record,
    save_json,
    time_round_robin,
)

IMPLS = ["metaddp", "torch.func grad+vmap (hand-written)", "per-task autograd loop", "higher", "TorchOpt MetaSGD"]
STEPS = (1, 2, 5, 10)
TASKS = (5, 25, 100)


def one_memory(impl: str, steps: int, n_tasks: int) -> float:
    """Run in a fresh process: peak extra resident MiB of one meta-step.

    A meta-step of one task and one inner step first loads every library and kernel; then
    the peak is reset (Linux ``/proc/self/clear_refs``) and the real step measured.
    """
    impls, _ = available([impl])
    tiny = dataclasses.replace(SINE, steps=1, n_tasks=1)
    impls[impl](tiny, tiny.build(), tiny.tasks())()
    case = dataclasses.replace(SINE, steps=steps, n_tasks=n_tasks)
    step = impls[impl](case, case.build(), case.tasks())
    reset_peak_rss()
    before = current_rss_mib()
    step()
    return peak_rss_mib() - before


def memory(impl: str, steps: int, n_tasks: int) -> float | None:
    cmd = [sys.executable, __file__, "--one", impl, str(steps), str(n_tasks)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    try:
        return float(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier on a machine shared with other work)")
    ap.add_argument("--one", nargs=3, metavar=("IMPL", "STEPS", "TASKS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one:
        print(one_memory(args.one[0], int(args.one[1]), int(args.one[2])))
        return 0
    impls, skipped = available(IMPLS)
    points = [("steps", k, dataclasses.replace(SINE, steps=k)) for k in STEPS]
    points += [("tasks", t, dataclasses.replace(SINE, n_tasks=t)) for t in TASKS if t != SINE.n_tasks]
    rows = []
    for axis, value, case in points:
        tasks = case.tasks()
        steps = {name: make(case, case.build(), tasks) for name, make in impls.items()}
        times = time_round_robin(steps, args.repeats)
        for name in impls:
            row = dict(axis=axis, value=value, steps=case.steps, n_tasks=case.n_tasks, impl=name,
                       median_ms=median_ms(times[name]), peak_extra_mib=memory(name, case.steps, case.n_tasks))
            rows.append(row)
            print(f"{axis}={value:<4d} {name:40s} {row['median_ms']:9.1f} ms  "
                  f"{row['peak_extra_mib'] if row['peak_extra_mib'] is not None else float('nan'):7.1f} MiB",
                  flush=True)
    out = run_record(case=SINE.name, rows=rows, skipped=skipped)
    save_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
