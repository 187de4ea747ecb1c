"""Data weights learned through a whole training run, over seeds: the exact metagradient
(``memory=md.Replay()`` through all T minibatch steps) against the last step's only
(``Truncated(1)``) and plain training, side by side in one run.

Each seed runs ``examples/bilevel_training_run.py`` once per method (one process, one torch
thread); the seed sets the initialisation, the minibatch sequence and the weighting's
initialisation (the digits, the split and the flipped labels stay). Test accuracy of a model
trained from scratch with the learned weighting, mean over seeds with a 95% t interval, and the
paired difference exact minus truncated.

    python benchmarks/training_run.py --json benchmarks/results/training_run.json
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import run_record, save_json  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "bilevel_training_run.py"
T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}


def run(method: str, seed: int) -> tuple[float, float, float]:
    """(plain accuracy, weighted accuracy, final validation loss) of one run."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(EXAMPLE), "--method", method, "--seed", str(seed)],
                         capture_output=True, text=True, check=True, env=env).stdout
    plain, weighted = map(float, re.findall(r"plain training ([\d.]+).*\(\w+\) ([\d.]+)", out)[0])
    val = float(re.findall(r"validation loss after the run ([\d.]+)", out)[-1])
    return plain, weighted, val


def interval(xs: list[float]) -> str:
    m = statistics.mean(xs)
    h = T95[len(xs)] * statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")
    return f"{m:.4f} ± {h:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for seed in range(a.seeds):
        plain, exact, v_exact = run("exact", seed)
        _, truncated, v_trunc = run("truncated", seed)
        rows.append({"seed": seed, "plain": plain, "exact": exact, "truncated": truncated,
                     "val_exact": v_exact, "val_truncated": v_trunc})
        print(f"seed {seed}: plain {plain:.4f}, truncated {truncated:.4f}, exact {exact:.4f} "
              f"(validation loss {v_trunc:.4f} / {v_exact:.4f})", flush=True)
    col = {k: [r[k] for r in rows] for k in ("plain", "truncated", "exact", "val_truncated", "val_exact")}
    print(f"\ntest accuracy over {a.seeds} seeds (mean, 95% t interval)")
    print(f"  plain training on the noisy labels        {interval(col['plain'])}")
    print(f"  weighting by the last step (Truncated(1))  {interval(col['truncated'])}")
    print(f"  weighting by the whole run (Replay)        {interval(col['exact'])}")
    print(f"  exact minus truncated, paired by seed      "
          f"{interval([e - t for e, t in zip(col['exact'], col['truncated'])])}")
    print(f"validation loss after the run: truncated {interval(col['val_truncated'])}, "
          f"exact {interval(col['val_exact'])}")
    save_json(Path(a.json) if a.json else None, run_record(settings=vars(a), rows=rows))


if __name__ == "__main__":
    main()
