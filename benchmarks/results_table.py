"""Every few-shot algorithm trained by ``metaddp train`` on the same tasks: held-out score with
its 95% interval, seconds per meta-step, and the task family's baseline on the same tasks.

Each row is one ``metaddp train`` run (one process, the family's defaults but the steps and the
meta-batch below), evaluated on the same held-out tasks. Prints a Markdown table (the one in
docs/training.md) and saves the rows with ``--json``.

    python benchmarks/results_table.py --json benchmarks/results/algorithms.json

It is a short CPU budget, not the papers' training: the numbers rank the algorithms at equal
steps; they are not the published accuracies.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ALGORITHMS = (
    "maml", "fomaml", "metasgd", "anil", "boil", "mamlpp", "protonet", "protomaml", "reptile",
    "imaml",
)  # fmt: skip
CLASSIFIERS = ("protonet", "protomaml")  # no regression form

# (label, task, extra flags): glyphs 5-way and 20-way 1-shot, and sinusoid regression (scored
# after the one inner step it trains with: learned rates trained for one step can diverge
# over the family's default ten).
SETUPS = (
    ("glyphs 5-way 1-shot", "glyphs", ["--ways", "5", "--steps", "150", "--meta-batch", "8"]),
    ("glyphs 20-way 1-shot", "glyphs", ["--ways", "20", "--steps", "100", "--meta-batch", "4"]),
    ("sinusoid 10-shot", "sinusoid", ["--steps", "500", "--eval-steps", "1"]),
)
# iMAML's implicit system is indefinite at the default proximal strength this far from a
# minimum (metaddp train stops at step 1 and says so): a strong one on glyphs; on sinusoid
# docs/training.md's 5 inner steps, with lam 190 (at 100 the system turned indefinite at
# step 499; gradient descent on the proximal objective needs inner_lr * lam < 2).
ALGORITHM_FLAGS = {
    ("glyphs", "imaml"): ["--lam", "1000", "--inner-lr", "0.1"],
    ("sinusoid", "imaml"): ["--lam", "190", "--inner-steps", "5", "--eval-steps", "5"],
}


def step_seconds(metrics: Path) -> float:
    """Median seconds per meta-step from metrics.csv's clock (the first step, which warms up,
    left out)."""
    rows = list(csv.DictReader(metrics.read_text().splitlines()))
    t = [float(r["seconds"]) for r in rows]
    gaps = sorted(b - a for a, b in zip(t[1:], t[2:], strict=False)) or [t[-1]]
    return gaps[len(gaps) // 2]


def run(task: str, algorithm: str, flags: list[str], eval_tasks: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="metaddp-results-") as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "metaddp", "train", task, "--algorithm", algorithm,
               *flags, "--eval-every", "0", "--eval-tasks", str(eval_tasks), "--no-progress",
               "--out", str(out)]  # fmt: skip
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            return {"error": done.stderr.strip().splitlines()[-1:]}
        summary = json.loads((out / "summary.json").read_text())
        summary["step_s"] = step_seconds(out / "metrics.csv")
        summary["wall_s"] = time.perf_counter() - t0
        summary["command"] = "metaddp " + " ".join(cmd[3:-2])
        return summary


def cell(r: dict, key: str, scale: float = 1.0, digits: int = 1) -> str:
    if "error" in r:
        return "error"
    return f"{scale * r[key]:.{digits}f} ± {scale * r[key + '_ci']:.{digits}f}"


def table(rows: list[dict]) -> str:
    lines = []
    for label in dict.fromkeys(r["setup"] for r in rows):
        mine = [r for r in rows if r["setup"] == label]
        classify = "test_acc_after" in next((r for r in mine if "error" not in r), {})
        what = "accuracy (%)" if classify else "query MSE"
        lines += [f"**{label}**", "", f"| algorithm | held-out {what} | s / meta-step |",
                  "|---|---:|---:|"]  # fmt: skip
        for r in mine:
            score = cell(r, "test_acc_after", 100) if classify else cell(r, "test_after", 1, 3)
            lines.append(f"| `{r['algorithm']}` | {score} | {r.get('step_s', float('nan')):.2f} |")
        base = next((r for r in mine if "test_acc_baseline" in r), None)
        if base is not None:
            b, ci = 100 * base["test_acc_baseline"], 100 * base["test_acc_baseline_ci"]
            lines.append(f"| pixel nearest class mean | {b:.1f} ± {ci:.1f} | |")
        if not classify and mine and "test_before" in mine[0]:
            lines.append(f"| (MAML's meta-parameters before adaptation) | "
                         f"{mine[0]['test_before']:.3f} | |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="save the rows here")
    p.add_argument("--eval-tasks", type=int, default=100)
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    p.add_argument("--setups", nargs="+", default=[s[0] for s in SETUPS],
                   help="which of the setups (by label)")  # fmt: skip
    p.add_argument("--merge", action="store_true",
                   help="keep --json's other rows, replacing the ones run now")  # fmt: skip
    args = p.parse_args()
    rows = json.loads(args.json.read_text()) if args.merge and args.json else []
    for label, task, flags in SETUPS:
        if label not in args.setups:
            continue
        for a in args.algorithms:
            if task == "sinusoid" and a in CLASSIFIERS:
                continue
            r = run(task, a, flags + ALGORITHM_FLAGS.get((task, a), []), args.eval_tasks)
            r.update(setup=label, algorithm=a)
            rows = [q for q in rows if (q["setup"], q["algorithm"]) != (label, a)] + [r]
            print(f"{label:<22} {a:<10} {r.get('wall_s', 0):6.0f} s  "
                  f"{r.get('test_acc_after', r.get('test_after', r.get('error')))}", flush=True)  # fmt: skip
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
    order = {(label, a): i for i, (label, _, _) in enumerate(SETUPS) for a in ALGORITHMS}
    rows.sort(key=lambda r: (order.get((r["setup"], r["algorithm"]), 0),
                             ALGORITHMS.index(r["algorithm"])))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
