"""Where the float32 Conv-4 meta-gradient's error comes from, against the float64 per-task loop.

Conv-4 with BatchNorm (batch statistics), 5-way 1-shot, 15 queries per class, 8 tasks,
second-order MAML, K = 1, one process (gloo), one thread. Three measurements:

1. BatchNorm computed in float32 (as always) against BatchNorm computed in float64 (the input
   cast up, the output cast back), in the default and the deterministic mode.
2. The network's discrete choices: at the initial weights, on every task's support and query
   batch, how many max-pool choices (the largest of four) and ReLU signs differ between the
   float32 and the float64 forward. Each one that differs sends a gradient down another
   path, whatever the precision of the arithmetic around it.
3. The same network with those choices made smooth (softplus, 2x2 average pooling): the
   default and the deterministic mode's float32 error against that network's own float64
   loop.

    python benchmarks/bn_precision.py --json benchmarks/results/bn_precision.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metaddp  # noqa: E402
from common import CONV, Case, max_rel_diff, reference_grads, run_record, save_json  # noqa: E402
from metaddp.distributed import _batchnorm  # noqa: E402
from metaddp.distributed.launch import run_local  # noqa: E402

CASE = dataclasses.replace(CONV, n_tasks=8, shots=1, queries=15, steps=1)
SMOOTH = dataclasses.replace(CASE, name="Conv-4 with softplus and average pooling",
                             model="conv4-smooth")


def choices(case: Case) -> dict:
    """Max-pool choices and ReLU signs that differ between the float32 and float64 forward."""
    net32, net64 = case.build(), case.build(torch.float64)
    counts = dict(max_pool_differ=0, max_pool_total=0, relu_differ=0, relu_total=0)

    def trace(net: nn.Module, x: torch.Tensor) -> tuple[list, list]:
        picks, signs = [], []
        for m in net:
            if isinstance(m, nn.MaxPool2d):
                x, i = F.max_pool2d(x, m.kernel_size, return_indices=True)
                picks.append(i)
            else:
                x = m(x)
                if isinstance(m, nn.ReLU):
                    signs.append(x > 0)
        return picks, signs

    for t32, t64 in zip(case.tasks(), case.tasks(torch.float64), strict=True):
        for b32, b64 in ((t32.support, t64.support), (t32.query, t64.query)):
            (p32, s32), (p64, s64) = trace(net32, b32.x), trace(net64, b64.x)
            for a, b in zip(p32, p64, strict=True):
                counts["max_pool_differ"] += int((a != b).sum())
                counts["max_pool_total"] += a.numel()
            for a, b in zip(s32, s64, strict=True):
                counts["relu_differ"] += int((a != b).sum())
                counts["relu_total"] += a.numel()
    return counts


def worker(deterministic: bool, float64_batchnorm: bool, case: Case = CASE) -> dict:
    if float64_batchnorm:
        plain = _batchnorm.synced_batch_norm
        _batchnorm.synced_batch_norm = lambda bn, x, reduce: plain(bn, x.double(), reduce).to(
            x.dtype)
    net = case.build()
    learner = metaddp.MetaDDP(metaddp.MAML(net, inner_lr=case.inner_lr, steps=case.steps),
                              metaddp.Mesh.for_layout("sample"), deterministic=deterministic)
    tasks = learner.shard(case.tasks())
    learner.meta_loss(tasks, case.loss_fn).backward()
    learner.sync_grads()
    grads = {k: p.grad.clone() for k, p in net.named_parameters()}
    learner.release()
    return grads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    ref = reference_grads(CASE)
    rows = []
    for deterministic in (False, True):
        for float64_batchnorm in (False, True):
            grads = run_local(worker, 1, deterministic, float64_batchnorm, threads=1)[0]
            rows.append(dict(mode="deterministic" if deterministic else "default",
                             batchnorm="float64" if float64_batchnorm else "float32",
                             error_vs_float64=max_rel_diff(grads, ref)))
            print(f"{rows[-1]['mode']:<14} BatchNorm in {rows[-1]['batchnorm']}: "
                  f"{rows[-1]['error_vs_float64']:.1e}", flush=True)
    flips = choices(CASE)
    print(f"float32 vs float64 forward at the initial weights: "
          f"{flips['max_pool_differ']} of {flips['max_pool_total']} max-pool choices and "
          f"{flips['relu_differ']} of {flips['relu_total']} ReLU signs differ", flush=True)
    smooth_ref = reference_grads(SMOOTH)
    smooth = []
    for deterministic in (False, True):
        grads = run_local(worker, 1, deterministic, False, SMOOTH, threads=1)[0]
        smooth.append(dict(mode="deterministic" if deterministic else "default",
                           error_vs_float64=max_rel_diff(grads, smooth_ref)))
        print(f"{SMOOTH.name}, {smooth[-1]['mode']}: {smooth[-1]['error_vs_float64']:.1e}",
              flush=True)
    if args.json:
        save_json(args.json, run_record(case=dataclasses.asdict(CASE), rows=rows,
                                        choices=flips, smooth_case=dataclasses.asdict(SMOOTH),
                                        smooth_rows=smooth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
