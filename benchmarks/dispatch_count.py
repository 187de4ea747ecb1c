"""Launch-bound cost without a GPU: aten operations dispatched per meta-step, for metaddp and
every peer, against the number of tasks and inner steps.

On a GPU each dispatched operation is (at least) one kernel launch, and a meta-step of small
tasks is bound by launches, not arithmetic: the count is a device-independent proxy for its
time there. It is counted on the CPU with a ``TorchDispatchMode`` (every aten operation,
forward and backward), in one second-order MAML meta-step after a warm-up step. The count
does not depend on tensor sizes, so Conv-4 runs here with 8 channels (64 in the paper): the
same operations, a fraction of the CPU time. Host reads (``.item()``-like operations and
metaddp's own reads, each a wait for the device) are counted beside.

    python benchmarks/dispatch_count.py --json benchmarks/results/dispatch_count.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CONV, SINE, available, run_record, save_json  # noqa: E402
from metaddp import _host  # noqa: E402
from metaddp.testing.dispatch import DispatchCounter  # noqa: E402

ROWS = [
    "metaddp",
    "metaddp batched=True",
    "metaddp batched=True conv=grouped",
    "metaddp batched=False",
    "torch.func grad+vmap (hand-written)",
    "per-task autograd loop",
    "higher",
    "TorchOpt MetaSGD",
    "floor: plain batched fwd+bwd (not a meta-step)",
]


def count(case, name, make) -> tuple[int, int]:
    net = case.build()
    step = make(case, net, case.tasks())
    step()  # warm-up: lazy initialisation
    # metaddp's own reads go through metaddp._host (``.tolist()`` on the CPU dispatches
    # nothing): CPU values made to count as a device's.
    with _host.as_on_a_device(), _host.counting() as own, DispatchCounter() as ops:
        step()
    return ops.total, ops.host_reads + own.reads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="4,32,128")
    ap.add_argument("--steps", default="1,5")
    ap.add_argument("--cases", default="conv,sine")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    impls, skipped = available(ROWS)
    cases = {"conv": dataclasses.replace(CONV, hidden=8), "sine": SINE}
    rows = []
    for cname in args.cases.split(","):
        for k in map(int, args.steps.split(",")):
            for n in map(int, args.tasks.split(",")):
                case = dataclasses.replace(cases[cname], n_tasks=n, steps=k)
                for name, make in impls.items():
                    total, reads = count(case, name, make)
                    rows.append(dict(case=cname, steps=k, tasks=n, impl=name, ops=total,
                                     host_reads=reads))
                    print(f"{cname:<5} K={k} tasks={n:<4} {name:<48} {total:>9} ops "
                          f"{reads:>5} host reads", flush=True)
    print(markdown(rows, skipped))
    save_json(args.json, run_record(rows=rows, skipped=skipped))
    return 0


def markdown(rows: list[dict], skipped: dict[str, str]) -> str:
    """One table per case and K: operations per meta-step against the number of tasks."""
    out = []
    keys = sorted({(r["case"], r["steps"]) for r in rows})
    for cname, k in keys:
        sel = [r for r in rows if r["case"] == cname and r["steps"] == k]
        tasks = sorted({r["tasks"] for r in sel})
        out += [f"**{cname}, K = {k}**", "",
                "| implementation | " + " | ".join(f"{n} tasks" for n in tasks) + " | host reads |",
                "|---|" + "---:|" * (len(tasks) + 1)]
        for impl in dict.fromkeys(r["impl"] for r in sel):
            by = {r["tasks"]: r for r in sel if r["impl"] == impl}
            out.append(f"| {impl} | " + " | ".join(f"{by[n]['ops']:,}" for n in tasks)
                       + f" | {max(r['host_reads'] for r in by.values())} |")
        out.append("")
    for name, why in skipped.items():
        out.append(f"- {name}: not run ({why})")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
