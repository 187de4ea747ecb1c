"""Where a stacked convolution's time goes: one Conv-4 layer with per-task weights, run the
ways a stacked meta-step could run it, forward and each half of the backward apart.

A stacked meta-step runs every task's convolution as one grouped convolution
(``groups = tasks``, ``metaddp.algorithms._conv``). On an H200 in full float32 one cuDNN kernel for
grouped convolutions took 45% of the whole Conv-4 meta-step's device time (the device
check's ``profile`` section), and trying cuDNN's other algorithms
(``torch.backends.cudnn.benchmark``) did not change it. This measures, per layer shape:

* ``grouped``: ``aten.convolution`` with ``groups = tasks`` (what metaddp runs), and its
  input gradient and weight gradient (``aten.convolution_backward``), each alone;
* ``dense``: the same samples through one convolution with shared weights (what the plain
  batched floor runs: the same arithmetic, no groups);
* ``gemm``: per-task ``unfold`` then a batched matrix product (``torch.bmm``), the input
  gradient through ``fold``, the weight gradient one more batched product;
* ``loop``: one dense convolution (and backward) per task;
* ``transposed``: the grouped forward as a transposed convolution with each group's weight
  transposed and flipped (``MAML(conv="transposed")``), which cuDNN runs with
  its input-gradient kernels (forward only: the backward is ``grouped``'s).

Each way's result is checked against ``grouped`` (float32, max-abs normalised). Times are
medians of ``--repeats`` calls, each synchronised on CUDA.

Measured on an H200 (BENCHMARKS.md): the grouped forward, not its backward, is the slow
kernel, and one convolution per task runs it 2.3x to 8.6x faster. Whole meta-steps gained
from that only in full float32 replayed from a CUDA graph (the device check's
``stacked_conv`` section), so metaddp measures each shape's ways at its first call and keeps the
fastest (``MAML(conv="auto")``, the default; ``conv=`` forces one).

    python benchmarks/grouped_conv.py --device cuda --json benchmarks/results/grouped_conv_h200.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_ms, run_record, save_json, time_round_robin  # noqa: E402

# (label, tasks, samples per task, channels in, channels out, height = width)
SHAPES = [
    ("layer 1, query", 32, 75, 1, 64, 28),
    ("layer 2, query", 32, 75, 64, 64, 14),
    ("layer 3, query", 32, 75, 64, 64, 7),
    ("layer 2, support", 32, 5, 64, 64, 14),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def measure(shape, device: str, repeats: int) -> list[dict]:
    label, t, b, cin, cout, hw = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, b, cin, hw, hw, generator=g).to(device)
    w = (torch.randn(t, cout, cin, 3, 3, generator=g) / (3 * cin**0.5)).to(device)
    gy = torch.randn(t, b, cout, hw, hw, generator=g).to(device)

    def run(fn, repeats: int) -> float:  # milliseconds, median, synchronised on CUDA
        return median_ms(time_round_robin({"fn": fn}, repeats, warmup=3)["fn"])

    pad, one, zero = [1, 1], [1, 1], [0, 0]

    # grouped: samples x (tasks * channels)
    xg = x.transpose(0, 1).reshape(b, t * cin, hw, hw)
    wg = w.reshape(t * cout, cin, 3, 3)
    gyg = gy.transpose(0, 1).reshape(b, t * cout, hw, hw)

    def grouped_fwd():
        return torch.ops.aten.convolution(xg, wg, None, one, pad, one, False, zero, t)

    def grouped_bwd(mask):
        return lambda: torch.ops.aten.convolution_backward(
            gyg, xg, wg, None, one, pad, one, False, zero, t, mask)

    y_ref = grouped_fwd().reshape(b, t, cout, hw, hw).transpose(0, 1)
    gx_ref = grouped_bwd([True, False, False])()[0].reshape(b, t, cin, hw, hw).transpose(0, 1)
    gw_ref = grouped_bwd([False, True, False])()[1].reshape(t, cout, cin, 3, 3)

    # dense: tasks * samples images, one weight (not the same numbers: the cost of no groups)
    xd, wd, gyd = x.reshape(t * b, cin, hw, hw), w[0], gy.reshape(t * b, cout, hw, hw)

    def dense_fwd():
        return torch.ops.aten.convolution(xd, wd, None, one, pad, one, False, zero, 1)

    def dense_bwd(mask):
        return lambda: torch.ops.aten.convolution_backward(
            gyd, xd, wd, None, one, pad, one, False, zero, 1, mask)

    # gemm: cols [t, cin*9, b*L]; y[t] = w[t] @ cols[t]
    L = hw * hw
    wm = w.reshape(t, cout, cin * 9)
    gym = gy.reshape(t, b, cout, L).permute(0, 2, 1, 3).reshape(t, cout, b * L)

    def cols():
        c = F.unfold(x.reshape(t * b, cin, hw, hw), 3, padding=1)  # [t*b, cin*9, L]
        return c.reshape(t, b, cin * 9, L).permute(0, 2, 1, 3).reshape(t, cin * 9, b * L)

    def gemm_fwd():
        y = torch.bmm(wm, cols())  # [t, cout, b*L]
        return y.reshape(t, cout, b, hw, hw).permute(0, 2, 1, 3, 4)

    def gemm_dgrad():
        gc = torch.bmm(wm.transpose(1, 2), gym)  # [t, cin*9, b*L]
        gc = gc.reshape(t, cin * 9, b, L).permute(0, 2, 1, 3).reshape(t * b, cin * 9, L)
        return F.fold(gc, (hw, hw), 3, padding=1).reshape(t, b, cin, hw, hw)

    def gemm_wgrad():
        return torch.bmm(gym, cols().transpose(1, 2)).reshape(t, cout, cin, 3, 3)

    def loop_fwd():
        return [F.conv2d(x[i], w[i], padding=1) for i in range(t)]

    def loop_bwd(mask):
        return lambda: [torch.ops.aten.convolution_backward(
            gy[i], x[i], w[i], None, one, pad, one, False, zero, 1, mask) for i in range(t)]

    def transposed_fwd():
        flipped = w.reshape(t * cout, cin, 3, 3).unflatten(0, (t, -1)).transpose(1, 2)
        flipped = flipped.flatten(0, 1).flip([2, 3])
        return torch.ops.aten.convolution(xg, flipped, None, one, pad, one, True, zero, t)

    rows = []
    ways = {
        "grouped": (grouped_fwd, grouped_bwd([True, False, False]),
                    grouped_bwd([False, True, False])),
        "dense": (dense_fwd, dense_bwd([True, False, False]), dense_bwd([False, True, False])),
        "gemm": (gemm_fwd, gemm_dgrad, gemm_wgrad),
    }
    errors = {
        "transposed": (_rel(transposed_fwd().reshape(b, t, cout, hw, hw).transpose(0, 1), y_ref),
                       None, None),
        "gemm": (_rel(gemm_fwd(), y_ref), _rel(gemm_dgrad(), gx_ref), _rel(gemm_wgrad(), gw_ref)),
        "loop": (_rel(torch.stack(loop_fwd()), y_ref), None, None),
    }
    for name, (fwd, dgrad, wgrad) in ways.items():
        rows.append({"shape": label, "way": name, "forward_ms": run(fwd, repeats),
                     "input_grad_ms": run(dgrad, repeats) if cin > 1 else None,
                     "weight_grad_ms": run(wgrad, repeats),
                     "error_vs_grouped": errors.get(name)})
    rows.append({"shape": label, "way": "transposed", "forward_ms": run(transposed_fwd, repeats),
                 "input_grad_ms": None, "weight_grad_ms": None,
                 "error_vs_grouped": errors["transposed"]})
    rows.append({"shape": label, "way": "loop", "forward_ms": run(loop_fwd, repeats),
                 "input_grad_ms": run(loop_bwd([True, False, False]), repeats)
                 if cin > 1 else None,
                 "weight_grad_ms": run(loop_bwd([False, True, False]), repeats),
                 "error_vs_grouped": errors["loop"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="4 tasks, 5 samples (a smoke run)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [(s[0], 4, 5, *s[3:]) for s in SHAPES] if args.quick else SHAPES
    rows = [r for s in shapes for r in measure(s, args.device, args.repeats)]
    for r in rows:
        print(r, flush=True)
    save_json(args.json, run_record(device=args.device, rows=rows, tf32=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
