"""Reverse over reverse against forward over reverse: the Hessian-vector product that a
``memory="low"`` backward takes at every rebuilt inner step, three ways, side by side in one
run.

Each way returns the inner gradient ``g`` at the weights and the product ``H v`` for a fixed
direction ``v``:

* ``rev-rev``: what :mod:`metaddp._remat` does. A forward, ``autograd.grad`` with
  ``create_graph=True``, then a vector-Jacobian product of ``g`` with ``v``;
* ``func fwd-rev``: ``torch.func.jvp`` of ``torch.func.grad`` (MixFlow-MG's choice in JAX);
* ``dual fwd-rev``: ``torch.autograd.forward_ad`` dual weights through one forward and one
  ``autograd.grad``, whose backward then carries the tangent ``H v``.

Problems: the sinusoid MLP with 25 tasks stacked (``torch.vmap``, as the low mode runs it on
the CPU) and Conv-4 with BatchNorm (batch statistics), one 5-way 1-shot task with 15 queries
per class (the low mode runs Conv-4's tasks one by one on the CPU). One thread; the ways
alternate in every round. Each way's ``H v`` is compared with a float64 reverse-over-reverse
product of the same weights before its time is trusted.

    python benchmarks/hvp_modes.py --json benchmarks/results/hvp_modes.json

``--device cuda`` runs the same on a GPU (the device check's ``hvp`` section).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, jvp, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CONV, SINE, run_record, save_json, time_round_robin  # noqa: E402
from metaddp.algorithms._stacked import _stack  # noqa: E402


def _problem(name: str, dtype: torch.dtype, device: str = "cpu"):
    """``(loss_of(params) -> scalar, params, direction)`` in ``dtype`` on ``device``."""
    case = dataclasses.replace({"mlp": SINE, "conv": CONV}[name], device=device)
    net = case.build(dtype)
    gen = torch.Generator().manual_seed(1)
    if name == "mlp":  # every task's row of stacked weights, the tasks' losses summed
        tasks = case.tasks(dtype)
        x, y, n = _stack([t.support for t in tasks])
        params = {k: v.detach().unsqueeze(0).expand(len(tasks), *v.shape).clone()
                  for k, v in net.named_parameters()}

        def one(p, xt, yt):
            return case.loss_fn(functional_call(net, p, (xt,)), yt).sum() / n

        def loss_of(p):
            return vmap(one)(p, x, y).sum()
    else:
        task = case.tasks(dtype)[0]
        x, y = task.support.x, task.support.y
        params = {k: v.detach().clone() for k, v in net.named_parameters()}

        def loss_of(p):
            return case.loss_fn(functional_call(net, p, (x,)), y).mean()

    v = {k: torch.randn(p.shape, generator=gen).to(dtype).to(device) for k, p in params.items()}
    return loss_of, params, v


def rev_rev(loss_of: Callable, params: dict, v: dict) -> tuple[list, list]:
    leaf = {k: p.clone().requires_grad_() for k, p in params.items()}
    g = torch.autograd.grad(loss_of(leaf), list(leaf.values()), create_graph=True)
    hv = torch.autograd.grad(g, list(leaf.values()), grad_outputs=list(v.values()))
    return [t.detach() for t in g], list(hv)


def func_fwd_rev(loss_of: Callable, params: dict, v: dict) -> tuple[list, list]:
    g, hv = jvp(grad(loss_of), (params,), (v,))
    return [g[k] for k in params], [hv[k] for k in params]


def dual_fwd_rev(loss_of: Callable, params: dict, v: dict) -> tuple[list, list]:
    with fwAD.dual_level():
        leaf = {k: fwAD.make_dual(p.clone(), v[k]).requires_grad_() for k, p in params.items()}
        g = torch.autograd.grad(loss_of(leaf), list(leaf.values()))
        out = [fwAD.unpack_dual(t) for t in g]
    return [o.primal for o in out], [o.tangent for o in out]


WAYS = {"rev-rev": rev_rev, "func fwd-rev": func_fwd_rev, "dual fwd-rev": dual_fwd_rev}


def measure(name: str, device: str, rounds: int) -> list[dict]:
    """One row per way: best and median seconds, and ``H v``'s error against float64."""
    loss64, params64, v64 = _problem(name, torch.float64, device)
    _, h64 = rev_rev(loss64, params64, v64)
    scale = max(t.abs().max().item() for t in h64)
    loss_of, params, v = _problem(name, torch.float32, device)
    errors = {}
    for way, fn in WAYS.items():
        _, hv = fn(loss_of, params, v)
        errors[way] = max((a.double() - b).abs().max().item()
                          for a, b in zip(hv, h64, strict=True)) / scale
    steps = {way: (lambda fn=fn: fn(loss_of, params, v)) for way, fn in WAYS.items()}
    times = time_round_robin(steps, rounds)
    base = statistics.median(times["rev-rev"])
    return [dict(problem=name, way=way, rounds=rounds, best_s=min(t),
                 median_s=statistics.median(t), median_over_rev_rev=statistics.median(t) / base,
                 error_vs_float64=errors[way]) for way, t in times.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default="mlp,conv")
    ap.add_argument("--rounds", type=int, default=None, help="default: 60 (mlp), 9 (conv)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(f"{'problem':>8} {'way':>14} {'best ms':>8} {'median ms':>9} {'/ rev-rev':>9} "
          f"{'Hv err vs float64':>17}")
    for name in args.problems.split(","):
        for row in measure(name, args.device, args.rounds or (60 if name == "mlp" else 9)):
            rows.append(row)
            print(f"{name:>8} {row['way']:>14} {row['best_s'] * 1e3:8.2f} "
                  f"{row['median_s'] * 1e3:9.2f} {row['median_over_rev_rev']:9.2f} "
                  f"{row['error_vs_float64']:17.1e}")
    save_json(args.json, run_record(rows=rows, threads=1, device=args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
