"""1 process against 2 (gloo on CPU) at a fixed global meta-batch, sample- and task-parallel.

For each layout: median seconds per meta-step (meta_loss + backward + sync_grads), throughput
relative to one process, bytes this rank sent into collectives per meta-step (counted with
``metaddp.distributed.counting()``) against the minimum the derivation needs, and peak resident memory
per rank. The minimum, for P parameters, T tasks a rank adapts and K inner steps: K*T*P values
forward and K*T*P backward in the inner loop (sample-parallel only) plus P for the final sum.
The measured count adds one sequence tag per bucket and one has-gradient flag per tensor.

    python benchmarks/scaling.py --repeats 10 --json benchmarks/results/scaling.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metaddp  # noqa: E402
from common import CONV, SINE, Case, peak_rss_mib, run_record, save_json, step_times  # noqa: E402
from metaddp.distributed.launch import run_local  # noqa: E402


def worker(case: Case, layout: str, repeats: int) -> dict:
    world = metaddp.world_size()
    mesh = metaddp.Mesh.create(tasks=1 if layout == "sample" else world)
    net = case.build()
    m = metaddp.MetaDDP(metaddp.MAML(net, inner_lr=case.inner_lr, steps=case.steps), mesh)
    tasks = m.shard(case.tasks())

    def step():
        net.zero_grad(set_to_none=True)
        m.meta_loss(tasks, case.loss_fn).backward()
        m.sync_grads()

    with metaddp.distributed.counting() as stats:
        step()
    times = step_times(step, repeats)
    p = sum(q.numel() for q in net.parameters())
    k, t_local = case.steps, len(tasks.tasks)
    inner = 2 * k * t_local * p if (layout == "sample" and world > 1) else 0
    minimum = (inner + (p if world > 1 else 0)) * 4  # float32
    return dict(median_s=statistics.median(times), bytes=stats.bytes, calls=stats.calls,
                min_bytes=minimum, peak_rss_mib=peak_rss_mib(), params=p, tasks=t_local)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    cases = [dataclasses.replace(CONV, n_tasks=8), dataclasses.replace(SINE, n_tasks=100, shots=50, queries=50)]
    rows = []
    for case in cases:
        for layout in ("sample", "task"):
            runs = {}
            for nproc, threads in ((1, 1), (1, 2), (2, 1)):
                res = run_local(worker, nproc, case, layout, args.repeats, threads=threads)
                runs[(nproc, threads)] = dict(
                    median_s=max(r["median_s"] for r in res), bytes=res[0]["bytes"], calls=res[0]["calls"],
                    min_bytes=res[0]["min_bytes"], peak_rss_mib=max(r["peak_rss_mib"] for r in res))
            base = runs[(1, 1)]["median_s"]
            for (nproc, threads), r in runs.items():
                rows.append(dict(case=case.name, n_tasks=case.n_tasks, layout=layout, nproc=nproc,
                                 threads=threads, throughput_vs_1x1=base / r["median_s"], **r))
                print(f"{case.name:38s} {layout:6s} {nproc}x{threads} thr  {1e3 * r['median_s']:8.1f} ms  "
                      f"x{base / r['median_s']:.2f}  {r['bytes']:>10d} B (min {r['min_bytes']}) "
                      f"{r['calls']} calls  peak {r['peak_rss_mib']:.0f} MiB", flush=True)
    out = run_record(rows=rows)
    save_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
