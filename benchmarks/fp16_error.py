"""The meta-gradient's relative error against float64, by forward precision and inner loss scaling.

Second-order MAML (2 inner steps, SGD), one process, tasks one by one (``batched=False``: the
loop is the path that scales), on two networks, each with its loss as it is and times 1e-6:

- the sinusoid MLP of benchmarks/common.py (MAML's: 1 -> 40 -> 40 -> 1, ReLU; 8 tasks of 10
  support and 10 query samples, inner rate 0.01). Its low-precision error comes mostly from
  the ReLUs' discrete choices, a sign that differs between the float16 and the float64
  forward sending a gradient down another path (at the initial weights, 1 pre-activation
  in 12960 differs), whatever the scaling: with Softplus(beta=20) in their place, float16's
  error measured 6.6e-4 and bfloat16's 5.3e-3;
- the small tanh MLP of metaddp.testing.scenarios (1 -> 16 -> 16 -> 1, 3 tasks of 13 support
  and 11 query samples, inner rate 0.1), smooth, so the error is the arithmetic's.

Times 1e-6 (with the inner rate times 1e6: the same adaptation), the float16 gradients of the
activations fall below float16's smallest normal number (6e-5) and lose their digits or
round to zero: there, inner loss scaling keeps them.

Columns: float32; ``autocast=torch.bfloat16``; ``autocast=torch.float16`` without inner loss
scaling (``loss_scale=None``); float16 with ``metaddp.inner.LossScale()`` (the default, init
``2**10``); float16 with ``LossScale(init=2**16)`` (``torch.amp.GradScaler``'s start, which
overflows the first inner step of the sinusoid's tasks: the step is skipped). The float16
runs scale the meta-loss for the outer backward as GradScaler would: ``2**16``, halved until
the meta-gradient is finite (the scale used is printed). The error is
``max |g - g64| / max |g64|`` over every entry.

    python benchmarks/fp16_error.py --json benchmarks/results/fp16_error.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metaddp  # noqa: E402
from common import SINE, max_rel_diff, run_record, save_json  # noqa: E402
from metaddp.testing import scenarios as S  # noqa: E402

CASE = dataclasses.replace(SINE, n_tasks=8, steps=2)
TANH = S.Problem("mlp", steps=2, n_tasks=3)


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    factor: float  # what the loss is multiplied by (and the inner rate divided by)
    tanh: bool  # the scenarios' tanh MLP, else the sinusoid MLP

    def build(self, dtype: torch.dtype):
        if self.tanh:
            p = dataclasses.replace(TANH, dtype=dtype)
            return p.build_model(), p.tasks(), p.loss_fn, p.inner_lr, p.steps
        return CASE.build(dtype), CASE.tasks(dtype), CASE.loss_fn, CASE.inner_lr, CASE.steps


PROBLEMS = [Problem("sinusoid MLP (ReLU)", 1.0, False), Problem("  loss x 1e-6", 1e-6, False),
            Problem("tanh MLP", 1.0, True), Problem("  loss x 1e-6", 1e-6, True)]
COLUMNS = {
    "float32": (None, None),
    "bfloat16": (torch.bfloat16, None),
    "float16": (torch.float16, None),
    "float16 + LossScale()": (torch.float16, metaddp.inner.LossScale()),
    "float16 + LossScale(2**16)": (torch.float16, metaddp.inner.LossScale(init=2.0**16)),
}


def meta_grad(problem: Problem, dtype: torch.dtype, autocast, loss_scale) -> tuple[dict, float]:
    """The meta-gradient of ``problem`` in ``dtype``, and the outer scale used."""
    net, tasks, per_sample, inner_lr, steps = problem.build(dtype)
    factor = problem.factor
    alg = metaddp.MAML(net, inner_lr=inner_lr / factor, steps=steps, autocast=autocast, batched=False)
    alg.loss_scale = loss_scale  # MAML(..., loss_scale=) where its signature takes it

    def loss_fn(out, y):
        return factor * per_sample(out, y)

    outer = 2.0**16 if autocast == torch.float16 else 1.0
    while True:
        alg.zero_grad(set_to_none=True)
        (alg.meta_loss(tasks, loss_fn) * outer).backward()
        grads = {k: p.grad.double() / outer for k, p in net.named_parameters()}
        if all(bool(torch.isfinite(g).all()) for g in grads.values()) or outer < 1:
            return grads, outer
        outer /= 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for problem in PROBLEMS:
        want, _ = meta_grad(problem, torch.float64, None, None)
        row: dict = {"problem": problem.name, "factor": problem.factor, "errors": {}, "outer_scales": {}}
        for column, (autocast, loss_scale) in COLUMNS.items():
            start = time.perf_counter()
            got, outer = meta_grad(problem, torch.float32, autocast, loss_scale)
            row["errors"][column] = max_rel_diff(got, want)
            row["outer_scales"][column] = outer
            row.setdefault("seconds", {})[column] = time.perf_counter() - start
        rows.append(row)
    width = max(len(c) for c in COLUMNS) + 2
    print(f"{'':<22}" + "".join(f"{c:>{width}}" for c in COLUMNS))
    for row in rows:
        print(f"{row['problem']:<22}" + "".join(f"{row['errors'][c]:>{width}.2e}" for c in COLUMNS))
    used = sorted({s for row in rows for c, s in row["outer_scales"].items() if c.startswith("float16")})
    print("float16 meta-loss scales used: " + ", ".join(f"2**{int(torch.tensor(s).log2())}" for s in used))
    save_json(args.json, run_record(sinusoid=dataclasses.asdict(CASE), tanh=str(TANH),
                                    problems=[dataclasses.asdict(p) for p in PROBLEMS], rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
