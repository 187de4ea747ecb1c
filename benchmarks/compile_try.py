"""``torch.compile`` and second-order MAML: what a compiled model gives, side by side with eager.

For each execution (tasks stacked under ``vmap``, tasks one by one), one second-order MAML
meta-step with the model as given and with ``torch.compile(model)``: the median time after a
warm-up, and the meta-gradient's ``max |g - g64| / max |g64|`` against the float64 per-task
loop (``common.reference_grads``), or the error the step raised. Then a hand-written loop
over a compiled function of the weights (``functional_call`` inside it), whose network is a
closure variable or a module-level global: PyTorch raises for the first and, on torch 2.13,
returns a wrong meta-gradient without a word for the second. One torch thread.

    python benchmarks/compile_try.py --json benchmarks/results/compile_try.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metaddp  # noqa: E402
from common import SINE, max_rel_diff, reference_grads, run_record, save_json, step_times  # noqa: E402


def metaddp_row(compiled: bool, batched: bool, repeats: int) -> dict:
    torch._dynamo.reset()
    net = SINE.build()
    model = torch.compile(net) if compiled else net
    maml = metaddp.MAML(model, inner_lr=SINE.inner_lr, steps=SINE.steps, batched=batched)
    tasks = SINE.tasks()

    def step():
        net.zero_grad(set_to_none=True)
        maml.meta_loss(tasks, SINE.loss_fn).backward()
        return {k: p.grad.clone() for k, p in net.named_parameters()}

    try:
        grads = step()
    except Exception as e:  # noqa: BLE001 - the row reports what torch raised
        return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    ms = 1e3 * statistics.median(step_times(step, repeats))
    return dict(median_ms=ms, max_rel_diff=max_rel_diff(grads, reference_grads(SINE)))


_NET = SINE.build()  # the module-level network of ``_module_level_loss``


def _module_level_loss(w, x, y):
    return F.mse_loss(torch.func.functional_call(_NET, w, (x,)), y)


def function_row(compiled: bool, module_level: bool) -> dict:
    """A hand-written loop over a function of the weights, ``loss(weights, x, y)``, whose
    network is a local variable of the enclosing function or a module-level global."""
    torch._dynamo.reset()
    net = _NET if module_level else SINE.build()
    params = dict(net.named_parameters())

    def local_loss(w, x, y):
        return F.mse_loss(torch.func.functional_call(net, w, (x,)), y)

    loss = _module_level_loss if module_level else local_loss
    f = torch.compile(loss) if compiled else loss
    tasks = SINE.tasks()
    try:
        total = 0.0
        for t in tasks:
            g = torch.autograd.grad(f(params, t.support.x, t.support.y), list(params.values()),
                                    create_graph=True)
            fast = {k: v - SINE.inner_lr * gi for (k, v), gi in zip(params.items(), g, strict=True)}
            total = total + f(fast, t.query.x, t.query.y) / len(tasks)
        grads = dict(zip(params, torch.autograd.grad(total, list(params.values())), strict=True))
    except Exception as e:  # noqa: BLE001
        return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    return dict(max_rel_diff=max_rel_diff(grads, reference_grads(SINE)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for batched in (True, False):
        for compiled in (False, True):
            row = metaddp_row(compiled, batched, args.repeats)
            rows.append(dict(what=f"metaddp MAML, {'stacked' if batched else 'loop'}, "
                                  f"{'torch.compile(model)' if compiled else 'eager'}", **row))
    for compiled, module_level in ((False, False), (True, False), (True, True)):
        how = "torch.compile(loss)" if compiled else "eager"
        where = "module-level network" if module_level else "network in a closure"
        rows.append(dict(what=f"hand-written loop, {how}, {where}",
                         **function_row(compiled, module_level)))
    print(f"{SINE.name}, {SINE.n_tasks} tasks, second order, float32, torch {torch.__version__}")
    for r in rows:
        cost = f"{r['median_ms']:.2f} ms" if "median_ms" in r else ""
        got = f"error vs float64 {r['max_rel_diff']:.1e}" if "max_rel_diff" in r else r["error"]
        print(f"  {r['what']:<70} {cost:>10}  {got}")
    if args.json:
        save_json(args.json, run_record(rows=rows, repeats=args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
