"""Data reweighting at 40% label noise, through the command line: ``metaddp train noisy-digits``.

For each seed, three runs of the same length on the same noisy digits (docs/training.md):

- ``erm``: plain training on the noisy labels;
- ``reweight``: Meta-Weight-Net's weighting, trained by the exact hypergradient of a one-step
  lookahead on the clean meta images, on ``--nproc 2`` processes, stopped halfway and
  continued with ``--resume``;
- ``erm --keep clean``: plain training on the clean training images only (the oracle).

Printed: each run's test accuracy on the 600 test images, the mean over seeds, and the margin
of reweighting over plain training with its 95% interval over seeds (Student's t: the seeds
vary the initialisation and the batches; the noisy labels are the same in every run).

    python benchmarks/reweighting.py --json benchmarks/results/reweighting.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import run_record, save_json  # noqa: E402

# Two-sided 95% quantiles of Student's t by degrees of freedom.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def train(out: Path, *args: str) -> dict:
    command = [sys.executable, "-m", "metaddp", "train", "noisy-digits", "--no-progress", *args]
    subprocess.run(command + ["--out", str(out)], check=True, capture_output=True, text=True)
    return json.loads((out / "summary.json").read_text())


def interval(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, T95[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    common = ["--steps", str(a.steps), "--eval-every", str(a.steps // 6)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="metaddp-reweighting-") as tmp:
        for seed in range(a.seeds):
            s = ["--seed", str(seed)]
            erm = train(Path(tmp) / f"erm{seed}", "--algorithm", "erm", *common, *s)
            clean = train(Path(tmp) / f"clean{seed}", "--algorithm", "erm", "--keep", "clean", *common, *s)
            half = ["--steps", str(a.steps // 2), "--eval-every", str(a.steps // 6)]
            rw = Path(tmp) / f"reweight{seed}"
            train(rw, "--algorithm", "reweight", "--nproc", "2", *half, *s)
            subprocess.run(
                [sys.executable, "-m", "metaddp", "train", "--resume", str(rw), "--steps", str(a.steps),
                 "--nproc", "2", "--no-progress"],
                check=True, capture_output=True, text=True,
            )
            reweight = json.loads((rw / "summary.json").read_text())
            row = {
                "seed": seed,
                "erm": erm["test_acc_after"],
                "reweight": reweight["test_acc_after"],
                "clean": clean["test_acc_after"],
                "reweight_ci_test": reweight["test_acc_after_ci"],
            }
            rows.append(row)
            print(f"seed {seed}: plain {row['erm']:.4f}  reweighted {row['reweight']:.4f} "
                  f"(2 processes, resumed at step {a.steps // 2})  clean only {row['clean']:.4f}",
                  flush=True)
    stats = {k: interval([r[k] for r in rows]) for k in ("erm", "reweight", "clean")}
    margin = interval([r["reweight"] - r["erm"] for r in rows])
    print(f"\ntest accuracy over {a.seeds} seeds, mean and 95% interval (t):")
    for k, name in (("erm", "plain, noisy labels"), ("reweight", "reweighted"), ("clean", "clean only")):
        print(f"  {name:<22} {stats[k][0]:.4f} ± {stats[k][1]:.4f}")
    print(f"  reweighted - plain      {margin[0]:+.4f} ± {margin[1]:.4f}")
    save_json(Path(a.json) if a.json else None, run_record(
        settings={"steps": a.steps, "seeds": a.seeds, "noise": 0.4},
        runs=rows, mean_ci=stats, margin=margin,
    ))


if __name__ == "__main__":
    main()
