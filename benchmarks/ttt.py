"""Test-time training meta-learned (``metaddp train ttt``) against plain next-byte training at
equal CPU time, over seeds, on held-out standard-library files.

Per seed, in one process on one torch thread: (1) ``metaddp train ttt`` (ANIL: the last MLP
block, the final norm and the unembedding adapted by SGD on a window's support chunks, the
query chunks scored; second order) for ``--steps`` meta-steps, its cost T the CPU time of the
process over the whole run (``time.process_time``: setup and saving count against it); then
(2) the same network from the same initialisation trained without an inner loop, by Adam at
the same rate on every chunk of the same task stream (support and query chunks alike, dropout
on), until it has spent the same CPU time T. CPU time on one thread, unlike wall-clock time,
does not move with the load of a shared machine, so both arms get the same compute however
busy the machine is. Both are then scored on the same ``--eval-tasks`` held-out windows,
dropout off: the query chunks' bits per byte with the weights as trained (no TTT), and after
the run's inner loop on the window's support chunks (TTT: the same learning rate and steps
for both networks). ``--jobs`` seeds run at once, one core each. Mean over seeds with a 95% t
interval, and the differences paired by seed. ``--split train`` scores windows of the
training files instead (drawn with another seed than the runs'), for choosing settings
without reading the held-out files; ``--chunk`` sets the family's chunk (bytes, the
network's attention context), which is not a setting of ``metaddp train``.

    python benchmarks/ttt.py --json benchmarks/results/ttt.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import run_record, save_json  # noqa: E402

T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}
COLUMNS = {
    "baseline": "plain training, no TTT",
    "baseline_ttt": "plain training, then TTT",
    "meta": "meta-learned, no TTT",
    "meta_ttt": "meta-learned, then TTT",
}


def score(
    algorithm, family, seed: int, n_tasks: int, steps: int, split: str = "test"
) -> tuple[float, float]:
    """Mean query bits per byte over ``split``'s windows, before and after ``steps`` inner
    steps (dropout off). The training split's are drawn with another seed than the run's
    (for choosing settings without reading the held-out files)."""
    import torch

    algorithm.eval()
    before, after = [], []
    for i in range(n_tasks):
        task = family.task(seed if split == "test" else seed + 1000, i, split)
        for k, out in ((0, before), (steps, after)):
            fast = {n: p.detach() for n, p in algorithm.adapt(task.support, family.loss, steps=k).items()}
            with torch.no_grad():
                out.append(float(family.loss(algorithm(task.query.x, fast), task.query.y).mean()))
    return statistics.mean(before), statistics.mean(after)


def plain_training(cfg, family, seconds: float) -> tuple[object, int]:
    """The run's network from the run's initialisation, trained on every chunk of the run's
    task stream by Adam until it has spent ``seconds`` of the process's CPU time: (the
    network, steps taken)."""
    import torch

    torch.manual_seed(cfg.seed)
    net = family.model()
    opt = torch.optim.Adam(net.parameters(), lr=cfg.outer_lr)
    start, step = time.process_time(), 0
    while time.process_time() - start < seconds:
        tasks = [family.task(cfg.seed, cfg.meta_batch * step + i) for i in range(cfg.meta_batch)]
        x = torch.cat([torch.cat([t.support.x, t.query.x]) for t in tasks])
        y = torch.cat([torch.cat([t.support.y, t.query.y]) for t in tasks])
        opt.zero_grad()
        family.loss(net(x), y).mean().backward()
        opt.step()
        step += 1
    return net, step


def one_seed(
    seed: int,
    steps: int,
    eval_tasks: int,
    folder: str,
    extra: dict,
    split: str = "test",
    chunk: int | None = None,
) -> dict:
    """Both arms of one seed, scored (run in a process of its own, one torch thread)."""
    import torch

    import metaddp as md
    from metaddp.tasks.ttt import TTT
    from metaddp.train import TrainConfig, prepare_folder, train

    torch.set_num_threads(1)
    if chunk is not None:
        # The chunk is an argument of the family, not a setting of `metaddp train`: in this
        # process (its own) the family is built with it by default.
        shots, query, hidden, _ = TTT.__init__.__defaults__
        TTT.__init__.__defaults__ = (shots, query, hidden, chunk)
    cfg = TrainConfig(task="ttt", seed=seed, steps=steps, eval_every=0, eval_tasks=1,
                      checkpoint_every=steps, **extra).resolved()
    out = Path(folder) / f"meta-{seed}"
    prepare_folder(out, cfg, False, force=True)
    start = time.process_time()
    result = train(cfg, out, progress=False)
    seconds = time.process_time() - start  # the whole run's CPU time, setup and saving too
    family = cfg.family()
    meta = cfg.build(family.model())
    meta.load_state_dict(result["weights"])
    net, plain_steps = plain_training(cfg, family, seconds)
    plain = md.ANIL(*net.split_head(), inner_lr=cfg.inner_lr, steps=cfg.eval_steps)
    row = {"seed": seed, "seconds": seconds, "meta_steps": steps, "plain_steps": plain_steps}
    row["baseline"], row["baseline_ttt"] = score(plain, family, seed, eval_tasks, cfg.eval_steps, split)
    row["meta"], row["meta_ttt"] = score(meta, family, seed, eval_tasks, cfg.eval_steps, split)
    return row


def interval(xs: list[float]) -> str:
    m = statistics.mean(xs)
    h = T95[len(xs)] * statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")
    return f"{m:.3f} ± {h:.3f}"


def spawn(seed: int, a: argparse.Namespace, folder: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--one-seed", str(seed), "--steps", str(a.steps),
           "--eval-tasks", str(a.eval_tasks), "--folder", folder, "--set", json.dumps(a.set),
           "--split", a.split] + ([] if a.chunk is None else ["--chunk", str(a.chunk)])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"seed {seed} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=2, help="seeds at once (one core each)")
    ap.add_argument("--steps", type=int, default=400, help="meta-steps of the TTT run")
    ap.add_argument("--eval-tasks", type=int, default=200, help="held-out windows scored")
    ap.add_argument("--set", type=json.loads, default={},
                    help='other settings of the TTT run, as JSON: \'{"inner_lr": 0.3}\'')
    ap.add_argument("--split", choices=("test", "train"), default="test",
                    help="the windows scored: held-out files (test) or training files (train)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="bytes a chunk (the family's argument; default: the family's, 64)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one-seed", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one_seed is not None:
        print(json.dumps(one_seed(a.one_seed, a.steps, a.eval_tasks, a.folder, a.set, a.split, a.chunk)))
        return
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(a.jobs) as pool:
        jobs = [pool.submit(spawn, s, a, tmp) for s in range(a.seeds)]
        rows = []
        for job in jobs:
            r = job.result()
            rows.append(r)
            print(f"seed {r['seed']}: {r['seconds']:.0f} CPU s each: {r['meta_steps']} meta-steps, "
                  f"{r['plain_steps']} plain steps; bits/byte "
                  + ", ".join(f"{k} {r[k]:.4f}" for k in COLUMNS), flush=True)
    col = {k: [r[k] for r in rows] for k in COLUMNS}
    which = "held-out" if a.split == "test" else "training-file"
    print(f"\n{which} query bits per byte over {a.seeds} seeds ({a.eval_tasks} windows each; "
          "mean, 95% t interval)")
    for k, label in COLUMNS.items():
        print(f"  {label:<44} {interval(col[k])}")
    print(f"  {'meta-learned TTT minus plain, paired by seed':<44} "
          f"{interval([m - b for m, b in zip(col['meta_ttt'], col['baseline'])])}")
    print(f"  {'meta-learned TTT minus plain TTT, paired':<44} "
          f"{interval([m - b for m, b in zip(col['meta_ttt'], col['baseline_ttt'])])}")
    print(f"  {'meta-learned, TTT minus no TTT, paired':<44} "
          f"{interval([m - b for m, b in zip(col['meta_ttt'], col['meta'])])}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    save_json(Path(a.json) if a.json else None, run_record(settings=vars(a), rows=rows))


if __name__ == "__main__":
    main()
