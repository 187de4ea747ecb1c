"""The exact metagradient through a whole training run: memory and time against its length T,
``memory=Replay`` beside ``memory="low"`` and the default (every step's graph kept), side by
side in one run.

The inner problem is a training run of an MLP (64-128-128-10, float32, 26,122 weights) by
full-batch SGD with momentum 0.9 on 512 samples, T steps; the outer variables are a
Meta-Weight-Net weighting of each sample's loss (``md.bilevel.WeightNet``); the outer loss is
the cross-entropy of 256 held-out samples after the run. One metagradient is
``Bilevel(..., start="current", steps=T, memory=...)``'s ``meta_loss(...).backward()``.

Each measurement runs in a fresh process with one torch thread:
- **states**: the weights-and-momentum states the mode keeps at once (the default keeps
  every step's graph instead: T of them, each larger);
- **peak MiB**: the process's peak resident memory during the metagradient, less its
  resident memory before it (``ru_maxrss``; ``metaddp.init`` keeps freed memory in the
  process, so the peak is what was held);
- **runs**: the metagradient's time over one plain training run of the same T steps
  (``torch.optim.SGD``, no graph kept), against the bound ``1 + log_k T`` (forward, replays,
  rebuilt steps; a rebuilt step with its second-order backward costs about 3 plain ones).

A configuration that would not fit is skipped (the default beyond ``--max-default``).

    python benchmarks/replay.py --json benchmarks/results/replay.json
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

N_TRAIN, N_HELD, FEATURES, CLASSES, WIDTH = 512, 256, 64, 10, 128
LR, MOMENTUM = 0.05, 0.9


def _data():
    import torch

    g = torch.Generator().manual_seed(0)
    centers = 2 * torch.randn(CLASSES, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (N_TRAIN + N_HELD,), generator=g)
    x = centers[y] + 3 * torch.randn(N_TRAIN + N_HELD, FEATURES, generator=g)
    noisy = y.clone()
    flip = torch.rand(N_TRAIN, generator=g) < 0.3  # 30% of the training labels wrong
    noisy[:N_TRAIN][flip] = torch.randint(0, CLASSES, (int(flip.sum()),), generator=g)
    return x[:N_TRAIN], noisy[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, CLASSES))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(mode: str, steps: int) -> dict:
    """One metagradient (or one plain training run, ``mode="run"``) in this process."""
    import torch
    import torch.nn.functional as F

    import metaddp as md

    torch.set_num_threads(1)
    md.init()
    xs, ys, xq, yq = _data()
    net = _model()
    if mode == "run":
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
        before = _rss_mib()
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(net(xs), ys).backward()
            opt.step()
        return {"seconds": time.perf_counter() - t0, "peak_mib": _rss_mib() - before}
    memory = {"default": "default", "low": "low"}.get(mode) or md.Replay(k=int(mode.split("=")[1]))
    ce = lambda pred, y: F.cross_entropy(pred, y, reduction="none")  # noqa: E731
    problem = md.Bilevel(net, weights=md.bilevel.WeightNet(), inner_loss=ce, outer_loss=ce,
                         start="current", steps=steps, optimizer=md.inner.sgd(LR, momentum=MOMENTUM),
                         memory=memory)
    learner = md.MetaDDP(problem, md.Mesh.create())
    task = [md.Task(md.Batch(xs, ys, N_TRAIN), md.Batch(xq, yq, N_HELD))]
    before = _rss_mib()
    t0 = time.perf_counter()
    learner.meta_loss(learner.shard(task)).backward()
    learner.sync_grads()
    seconds = time.perf_counter() - t0
    grad = torch.cat([p.grad.flatten() for n, p in learner.module.named_parameters()
                      if n.startswith("weights.") and p.grad is not None])
    return {"seconds": seconds, "peak_mib": _rss_mib() - before, "grad_norm": float(grad.norm())}


def states(mode: str, steps: int) -> int:
    from metaddp._remat import alive

    if mode == "default":
        return steps  # graphs, not states
    if mode == "low":
        return steps - 1
    return alive(int(mode.split("=")[1]), steps - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--modes", nargs="+", default=["default", "low", "replay=2", "replay=8"])
    ap.add_argument("--max-default", type=int, default=1000, help="longest run the default keeps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", nargs=2, metavar=("MODE", "STEPS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.one[0], int(a.one[1]))))
        return

    def fresh(mode: str, steps: int) -> dict:
        out = subprocess.run([sys.executable, __file__, "--one", mode, str(steps)], capture_output=True,
                             text=True, check=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
        return json.loads(out.stdout.strip().splitlines()[-1])

    from common import run_record, save_json

    rows = []
    print(f"{'T':>6} {'mode':<10} {'states':>7} {'peak MiB':>9} {'seconds':>8} {'runs':>6} {'bound':>6}"
          f" {'|grad|':>10}")
    for steps in a.steps:
        run = fresh("run", steps)
        for mode in a.modes:
            if mode == "default" and steps > a.max_default:
                continue
            r = fresh(mode, steps)
            k = int(mode.split("=")[1]) if mode.startswith("replay") else None
            bound = 1 + math.ceil(math.log(steps - 1, k)) if k else None
            row = {"steps": steps, "mode": mode, "states": states(mode, steps), **r,
                   "runs": r["seconds"] / run["seconds"], "bound_runs": bound,
                   "run_seconds": run["seconds"]}
            rows.append(row)
            print(f"{steps:>6} {mode:<10} {row['states']:>7} {r['peak_mib']:>9.1f} {r['seconds']:>8.2f}"
                  f" {row['runs']:>6.2f} {bound or '':>6} {r['grad_norm']:>10.6g}", flush=True)
    save_json(Path(a.json) if a.json else None, run_record(settings=vars(a), rows=rows))


if __name__ == "__main__":
    main()
