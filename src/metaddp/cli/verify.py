"""``metaddp verify``: run scenarios at several world sizes and compare with one rank.

Prints one row per world size (and layout): the global outer loss, the meta-gradient norm,
and the largest absolute and relative difference from the 1-rank result, where the relative
difference is ``max|g_W - g_1| / max|g_1|`` over every compared number. Exits 0 only when
every row is within its scenario's tolerance. The seed scenario also prints the README's
table: the user's DistributedDataParallel recipe (run on the same processes, held to
nothing) beside metaddp's first and second order, at each world size.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import torch

from ..algorithms import METHODS
from ..distributed import set_strict
from ..distributed.launch import run_local
from ..testing import scenarios as S
from ..testing.ddp_recipe import SeedDDPProblem, run_seed_ddp


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    layout: str
    problem: S.Problem | S.SeedProblem | S.BilevelProblem | SeedDDPProblem
    # Float64 scenarios: changing the world size only reorders floating-point sums (the
    # per-rank partial sums are added in a different order), which moves results by a few
    # ulps times the inner steps; 1e-10 is far below any real error (a missing reduction
    # or a wrong weighting shows up at 1e-3 or more). The seed runs in float32 as the user's
    # code did: its losses reach 1e3, so reordered sums move the gradient by ~1e-7 relative.
    # None: shown beside the others and held to nothing (the seed's DDP recipe, whose
    # meta-gradient changes with the number of ranks: what the exact rows are compared to).
    tolerance: float | None


def checks(scenario: str) -> list[Check]:
    if scenario == "seed":
        # The README's table: grad2 after one meta-step, the user's DDP recipe beside metaddp's
        # first and second order (the batch of 8 split over every rank: the sample layout).
        return [
            Check("seed", "plain DDP recipe", SeedDDPProblem(), None),
            Check("seed", "metaddp, 1st order", S.SeedProblem(second_order=False), 1e-5),
            Check("seed", "metaddp, 2nd order", S.SeedProblem(second_order=True), 1e-5),
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
    if scenario in COMPARED_SCENARIOS:
        # The algorithms compared against, on the conv model where they classify (prototypes)
        # and the regression MLP otherwise; MAML++ half-way through its loss annealing and
        # first order (meta-step 5 of 150), and past both (meta-step 60). Same float64
        # tolerance: only the order of sums changes.
        return [
            Check(scenario, f"{layout}{label}", problem, 1e-10)
            for layout in S.LAYOUTS
            for label, problem in compared(scenario, layout)
        ]
    if scenario == "inner-optimizers":
        # MAML with every inner optimizer beyond SGD, one with global-norm clipping. The
        # adaptive steps g / sqrt(v) amplify rounding where a gradient entry is small: seen
        # up to 1e-11 between world sizes, so 1e-9 here.
        return [
            Check(scenario, f"{layout}, {opt}{', clipped' if clip else ''}",
                  S.Problem(optimizer=opt, clip=clip, layout=layout, steps=2, inner_lr=lr), 1e-9)
            for layout in S.LAYOUTS
            for opt, clip, lr in (("adamw", None, 0.03), ("rmsprop", 2.0, 0.01),
                                  ("adagrad", None, 0.1))
        ]  # fmt: skip
    if scenario == "transformer":
        # A transformer encoder layer and a causal attention block with dropout 0.1 on (keyed
        # masks, metaddp.forward), second and first order, tasks one by one and stacked; the
        # same float64 tolerance: the masks are the one-process masks, so only the order of
        # sums changes.
        return [
            Check(scenario, f"{layout}, {order}{', stacked' if stacked else ''}",
                  S.Problem(model="transformer", layout=layout, steps=2, n_tasks=3, n_support=7,
                            n_query=6, first_order=order == "1st order",
                            batched=True if stacked else None), 1e-10)
            for layout in S.LAYOUTS
            for order, stacked in (("2nd order", False), ("1st order", False), ("2nd order", True))
        ]  # fmt: skip
    if scenario == "ttt":
        # The ttt task family's byte transformer, tiny (chunks of 8 bytes, width 16; 5 support
        # and 3 query chunks a task), dropout 0.1 on: ANIL adapting its last MLP block, final
        # norm and unembedding (the family's default: test-time training's fast weights) and
        # MAML adapting every weight, second order. The same float64 tolerance: the masks are
        # the one-process masks, so only the order of sums changes.
        from ..tasks.ttt import TTT

        text = TTT(shots=5, query=3, hidden=16, chunk=8)
        return [
            Check(scenario, f"{layout}, {algorithm}",
                  S.Problem(model="family", family=text, algorithm=algorithm, layout=layout,
                            steps=2, n_tasks=3, n_support=5, n_query=3, inner_lr=0.5), 1e-10)
            for layout in S.LAYOUTS
            for algorithm in ("anil", "maml")
        ]  # fmt: skip
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
    if scenario in BILEVEL_SCENARIOS:
        # A reweighting lookahead (one problem, samples split) and three problems started
        # from the meta-parameters with a proximal term (hybrid); same float64 tolerance (the
        # methods' iterations are fixed, and finite differences stay below 1e-12 relative).
        method = scenario.removeprefix("bilevel-")
        opt = "adam" if method == "sama" else "sgd"
        return [
            Check(
                scenario, "sample, lookahead", S.BilevelProblem(method=method, optimizer=opt), 1e-10
            ),
            Check(
                scenario,
                "hybrid, 3 from the start",
                S.BilevelProblem(
                    method=method, optimizer=opt, start="outer", n_problems=3, layout="hybrid"
                ),
                1e-10,
            ),
        ]
    if scenario == "sharded":
        return sharded()
    raise ValueError(f"unknown scenario {scenario!r}")


def sharded() -> list[Check]:
    """Meta-parameters sharded over the sample axis (``MetaDDP(shard=True)``) against the
    replicated one-process result (on one process shard=True cuts nothing). Second-order
    MAML with samples split; Adam inner steps in the hybrid layout (2 x 2 at 4 processes;
    at 2, two task groups of one, nothing cut); BatchNorm on the conv model; the transformer
    with dropout on; a reweighting lookahead unrolled. Float64: the gathers and
    reduce-scatters only reorder sums, so 1e-10 as above, and 1e-9 for Adam's steps as the
    inner-optimizers scenario."""
    return [
        Check("sharded", "sample, maml 2nd order", S.Problem(steps=2, shard=True), 1e-10),
        Check(
            "sharded",
            "hybrid, adam",
            S.Problem(optimizer="adam", inner_lr=0.03, layout="hybrid", steps=2, shard=True),
            1e-9,
        ),
        Check(
            "sharded",
            "sample, conv + batchnorm",
            S.Problem(model="conv", batchnorm=True, steps=2, n_tasks=3, inner_lr=0.3, shard=True),
            1e-10,
        ),
        Check(
            "sharded",
            "sample, transformer",
            S.Problem(model="transformer", steps=2, n_tasks=3, n_support=7, n_query=6, shard=True),
            1e-10,
        ),
        Check(
            "sharded",
            "sample, bilevel unrolled",
            S.BilevelProblem(method="unrolled", penalty=False, shard=True),
            1e-10,
        ),
    ]


def deterministic(c: Check) -> Check | None:
    """``c`` in deterministic mode (float32, bit identity required), or ``None`` where the
    mode does not apply (the seed's hand-written loop, the bilevel problems, sharded
    weights): every algorithm that declares the mode (``Supports.deterministic``)."""
    if not isinstance(c.problem, S.Problem) or c.problem.shard:  # sharded: whole weights
        return None
    # BatchNorm without running statistics (MAML's own): buffers cannot be updated per chunk;
    # the mode cuts and stacks its own chunks, so no stacking is asked for.
    problem = dataclasses.replace(
        c.problem, dtype=torch.float32, deterministic=True, running_stats=False, batched=None
    )
    algorithm = problem.build_algorithm()
    if not algorithm.supports.deterministic or algorithm.deterministic_refusal() is not None:
        return None  # e.g. ANIL with dropout in its body
    return dataclasses.replace(c, problem=problem, tolerance=0.0)


def compared(scenario: str, layout: str) -> list[tuple[str, S.Problem]]:
    if scenario == "mamlpp":
        return [
            (f", at step {at}", S.Problem(algorithm="mamlpp", layout=layout, steps=2,
                                          schedule_steps=150, meta_step=at))
            for at in (5, 60)
        ]  # fmt: skip
    if scenario == "boil":
        return [("", S.Problem(algorithm="boil", model="conv", layout=layout, steps=2, n_tasks=3))]
    if scenario == "cavia":  # a context vector on the regression MLP's input
        return [("", S.Problem(algorithm="cavia", layout=layout, steps=2, inner_lr=0.5))]
    steps = 2 if scenario == "protomaml" else 1
    return [
        ("", S.Problem(algorithm=scenario, model="conv", layout=layout, steps=steps, n_tasks=3))
    ]


COMPARED_SCENARIOS = ("mamlpp", "protonet", "protomaml", "boil", "cavia")
ALGORITHM_SCENARIOS = ("fomaml", "metasgd", "anil", "reptile", "imaml")
BILEVEL_SCENARIOS = tuple(f"bilevel-{m}" for m in METHODS)
SCENARIOS = (
    ("seed", "conv", "mlp")
    + ALGORITHM_SCENARIOS
    + COMPARED_SCENARIOS
    + ("inner-optimizers", "bn", "transformer", "ttt")
    + BILEVEL_SCENARIOS
    + ("sharded",)
)


def run_checks(todo: list[Check]) -> list[dict]:
    """Executed on every rank: all checks in one process group, results as flat vectors."""
    set_strict(True)
    out = []
    for c in todo:
        if isinstance(c.problem, SeedDDPProblem):  # rank 0's gradient and its shard's losses
            d = run_seed_ddp(c.problem)
            vec = torch.tensor([d["grad2"]], dtype=torch.float64)
            out.append({"loss": d["loss1"] + d["loss2"], "vec": vec, "norm": abs(d["grad2"])})
        elif isinstance(c.problem, S.SeedProblem):
            r = S.run_seed(c.problem)
            vec = torch.cat(
                [torch.tensor(r["grad2"], dtype=torch.float64), r["weight"].double().flatten()]
            )
            out.append(
                {"loss": r["loss1"][-1] + r["loss2"][-1], "vec": vec, "norm": abs(r["grad2"][-1])}
            )
        else:
            r = (
                S.run_bilevel(c.problem)
                if isinstance(c.problem, S.BilevelProblem)
                else S.run(c.problem)
            )
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
        choices=("default", "low", "replay"),
        default="default",
        help="run every scenario whose algorithm takes it with each inner step's graph "
        "rebuilt one at a time (memory='low'), or through a replay tree of their states "
        "(replay); the others are skipped, by name",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic mode in float32: every world size must give the same bits (max "
        "difference exactly 0), and a 100-step training run too, also resumed at another count",
    )
    p.set_defaults(func=main)


def parse_world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--world-sizes must be integers like 1,2,4, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--world-sizes needs positive integers, got {text!r}")
    if len(set(sizes)) < 2:
        # The first is the reference: one size alone would be compared with itself.
        raise ValueError(f"--world-sizes needs two different sizes to compare, got {text!r}")
    return list(dict.fromkeys(sizes))


def _in_memory(todo: list[Check], memory: str) -> tuple[list[Check], list[str]]:
    """The checks in the memory mode, and the names of those whose algorithm refuses it
    (its class's reason: MAML++, ProtoMAML), which are left out rather than run as if."""
    kept, refused = [], []
    for c in todo:
        if isinstance(c.problem, S.Problem):
            problem = dataclasses.replace(c.problem, memory=memory)
            try:
                problem.build_algorithm()
            except ValueError:
                refused.append(c.name)
                continue
            c = dataclasses.replace(c, problem=problem)
        kept.append(c)
    return kept, sorted(set(refused))


def main(args: argparse.Namespace) -> int:
    try:
        sizes = parse_world_sizes(args.world_sizes)
    except ValueError as e:
        print(f"metaddp verify: error: {e}", file=sys.stderr)
        return 2
    names = SCENARIOS if "all" in args.scenario else tuple(dict.fromkeys(args.scenario))
    todo = [c for n in names for c in checks(n)]
    if args.memory != "default":  # the scenarios whose algorithm takes the memory mode
        todo, refused = _in_memory(todo, args.memory)
        if refused:
            print(f"metaddp verify: no memory={args.memory!r} for {', '.join(refused)}: skipped")
        if not todo:
            print(f"metaddp verify: error: nothing takes memory={args.memory!r}", file=sys.stderr)
            return 2
    threads = None
    if args.deterministic:
        kept = [d for d in map(deterministic, todo) if d is not None]
        skipped = sorted({f"{c.name}" for c in todo} - {c.name for c in kept})
        if skipped:
            print(f"metaddp verify: no deterministic mode for {', '.join(skipped)}: skipped")
        todo, threads = kept, 1  # one thread everywhere: kernels split work by thread count
        if not todo:
            print("metaddp verify: error: nothing to run in deterministic mode", file=sys.stderr)
            return 2
    mode = "deterministic float32" if args.deterministic else "default"
    print(
        f"metaddp verify: {', '.join(names)} at world sizes {', '.join(map(str, sizes))} "
        f"({mode} mode; gloo, local processes; reference: {sizes[0]} "
        f"process{'es' if sizes[0] > 1 else ''})"
    )
    results: dict[int, list[dict]] = {}
    for w in sizes:
        t0 = time.perf_counter()
        results[w] = run_local(run_checks, w, todo, threads=threads)[0]
        print(f"  {w} process(es) done in {time.perf_counter() - t0:.1f} s", flush=True)
    header = (
        f"{'scenario':<19} {'layout':<24} {'world':>5} {'outer loss':>22} {'grad norm':>14} "
        f"{'max abs diff':>12} {'max rel diff':>12}"
    )
    print(header)
    print("-" * len(header))
    worst, failed = 0.0, []
    for i, c in enumerate(todo):
        if c.tolerance is None:  # in the seed's table below
            continue
        ref = results[sizes[0]][i]
        scale = float(ref["vec"].abs().max()) or 1.0
        for w in sizes:
            r = results[w][i]
            abs_diff = float((r["vec"] - ref["vec"]).abs().max())
            rel = abs_diff / scale
            ok = rel <= c.tolerance and math.isfinite(rel)
            if args.deterministic:  # bits: the losses too, and nothing but equality
                ok = ok and r["loss"] == ref["loss"] and torch.equal(r["vec"], ref["vec"])
            worst = max(worst, rel)
            if not ok:
                failed.append(f"{c.name}/{c.layout}@{w}")
            verdict = "" if ok else f"  FAIL (tolerance {c.tolerance:.0e})"
            print(
                f"{c.name:<19} {c.layout:<24} {w:>5} {r['loss']:>22.15g} {r['norm']:>14.6g} "
                f"{abs_diff:>12.3g} {rel:>12.3g}{verdict}"
            )
    seed_table(todo, results, sizes)
    if args.deterministic:
        failed += verify_training(sizes)
    if failed:
        print(f"worst relative difference: {worst:.3g}; outside tolerance: {', '.join(failed)}")
        return 1
    if args.deterministic:
        print("every world size gives the same bits: meta-gradients, losses and training runs")
        return 0
    print(f"worst relative difference: {worst:.3g}: every world size agrees within tolerance")
    return 0


def seed_table(todo: list[Check], results: dict[int, list[dict]], sizes: list[int]) -> None:
    """The README's table, from this run: grad2 after one meta-step of the seed at each world
    size, the DDP recipe's (rank 0's) beside metaddp's, to two decimals as the README."""
    columns = [(i, c.layout) for i, c in enumerate(todo) if c.name == "seed"]
    if not columns:
        return
    print("\nthe README's table, measured: grad2 after one meta step of the seed (a batch of 8 "
          "split over the ranks; DDP: rank 0's)")  # fmt: skip
    print(f"{'ranks':>5}  " + "  ".join(f"{name:>18}" for _, name in columns))
    for w in sizes:
        print(
            f"{w:>5}  " + "  ".join(f"{float(results[w][i]['vec'][0]):>18.2f}" for i, _ in columns)
        )


TRAIN_STEPS = 100


def train_run(cfg: dict, out: str, resume: bool) -> dict:
    """Executed on every rank: a deterministic training run in ``out`` (prepared by rank 0)."""
    from pathlib import Path

    import torch.distributed as dist

    from ..train import TrainConfig, prepare_folder, train

    config = TrainConfig(**cfg)
    if not dist.is_initialized() or dist.get_rank() == 0:
        prepare_folder(Path(out), config, resume, force=False)
    if dist.is_initialized():
        dist.barrier()
    backend = "gloo" if dist.is_initialized() else None
    r = train(config, out, resume=resume, progress=False, backend=backend)
    return {"weights": r["weights"]}


def verify_training(sizes: list[int]) -> list[str]:
    """``TRAIN_STEPS`` steps of deterministic sinusoid MAML at every world size (its own
    layout each), and one resumed halfway at another world size: the metrics files (but
    their seconds) and the final weights must be identical. Returns what differed."""
    import csv
    import shutil
    import tempfile
    from pathlib import Path

    from ..train import TrainConfig

    layouts = {1: "sample", 2: "task", 3: "sample"}
    cfg = TrainConfig(
        task="sinusoid", steps=TRAIN_STEPS, meta_batch=5, eval_every=25, eval_tasks=20,
        checkpoint_every=TRAIN_STEPS // 2, deterministic=True,
    ).resolved()  # fmt: skip

    def rows(path: Path) -> list[dict]:
        lines = path.read_text().splitlines()
        return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(lines)]

    print(f"\ntraining: {TRAIN_STEPS} steps of sinusoid MAML, deterministic, at each world size")
    failed = []
    with tempfile.TemporaryDirectory(prefix="metaddp-verify-") as tmp:
        root = Path(tmp)
        runs = {}
        for w in sizes:
            layout = layouts.get(w, "hybrid")
            c = dataclasses.replace(cfg, layout=layout).to_dict()
            runs[w] = run_local(train_run, w, c, str(root / f"w{w}"), False, threads=1)[0]
            if w == sizes[0]:
                half = dataclasses.replace(cfg, steps=TRAIN_STEPS // 2).to_dict()
                run_local(train_run, w, half, str(root / "half"), False, threads=1)
        ref_rows, ref_w = rows(root / f"w{sizes[0]}" / "metrics.csv"), runs[sizes[0]]["weights"]
        other = sizes[-1]
        shutil.copytree(root / "half", root / "cross")
        c = dataclasses.replace(cfg, layout=layouts.get(other, "hybrid")).to_dict()
        cross = run_local(train_run, other, c, str(root / "cross"), True, threads=1)[0]
        checks = [(f"{w} process(es)", root / f"w{w}", runs[w]) for w in sizes]
        checks.append((f"{sizes[0]} -> {other} at step {TRAIN_STEPS // 2}", root / "cross", cross))
        for name, folder, r in checks:
            same_rows = rows(folder / "metrics.csv") == ref_rows
            same_w = all(torch.equal(r["weights"][k], v) for k, v in ref_w.items())
            ok = same_rows and same_w
            print(f"  {name:<28} metrics.csv {'identical' if same_rows else 'DIFFERENT':<10} "
                  f"weights {'identical' if same_w else 'DIFFERENT'}")  # fmt: skip
            if not ok:
                failed.append(f"training/{name}")
    return failed
