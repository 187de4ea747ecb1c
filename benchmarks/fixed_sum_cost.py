"""What one order-free sum costs: ``metaddp.distributed._fixed.fixed_sum`` timed alone, one
process, one thread, float32, freed memory kept (as in every rank).

Buffers of the deterministic mode's sums, ``[tasks, chunks, *parameter]`` for each parameter:

* sinusoid MLP (1-40-40-1), 25 tasks x 5 chunks: 1,761 entries per chunk;
* Conv-4 (64 channels, 5 ways), 8 tasks x 5 chunks: 112,005 entries per chunk.

``--against REV`` also times the ``_fixed.py`` of a git revision of this repository, the two
interleaved call by call, and prints the ratio and the largest difference of their totals.
Median and best of ``--rounds`` rounds of 5 calls each.

    python benchmarks/fixed_sum_cost.py --against d80249c
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import metaddp
from metaddp.distributed import _fixed

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "sinusoid MLP, 25 tasks x 5 chunks": (25, 5, [(40, 1), (40,), (40, 40), (40,), (1, 40), (1,)]),
    "Conv-4, 8 tasks x 5 chunks": (
        8, 5, [(64, 1, 3, 3), (64,), (64,), (64,)] + [(64, 64, 3, 3), (64,), (64,), (64,)] * 3
        + [(5, 64), (5,)],
    ),
}


def _module_at(rev: str):
    """``metaddp.distributed._fixed`` as it was at ``rev``, imported beside today's."""
    where = f"{rev}:src/metaddp/distributed/_fixed.py"
    text = subprocess.run(["git", "-C", str(ROOT), "show", where],
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "_fixed_then.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("metaddp.distributed._fixed_then", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _rounds(fns: dict, tensors: list, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f(tensors, None)  # warm-up
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(5):
                f(tensors, None)
            times[name].append((time.perf_counter() - t0) / 5)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="a git revision whose _fixed.py to time beside today's")
    ap.add_argument("--rounds", type=int, default=150)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    metaddp.distributed.keep_freed_memory()
    fns = {"now": _fixed.fixed_sum}
    if args.against:
        fns[args.against] = _module_at(args.against).fixed_sum
    g = torch.Generator().manual_seed(0)
    for label, (tasks, chunks, shapes) in SHAPES.items():
        tensors = [torch.randn(tasks, chunks, *s, generator=g) for s in shapes]
        times = _rounds(fns, tensors, max(10, args.rounds // (10 if "Conv" in label else 1)))
        line = ", ".join(f"{k} {1e3 * statistics.median(t):.2f} ms (best {1e3 * min(t):.2f})"
                         for k, t in times.items())
        if args.against:
            ratio = statistics.median(times["now"]) / statistics.median(times[args.against])
            now, then = (fns[k](tensors, None) for k in fns)
            diff = max(float((a - b).abs().max() / b.abs().max())
                       for a, b in zip(now, then, strict=True))
            line += f"; now / {args.against}: {ratio:.2f}, totals differ by {diff:.1e} (relative)"
        print(f"{label}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
