"""Where the float32 Conv-4 meta-gradient's error comes from: BatchNorm computed in float32 (as
always) against BatchNorm computed in float64 (the input cast up, the output cast back), in
the default and the deterministic mode, each against the float64 per-task loop.

Conv-4 with BatchNorm (batch statistics), 5-way 1-shot, 15 queries per class, 8 tasks,
second-order MAML, K = 1, one process (gloo), one thread.

    python benchmarks/bn_precision.py --json benchmarks/results/bn_precision.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CONV, max_rel_diff, reference_grads, run_record, save_json  # noqa: E402

import metaddp  # noqa: E402
from metaddp.distributed import _batchnorm  # noqa: E402
from metaddp.distributed.launch import run_local  # noqa: E402

CASE = dataclasses.replace(CONV, n_tasks=8, shots=1, queries=15, steps=1)


def worker(deterministic: bool, float64_batchnorm: bool) -> dict:
    if float64_batchnorm:
        plain = _batchnorm.synced_batch_norm
        _batchnorm.synced_batch_norm = lambda bn, x, reduce: plain(bn, x.double(), reduce).to(
            x.dtype)
    net = CASE.build()
    learner = metaddp.MetaDDP(metaddp.MAML(net, inner_lr=CASE.inner_lr, steps=CASE.steps),
                              metaddp.Mesh.for_layout("sample"), deterministic=deterministic)
    tasks = learner.shard(CASE.tasks())
    learner.meta_loss(tasks, CASE.loss_fn).backward()
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
    if args.json:
        save_json(args.json, run_record(case=dataclasses.asdict(CASE), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
