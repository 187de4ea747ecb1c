"""Data weights learned through a whole training run, over seeds: ``metaddp train noisy-run``
with the exact hypergradient (``--method unrolled``: through all T minibatch steps, from a
tree of saved states, ``memory=md.Replay()``) against the last step's only (``--method
truncated``, ``Truncated(1)``) and plain training, side by side in one run.

Each seed runs ``metaddp train noisy-run`` once per method on its defaults (T = 200 steps of
SGD with momentum on minibatches of 32 of the 1097 training digits, 40% of their labels
flipped; 100 outer steps of Adam on the weighting; one process, one torch thread). The seed
sets the network's initialisation, the minibatch sequence and the weighting's initialisation;
the digits, the split and the flipped labels stay. The score is the test accuracy (600
images) of a run with the learned weighting, beside the same run without it (plain
training): mean over seeds with a 95% t interval, and the paired difference exact minus
truncated.

    python benchmarks/training_run.py --json benchmarks/results/training_run.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import run_record, save_json  # noqa: E402

T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}


def run(method: str, seed: int, folder: Path, extra: list[str]) -> dict[str, float]:
    """The summary of one ``metaddp train noisy-run``."""
    out = folder / f"{method}-{seed}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "metaddp", "train", "noisy-run", "--method", method, "--seed",
           str(seed), "--out", str(out), "--no-progress", "--force", *extra]
    subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads((out / "summary.json").read_text())


def interval(xs: list[float]) -> str:
    m = statistics.mean(xs)
    h = T95[len(xs)] * statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")
    return f"{m:.3f} ± {h:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (one core each)")
    ap.add_argument("--json", default=None)
    ap.add_argument("extra", nargs="*", help="more `metaddp train` options, after --")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(a.jobs) as pool:
        jobs = {(m, s): pool.submit(run, m, s, Path(tmp), a.extra)
                for s in range(a.seeds) for m in ("unrolled", "truncated")}
        rows = []
        for s in range(a.seeds):
            exact, trunc = jobs["unrolled", s].result(), jobs["truncated", s].result()
            # The plain run is the same for both methods (same seed): one check of the wiring.
            assert exact["test_acc_before"] == trunc["test_acc_before"]
            rows.append({"seed": s, "plain": exact["test_acc_before"],
                         "truncated": trunc["test_acc_after"], "exact": exact["test_acc_after"],
                         "plain_loss": exact["test_before"], "truncated_loss": trunc["test_after"],
                         "exact_loss": exact["test_after"]})
            r = rows[-1]
            print(f"seed {s}: plain {r['plain']:.4f}, truncated {r['truncated']:.4f}, "
                  f"exact {r['exact']:.4f}", flush=True)
    col = {k: [r[k] for r in rows] for k in rows[0] if k != "seed"}
    print(f"\ntest accuracy over {a.seeds} seeds (mean, 95% t interval)")
    print(f"  plain training on the noisy labels          {interval(col['plain'])}")
    print(f"  weighting by the last step (Truncated(1))    {interval(col['truncated'])}")
    print(f"  weighting by the whole run (exact, Replay)   {interval(col['exact'])}")
    print(f"  exact minus truncated, paired by seed        "
          f"{interval([e - t for e, t in zip(col['exact'], col['truncated'])])}")
    print(f"test loss: plain {interval(col['plain_loss'])}, truncated "
          f"{interval(col['truncated_loss'])}, exact {interval(col['exact_loss'])}")
    save_json(Path(a.json) if a.json else None, run_record(settings=vars(a), rows=rows))


if __name__ == "__main__":
    main()
