"""Peak memory and time of one second-order meta-step against the number of inner steps K:
the default (every step's graph kept), ``memory="low"`` (one step's graph rebuilt at a time)
and first-order MAML, side by side in one run.

Each measurement runs in a fresh process with one torch thread. Memory is the peak of the
bytes held by tensors that autograd saved for a backward pass, counted through
``torch.autograd.graph.saved_tensors_hooks`` (each storage once, released when the graph
frees it): these are the activations and inner-gradient graphs that grow with K, measured
exactly and independently of the allocator (the CPU's resident set reuses freed blocks and
hides them). It covers the rebuilt step graphs of ``memory="low"`` too; not the copies of the
fast weights the low mode keeps (one model's weights each: 0.45 MiB for this Conv-4), given
apart. Time is the median of ``--repeats`` steps.

    python benchmarks/remat_memory.py --json benchmarks/results/remat_memory.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("default", "low", "first-order")


class SavedBytes:
    """Peak bytes of the storages autograd holds for backward passes, inside the block."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.now = self.peak = 0

    def pack(self, t):  # type: ignore[no-untyped-def]
        key = t.untyped_storage().data_ptr()
        entry = self.live.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        return _Held(t, key, self)

    @staticmethod
    def unpack(held):  # type: ignore[no-untyped-def]
        return held.tensor

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]


class _Held:
    def __init__(self, tensor, key: int, owner: SavedBytes) -> None:  # type: ignore[no-untyped-def]
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner.release(self.key)


def measure(case_name: str, steps: int, mode: str, repeats: int, n_tasks: int) -> dict:
    """In this (fresh) process: peak saved-tensor memory and median time of one meta-step."""
    import torch

    import metaddp
    from common import CONV, SINE, step_times

    torch.set_num_threads(1)
    case = {"conv": dataclasses.replace(CONV, n_tasks=n_tasks), "sine": SINE}[case_name]
    net = case.build()
    alg = metaddp.MAML(net, inner_lr=case.inner_lr, steps=steps, batched=False,
                       first_order=mode == "first-order",
                       memory="low" if mode == "low" else "default")
    tasks = case.tasks()

    def step() -> None:
        net.zero_grad(set_to_none=True)
        alg.meta_loss(tasks, case.loss_fn).backward()

    step()  # warm-up: allocator pools, lazy initialisation
    counter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        step()
    times = step_times(step, repeats)
    # What the low mode keeps besides (SGD: no state): while a task's gradient is computed
    # (in meta_loss, one task at a time), its K - 1 first-order steps' weights; until the
    # backward, one gradient the size of the weights per task.
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    kept = weights * (steps - 1 + len(tasks)) if mode == "low" else 0
    return {"peak_mib": counter.peak / 2**20, "seconds": statistics.median(times),
            "kept_mib": kept / 2**20}


def interleaved_times(case_name: str, steps: int, repeats: int, n_tasks: int) -> dict:
    """Default, low-memory and first-order steps alternated in one process: each round runs
    all three, so load from anything else on the machine falls on them alike. Best and median
    seconds of each. The low mode runs the inner steps once more, first order, before its
    second-order work: default + (most of) first order is its floor."""
    import torch

    import metaddp
    from common import CONV, SINE

    torch.set_num_threads(1)
    case = {"conv": dataclasses.replace(CONV, n_tasks=n_tasks), "sine": SINE}[case_name]
    tasks = case.tasks()
    steps_of = {}
    for mode in ("default", "low", "first-order"):
        net = case.build()
        # The automatic choice: on the CPU the MLP's tasks stacked, Conv-4's one by one.
        alg = metaddp.MAML(net, inner_lr=case.inner_lr, steps=steps,
                           memory="low" if mode == "low" else "default",
                           first_order=mode == "first-order")

        def step(net=net, alg=alg) -> None:
            net.zero_grad(set_to_none=True)
            alg.meta_loss(tasks, case.loss_fn).backward()

        step()  # warm-up
        steps_of[mode] = step
    times: dict[str, list[float]] = {m: [] for m in steps_of}
    for _ in range(repeats):
        for mode, step in steps_of.items():
            t0 = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - t0)
    return {m: {"best": min(t), "median": statistics.median(t)} for m, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="1,5,10,25,50")
    ap.add_argument("--cases", default="sine,conv")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conv-tasks", type=int, default=8)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # case steps mode, in a child
    ap.add_argument("--times", action="store_true",
                    help="only time default, low and first order, interleaved in one process")
    args = ap.parse_args(argv)
    if args.times:
        from common import run_record, save_json

        rows = []
        for case in args.cases.split(","):
            for k in map(int, args.steps.split(",")):
                t = interleaved_times(case, k, args.repeats, args.conv_tasks)
                rows.append({"case": case, "steps": k, **t})
                print(f"{case:<6} K={k:<3} default best {t['default']['best']:.3f} s, low best "
                      f"{t['low']['best']:.3f} s: low/default {t['low']['best'] / t['default']['best']:.2f}"
                      f" (medians {t['low']['median'] / t['default']['median']:.2f}); first order"
                      f" / default {t['first-order']['best'] / t['default']['best']:.2f}", flush=True)
        save_json(args.json, run_record(rows=rows))
        return 0
    if args.one:
        case, k, mode = args.one
        print(json.dumps(measure(case, int(k), mode, args.repeats, args.conv_tasks)))
        return 0
    from common import run_record, save_json

    rows = []
    print(f"{'case':<6} {'K':>3} " + " ".join(f"{m + ' MiB':>16} {m + ' s':>14}" for m in MODES))
    for case in args.cases.split(","):
        for k in map(int, args.steps.split(",")):
            got = {}
            for mode in MODES:
                out = subprocess.run([sys.executable, __file__, "--one", case, str(k), mode,
                                      "--repeats", str(args.repeats),
                                      "--conv-tasks", str(args.conv_tasks)],
                                     capture_output=True, text=True, check=True)
                got[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"case": case, "steps": k, **got})
            print(f"{case:<6} {k:>3} " + " ".join(
                f"{got[m]['peak_mib']:>16.1f} {got[m]['seconds']:>14.3f}" for m in MODES)
                + f"  low/default: memory {got['low']['peak_mib'] / got['default']['peak_mib']:.3f}"
                f" time {got['low']['seconds'] / got['default']['seconds']:.2f}"
                f"  (low keeps {got['low']['kept_mib']:.1f} MiB of weights)", flush=True)
    save_json(args.json, run_record(rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
