"""Side by side: one second-order MAML meta-step, the same weights and data, every implementation.

Each row: median time over ``--repeats`` rounds (implementations interleaved round-robin in
every round), the ratio to metaddp, and the largest relative difference of its meta-gradient
from a float64 per-task-loop reference. Prints a Markdown table; ``--json`` also saves rows.

    python benchmarks/peers.py --repeats 15 --json benchmarks/results/peers.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    CONV,
    IMPLEMENTATIONS,
    SINE,
    NotApplicable,
    available,
    max_rel_diff,
    median_ms,
    reference_grads,
    run_record,
    save_json,
    time_round_robin,
)
from metaddp.algorithms._stacked import use_batched  # noqa: E402


def run_case(case, repeats: int) -> dict:
    impls, skipped = available(IMPLEMENTATIONS)
    ref = reference_grads(case)
    tasks = case.tasks()
    # "metaddp" is the automatic choice; drop the forced row that repeats it.
    auto = use_batched(None, tasks, case.build())
    impls.pop(f"metaddp batched={auto}")
    steps, errors = {}, {}
    for name, make in impls.items():
        net = case.build()
        try:
            steps[name] = make(case, net, tasks)
        except NotApplicable as e:
            skipped[name] = str(e)
            continue
        errors[name] = max_rel_diff(steps[name](), ref)
    times = time_round_robin(steps, repeats)
    base = median_ms(times["metaddp"])
    label = {"metaddp": f"metaddp (automatic: {'stacked' if auto else 'loop'})"}
    rows = [dict(name=label.get(k, k), median_ms=median_ms(v), ratio=median_ms(v) / base, max_rel_diff=errors[k])
            for k, v in times.items()]
    return dict(case=dataclasses.asdict(case), title=case.name, rows=rows, skipped=skipped)


def markdown(result: dict) -> str:
    c = result["case"]
    lines = [f"**{result['title']}**, {c['n_tasks']} tasks, {c['steps']} inner step(s), float32",
             "", "| implementation | median ms | vs metaddp | max rel. diff of meta-gradient |",
             "|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['median_ms']:.1f} | {r['ratio']:.2f}x | {r['max_rel_diff']:.1e} |")
    for k, why in result["skipped"].items():
        lines.append(f"| {k} | not run: {why} | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--cases", default="conv,sine")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier on a machine shared with other work)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = {"conv": CONV, "sine": SINE}
    out = run_record(results=[])
    for key in args.cases.split(","):
        res = run_case(cases[key], args.repeats)
        out["results"].append(res)
        print(markdown(res), end="\n\n", flush=True)
    print(f"{out['date']}; {out['machine']}")
    save_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
