"""``metaddp verify``: run scenarios at several world sizes and compare with one rank.

Prints one row per world size (and layout): the global outer loss, the meta-gradient norm,
and the largest absolute and relative difference from the 1-rank result, where the relative
difference is ``max|g_W - g_1| / max|g_1|`` over every compared number. Exits 0 only when
every row is within its scenario's tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import torch

from ..distributed import set_strict
from ..distributed.launch import run_local
from ..testing import scenarios as S


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    layout: str
    problem: S.Problem | S.SeedProblem
    # Float64 scenarios: changing the world size only reorders floating-point sums (the
    # per-rank partial sums are added in a different order), which moves results by a few
    # ulps times the inner steps; 1e-10 is far below any real error (a missing reduction
    # or a wrong weighting shows up at 1e-3 or more). The seed runs in float32 as the user's
    # code did: its losses reach 1e3, so reordered sums move the gradient by ~1e-7 relative.
    tolerance: float


def checks(scenario: str) -> list[Check]:
    if scenario == "seed":
        return [
            Check(
                "seed", "sample, 1st order", S.SeedProblem(second_order=False, iterations=1), 1e-5
            ),
            Check(
                "seed", "sample, 2nd order x5", S.SeedProblem(second_order=True, iterations=5), 1e-5
            ),
        ]
    if scenario in ("conv", "mlp"):
        return [
            Check(scenario, layout, S.Problem(model=scenario, layout=layout), 1e-10)
            for layout in S.LAYOUTS
        ]
    if scenario in ALGORITHM_SCENARIOS:
        # The regression MLP, two inner steps; same float64 tolerance as above (iMAML's CG
        # stops at a 1e-13 relative residual, well inside it).
        return [
            Check(scenario, layout, S.Problem(algorithm=scenario, layout=layout, steps=2), 1e-10)
            for layout in S.LAYOUTS
        ]
    if scenario == "bn":
        # MAML on the conv model with BatchNorm synchronized over the sample axis.
        return [
            Check(
                "bn",
                layout,
                S.Problem(
                    model="conv", batchnorm=True, layout=layout, steps=2, n_tasks=3, inner_lr=0.3
                ),
                1e-10,
            )
            for layout in S.LAYOUTS
        ]
    raise ValueError(f"unknown scenario {scenario!r}")


ALGORITHM_SCENARIOS = ("fomaml", "metasgd", "anil", "reptile", "imaml")
SCENARIOS = ("seed", "conv", "mlp") + ALGORITHM_SCENARIOS + ("bn",)


def run_checks(todo: list[Check]) -> list[dict]:
    """Executed on every rank: all checks in one process group, results as flat vectors."""
    set_strict(True)
    out = []
    for c in todo:
        if isinstance(c.problem, S.SeedProblem):
            r = S.run_seed(c.problem)
            vec = torch.cat(
                [torch.tensor(r["grad2"], dtype=torch.float64), r["weight"].double().flatten()]
            )
            out.append(
                {"loss": r["loss1"][-1] + r["loss2"][-1], "vec": vec, "norm": abs(r["grad2"][-1])}
            )
        else:
            r = S.run(c.problem)
            vec = torch.cat([g.double().flatten() for g in r["grads"].values()])
            out.append({"loss": r["loss"], "vec": vec, "norm": float(vec.norm())})
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="run one meta-step of each scenario at several process counts and compare "
        "the meta-gradients with the first count's (default 1,2,4 vs 1)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--scenario",
        nargs="+",
        choices=SCENARIOS + ("all",),
        default=["all"],
        help="what to run (default: all)",
    )
    p.add_argument(
        "--world-sizes",
        default="1,2,4",
        help="comma-separated process counts; the first is the reference (default 1,2,4)",
    )
    p.add_argument(
        "--memory",
        choices=("default", "low"),
        default="default",
        help="run MAML, Meta-SGD and ANIL scenarios with each inner step's graph rebuilt "
        "during the backward (memory='low')",
    )
    p.set_defaults(func=main)


def parse_world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--world-sizes must be integers like 1,2,4, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--world-sizes needs positive integers, got {text!r}")
    return sizes


def main(args: argparse.Namespace) -> int:
    try:
        sizes = parse_world_sizes(args.world_sizes)
    except ValueError as e:
        print(f"metaddp verify: error: {e}", file=sys.stderr)
        return 2
    names = SCENARIOS if "all" in args.scenario else tuple(dict.fromkeys(args.scenario))
    todo = [c for n in names for c in checks(n)]
    if args.memory != "default":  # the unrolled scenarios in the low-memory mode
        todo = [
            dataclasses.replace(c, problem=dataclasses.replace(c.problem, memory=args.memory))
            if isinstance(c.problem, S.Problem)
            else c
            for c in todo
        ]
    print(
        f"metaddp verify: {', '.join(names)} at world sizes {', '.join(map(str, sizes))} "
        f"(gloo, local processes; reference: {sizes[0]} process{'es' if sizes[0] > 1 else ''})"
    )
    results: dict[int, list[dict]] = {}
    for w in sizes:
        t0 = time.perf_counter()
        results[w] = run_local(run_checks, w, todo)[0]
        print(f"  {w} process(es) done in {time.perf_counter() - t0:.1f} s", flush=True)
    header = (
        f"{'scenario':<8} {'layout':<22} {'world':>5} {'outer loss':>22} {'grad norm':>14} "
        f"{'max abs diff':>12} {'max rel diff':>12}"
    )
    print(header)
    print("-" * len(header))
    worst, failed = 0.0, []
    for i, c in enumerate(todo):
        ref = results[sizes[0]][i]
        scale = float(ref["vec"].abs().max()) or 1.0
        for w in sizes:
            r = results[w][i]
            abs_diff = float((r["vec"] - ref["vec"]).abs().max())
            rel = abs_diff / scale
            ok = rel <= c.tolerance and math.isfinite(rel)
            worst = max(worst, rel)
            if not ok:
                failed.append(f"{c.name}/{c.layout}@{w}")
            verdict = "" if ok else f"  FAIL (tolerance {c.tolerance:.0e})"
            print(
                f"{c.name:<8} {c.layout:<22} {w:>5} {r['loss']:>22.15g} {r['norm']:>14.6g} "
                f"{abs_diff:>12.3g} {rel:>12.3g}{verdict}"
            )
    if failed:
        print(f"worst relative difference: {worst:.3g}; outside tolerance: {', '.join(failed)}")
        return 1
    print(f"worst relative difference: {worst:.3g}: every world size agrees within tolerance")
    return 0
