"""What deterministic mode costs: ``MetaDDP(..., deterministic=True)`` against the default mode,
float32 on the CPU, side by side in one run.

Problems (second-order MAML, the data makers of ``common.py``):

* sinusoid MLP (1-40-40-1 ReLU), 25 tasks, 10 support and 10 query samples, inner lr 0.01,
  K=1 and K=5 inner steps;
* Conv-4 with BatchNorm (batch statistics), 5-way 1-shot, 15 queries per class, 28x28 single
  channel, 8 tasks, inner lr 0.4, K=1.

Each problem runs at 1 process and at 2 processes (gloo, sample layout; the MLP also in the
task layout), every process with one torch thread. One spawned process group per (problem,
processes, layout) measures the default mode first and then the deterministic one (whose
constructor switches oneDNN off for the whole process, which would slow the default mode's
convolutions if it ran afterwards). The
groups are repeated for ``--rounds`` rounds, so that on a shared machine the two modes' blocks
alternate in time; the times of all rounds are pooled.

Reported per row:

* median seconds per meta-step (``meta_loss`` + ``backward`` + ``sync_grads``, gradients set
  to None first) after ``--warmup`` steps, of ``--repeats`` steps per round, rank 0's clock;
  ``det/default``: the ratio at the same process count and layout;
* collectives per meta-step and bytes per meta-step, from ``metaddp.distributed.counting()``
  on rank 0 (every all-reduce's payload as launched by this rank; what goes over the wire
  depends on gloo's algorithm). One process runs no collective;
* error: ``max|g - g64| / max|g64|`` over all parameters, of the float32 meta-gradient
  against the float64 meta-gradient of the same weights and data computed by the plain
  per-task autograd loop (``common.reference_grads``, no metaddp code). The float64 reference
  is cross-checked against metaddp's own default mode in float64 (``ref_check`` in the JSON);
* bits: whether the meta-gradient at this row's processes and layout ``torch.equal``s, in every
  parameter, the same mode's meta-gradient at 1 process (``yes``/``no``; ``-`` at 1 process).
  Every rank's meta-gradient is also checked equal to rank 0's, and each mode's to itself in
  every round (``ranks_agree``, ``rounds_agree`` in the JSON).

    python benchmarks/deterministic_cost.py --json benchmarks/results/deterministic_cost.json

``--quick``: the MLP only, one round, fewer repeats (a smoke run).

The ranks keep freed memory for the next step, as ``metaddp.init`` sets up every process
(``metaddp.distributed.keep_freed_memory``); ``METADDP_KEEP_FREED_MEMORY=0`` measures both modes with
glibc's defaults instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metaddp  # noqa: E402
from common import CONV, SINE, Case, max_rel_diff, reference_grads, run_record, save_json  # noqa: E402
from metaddp.distributed import counting  # noqa: E402
from metaddp.distributed.launch import run_local  # noqa: E402

MODES = ("default", "deterministic")

PROBLEMS: dict[str, Case] = {
    "MLP K=1": dataclasses.replace(SINE, n_tasks=25, shots=10, queries=10, steps=1),
    "MLP K=5": dataclasses.replace(SINE, n_tasks=25, shots=10, queries=10, steps=5),
    "Conv-4 BN K=1": dataclasses.replace(CONV, n_tasks=8, shots=1, queries=15, steps=1),
}

# (problem, processes, layout): every group spawned per round.
CONFIGS = [
    ("MLP K=1", 1, "sample"), ("MLP K=1", 2, "sample"), ("MLP K=1", 2, "task"),
    ("MLP K=5", 1, "sample"), ("MLP K=5", 2, "sample"), ("MLP K=5", 2, "task"),
    ("Conv-4 BN K=1", 1, "sample"), ("Conv-4 BN K=1", 2, "sample"),
]


def _switches() -> dict:
    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "mkldnn": bool(torch.backends.mkldnn.enabled)}


def worker(case: Case, layout: str, repeats: int, warmup: int, chunks: int) -> dict:
    """On every rank of a fresh process group: the default mode, then the deterministic one."""
    # metaddp.init (run_local's ranks) kept freed memory unless METADDP_KEEP_FREED_MEMORY=0.
    out: dict = {"threads": torch.get_num_threads(),
                 "keep_freed_memory": metaddp.distributed.keep_freed_memory()}
    for mode in MODES:
        switches = _switches()
        net = case.build()
        learner = metaddp.MetaDDP(
            metaddp.MAML(net, inner_lr=case.inner_lr, steps=case.steps),
            metaddp.Mesh.for_layout(layout), deterministic=mode == "deterministic", chunks=chunks)
        tasks = learner.shard(case.tasks())

        def step(net=net, learner=learner, tasks=tasks):
            net.zero_grad(set_to_none=True)
            loss = learner.meta_loss(tasks, case.loss_fn)
            loss.backward()
            learner.sync_grads()
            return loss

        loss = step()
        grads = {k: p.grad.detach().clone() for k, p in net.named_parameters()}
        loss_value = float(learner.global_value(loss))
        for _ in range(warmup - 1):
            step()
        times, calls, nbytes, elements = [], [], [], []
        for _ in range(repeats):
            with counting() as stats:
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            calls.append(stats.calls)
            nbytes.append(stats.bytes)
            elements.append(stats.elements)
        out[mode] = dict(times=times, calls=calls, bytes=nbytes, elements=elements, grads=grads,
                         loss=loss_value, switches_before=switches, switches_after=_switches())
        learner.release()
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _constant(values: list[int]) -> int | list[int]:
    return values[0] if len(set(values)) == 1 else values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed meta-steps per mode per round (default: 25 for the MLP, whose "
                         "steps are short and noisy, 5 for Conv-4; --quick: 3)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="times every process group is spawned (default 2; --quick: 1)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed meta-steps first (>= 1)")
    ap.add_argument("--chunks", type=int, default=8, help="deterministic mode's chunks")
    ap.add_argument("--quick", action="store_true", help="smoke run: MLP only, one round")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results"
                    / "deterministic_cost.json")
    args = ap.parse_args(argv)
    def repeats_of(name: str) -> int:
        return args.repeats or (3 if args.quick else 25 if name.startswith("MLP") else 5)

    rounds = args.rounds or (1 if args.quick else 2)
    warmup = max(1, args.warmup)
    configs = [c for c in CONFIGS if not (args.quick and c[0].startswith("Conv"))]
    problems = {c[0] for c in configs}
    t_start = time.perf_counter()

    # The float64 references, in this process (which never builds a deterministic MetaDDP).
    refs, ref_check = {}, {}
    for name, case in PROBLEMS.items():
        if name not in problems:
            continue
        refs[name] = reference_grads(case)
        net = case.build(torch.float64)
        net.zero_grad(set_to_none=True)
        metaddp.MAML(net, inner_lr=case.inner_lr, steps=case.steps).meta_loss(
            case.tasks(torch.float64), case.loss_fn).backward()
        ref_check[name] = max_rel_diff({k: p.grad for k, p in net.named_parameters()}, refs[name])
        print(f"float64 reference for {name}: metaddp float64 vs plain loop {ref_check[name]:.1e}",
              flush=True)

    results: dict[tuple, list[dict]] = {c: [] for c in configs}
    for r in range(rounds):
        for config in configs:
            name, nproc, layout = config
            t0 = time.perf_counter()
            got = run_local(worker, nproc, PROBLEMS[name], layout, repeats_of(name), warmup,
                            args.chunks, threads=1, timeout_s=600.0)
            results[config].append(got)
            print(f"round {r + 1}/{rounds}: {name}, {nproc} proc, {layout}: "
                  + ", ".join(f"{m} {1e3 * statistics.median(got[0][m]['times']):.1f} ms"
                              for m in MODES)
                  + f" ({time.perf_counter() - t0:.0f} s with spawning)", flush=True)

    rows = []
    one = {}  # (problem, mode) -> 1-process meta-gradient of the first round
    for config in configs:
        name, nproc, layout = config
        runs = results[config]
        row: dict = dict(problem=name, processes=nproc, layout=layout,
                         threads_per_process=runs[0][0]["threads"],
                         keep_freed_memory=runs[0][0]["keep_freed_memory"])
        for mode in MODES:
            g = runs[0][0][mode]["grads"]
            if nproc == 1:
                one[(name, mode)] = g
            times = [t for run in runs for t in run[0][mode]["times"]]
            row[mode] = dict(
                median_s=statistics.median(times),
                round_medians_s=[statistics.median(run[0][mode]["times"]) for run in runs],
                times_s=times,
                calls_per_step=_constant([c for run in runs for c in run[0][mode]["calls"]]),
                bytes_per_step=_constant([b for run in runs for b in run[0][mode]["bytes"]]),
                elements_per_step=_constant([e for run in runs for e in run[0][mode]["elements"]]),
                error_vs_float64=max_rel_diff(g, refs[name]),
                bit_equal_to_1_process=None if nproc == 1 else _equal(g, one[(name, mode)]),
                ranks_agree=all(_equal(rank[mode]["grads"], g) for run in runs for rank in run),
                rounds_agree=all(_equal(run[0][mode]["grads"], g) for run in runs),
                loss=runs[0][0][mode]["loss"],
                switches_before=runs[0][0][mode]["switches_before"],
                switches_after=runs[0][0][mode]["switches_after"],
            )
        row["time_ratio_det_over_default"] = (row["deterministic"]["median_s"]
                                              / row["default"]["median_s"])
        rows.append(row)

    def fmt_bytes(b) -> str:
        if isinstance(b, list):
            return "varies"
        return f"{b / 1024:.1f} KiB" if b else "0"

    def bits(v) -> str:
        return "-" if v is None else ("yes" if v else "no")

    head = (f"{'problem':<14} {'procs':>5} {'layout':<7} {'default ms':>10} {'det ms':>9} "
            f"{'det/def':>7} {'calls def':>9} {'calls det':>9} {'bytes def':>10} {'bytes det':>10} "
            f"{'err def':>8} {'err det':>8} {'bits def':>8} {'bits det':>8}")
    lines = [head, "-" * len(head)]
    for row in rows:
        d, e = row["default"], row["deterministic"]
        lines.append(
            f"{row['problem']:<14} {row['processes']:>5} {row['layout']:<7} "
            f"{1e3 * d['median_s']:>10.1f} {1e3 * e['median_s']:>9.1f} "
            f"{row['time_ratio_det_over_default']:>7.2f} {str(d['calls_per_step']):>9} "
            f"{str(e['calls_per_step']):>9} {fmt_bytes(d['bytes_per_step']):>10} "
            f"{fmt_bytes(e['bytes_per_step']):>10} {d['error_vs_float64']:>8.1e} "
            f"{e['error_vs_float64']:>8.1e} {bits(d['bit_equal_to_1_process']):>8} "
            f"{bits(e['bit_equal_to_1_process']):>8}")
    notes = [
        f"float32, CPU, 1 torch thread per process, gloo; chunks={args.chunks}; median of "
        f"{rounds} round(s) x {', '.join(f'{repeats_of(p)} ({p})' for p in sorted(problems))} "
        f"meta-steps after {warmup} warm-up step(s) per mode; "
        f"freed memory kept (metaddp.distributed.keep_freed_memory): {rows[0]['keep_freed_memory']}.",
        "calls/bytes: collectives and payload bytes per meta-step on rank 0 (counting()).",
        "err: max|g - g64| / max|g64| against the float64 per-task loop.",
        "bits: meta-gradient torch.equal to the same mode's at 1 process.",
    ]
    bad = [f"{r['problem']} {r['processes']} proc {r['layout']} {m}: {what}"
           for r in rows for m in MODES
           for what in ("ranks_agree", "rounds_agree") if not r[m][what]]
    if bad:
        notes.append("NOT bit-equal where expected: " + "; ".join(bad))
    table = "\n".join(lines + [""] + notes)
    print()
    print(table)
    print(f"\n({time.perf_counter() - t_start:.0f} s in all)")
    save_json(args.json, run_record(
        quick=args.quick, rounds=rounds, repeats={p: repeats_of(p) for p in sorted(problems)},
        warmup=warmup, chunks=args.chunks,
        problems={k: dataclasses.asdict(v) for k, v in PROBLEMS.items() if k in problems},
        ref_check=ref_check, rows=rows, table=table))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
