"""What deterministic mode's ``chunks`` costs: one process, one thread, float32, second order.

Every task's batch is cut into at most ``chunks`` chunks, and every chunk holds its own copy of
the weights and of their gradient, so the mode's cost grows with ``chunks`` (more copies, larger
fixed-point sums) while the sample axis it can spread a task over grows with it. This prints the
median meta-step time of the default mode (with oneDNN on, as it runs, and off, as
deterministic mode runs it) and of deterministic mode at ``chunks`` = 1, 2, 4, 8, side by side
in one process, on the problems of ``deterministic_cost.py``. The process keeps freed memory
for the next step (``metaddp.distributed.keep_freed_memory``), as ``metaddp.init`` sets up every rank.

    python benchmarks/deterministic_chunks.py --json benchmarks/results/deterministic_chunks.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metaddp  # noqa: E402
from common import CONV, SINE, Case, step_times  # noqa: E402

PROBLEMS: dict[str, Case] = {
    "MLP K=1": dataclasses.replace(SINE, n_tasks=25, shots=10, queries=10, steps=1),
    "MLP K=5": dataclasses.replace(SINE, n_tasks=25, shots=10, queries=10, steps=5),
    "Conv-4 BN K=1": dataclasses.replace(CONV, n_tasks=8, shots=1, queries=15, steps=1),
}
CHUNKS = (1, 2, 4, 8)


def median_ms(case: Case, repeats: int, deterministic: bool, chunks: int = 8) -> float:
    tasks = case.tasks()
    learner = metaddp.MetaDDP(
        metaddp.MAML(case.build(), inner_lr=case.inner_lr, steps=case.steps),
        deterministic=deterministic,
        chunks=chunks,
    )

    def step() -> None:
        learner.module.zero_grad(set_to_none=True)
        learner.meta_loss(learner.shard(tasks), case.loss_fn).backward()
        learner.sync_grads()

    step()
    times = step_times(step, repeats)
    learner.release()
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=15, help="timed steps (Conv-4: a fifth)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    metaddp.distributed.keep_freed_memory()
    rows = {}
    for name, case in PROBLEMS.items():
        repeats = max(3, args.repeats // 5) if case.model == "conv4" else args.repeats
        torch.backends.mkldnn.enabled = True  # type: ignore[assignment]
        row = {"default": median_ms(case, repeats, False)}
        torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
        row["default, oneDNN off"] = median_ms(case, repeats, False)
        for c in CHUNKS:
            row[f"deterministic, chunks={c}"] = median_ms(case, repeats, True, c)
        rows[name] = row
        cells = ", ".join(f"{k} {v:.1f}" for k, v in row.items())
        print(f"{name}: {cells} (ms)", flush=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"torch": torch.__version__, "threads": 1, "unit": "ms per meta-step", "rows": rows},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
