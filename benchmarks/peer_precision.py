"""Float64 meta-gradients of the vmap rows (hand-written torch.func, parallel-metalearn with
torch's BatchNorm and with its own) against the float64 per-task loop, at K = 1 and 5 inner
steps: an error that float32 rounding cannot explain is the method's, not the precision's.

    PYTHONPATH=src python benchmarks/peer_precision.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)  # so a peer's own tensors (rates) are float64 too
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    CONV,
    SINE,
    NotApplicable,
    available,
    max_rel_diff,
    reference_grads,
)

ROWS = (
    "torch.func grad+vmap (hand-written)",
    "parallel-metalearn (vmap)",
    "parallel-metalearn (vmap), its own BatchNorm",
)


def main() -> int:
    impls, skipped = available(ROWS)
    for name, why in skipped.items():
        print(f"{name}: not run: {why}")
    for base in (CONV, dataclasses.replace(CONV, model="conv4-smooth"), SINE):
        for k in (1, 5):
            case = dataclasses.replace(base, steps=k)
            ref = reference_grads(case)
            tasks = case.tasks(torch.float64)
            for name, make in impls.items():
                try:
                    step = make(case, case.build(torch.float64), tasks)
                except NotApplicable:
                    continue
                err = max_rel_diff(step(), ref)
                print(f"float64 {case.model:<13} K={k} {name:<46} {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
