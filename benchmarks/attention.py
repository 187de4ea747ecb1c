"""Second-order attention: torch's math path against ``metaddp.forward.attention`` (exact,
recomputed in chunks of query rows), side by side in one run, and torch's fused default.

One step is the forward, the gradients of a scalar of the output with respect to q, k and v
with ``create_graph=True``, and the backward of a scalar of those gradients: what a
second-order meta-step does through a transformer's attention. B = 1, H = 4, E = 32, float32,
on the CPU, one torch thread. Per (path, T), in a fresh process:

- seconds: median of ``--repeats`` steps after a warm-up;
- held MiB: bytes of the tensors autograd saved for backward, counted through
  ``torch.autograd.graph.saved_tensors_hooks`` (each storage once), once the second-order graph
  is built (after the ``create_graph=True`` gradient); peak MiB: their peak over the whole step,
  including what each backward rebuilds for one chunk and drops;
- RSS MiB: the process's peak resident memory during one step above its resident memory before
  it (VmHWM after a reset; the CPU allocator's reuse hides some frees, so it is coarse).

metaddp uses its default chunk unless ``--chunk`` (a [B, H, chunk, T] block of about 2**19
elements: 2**17 / T rows at B * H = 4, so one chunk up to T = 256, then T**2 / 2**17 chunks:
2 at T = 512, 32 at T = 2048). The peak columns count one chunk's rebuilt graph, so they fall
below the math path's only with several chunks. The fused default (flash attention on the
CPU) has no double backward: its row gives the error.

    python benchmarks/attention.py --json benchmarks/results/attention.json
    python benchmarks/attention.py --T 1024,2048 --chunk 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

B, H, E = 1, 4, 32
PATHS = ("math", "metaddp")


def _attend(path: str, chunk: int | None = None):  # type: ignore[no-untyped-def]
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from metaddp.forward import attention

    if path == "metaddp":
        return lambda q, k, v: attention(q, k, v, chunk=chunk)
    if path == "fused":
        return F.scaled_dot_product_attention

    def math(q, k, v):  # type: ignore[no-untyped-def]
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v)

    return math


def _inputs(T: int, dtype=None):  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(T)
    return [torch.randn(B, H, T, E, generator=g, dtype=dtype or torch.float32).requires_grad_() for _ in range(3)]


def _step(attend, qkv, counter=None) -> dict:  # type: ignore[no-untyped-def]
    """One second-order step; with ``counter``, the saved bytes held once the graph is built."""
    import torch

    for x in qkv:
        x.grad = None
    out = attend(*qkv)
    w = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out)
    gs = torch.autograd.grad((out * w).sum(), qkv, create_graph=True)
    held = counter.now if counter is not None else 0
    sum(g.square().sum() for g in gs).backward()
    return {"held": held}


def measure(path: str, T: int, repeats: int, chunk: int | None = None) -> dict:
    """In this (fresh) process: time, saved bytes and resident memory of one step."""
    import torch

    from common import current_rss_mib, peak_rss_mib, reset_peak_rss
    from remat_memory import SavedBytes

    torch.set_num_threads(1)
    attend = _attend(path, chunk)
    _step(attend, _inputs(16))  # warm-up at a small size: lazy initialisation, thread pools
    qkv = _inputs(T)
    base = current_rss_mib()
    reset_peak_rss()
    _step(attend, qkv)
    rss = peak_rss_mib() - base
    counter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        held = _step(attend, qkv, counter)["held"]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _step(attend, qkv)
        times.append(time.perf_counter() - t0)
    row = {"seconds": statistics.median(times), "held_mib": held / 2**20, "peak_mib": counter.peak / 2**20,
           "rss_mib": rss}
    if path == "metaddp":  # the same step on the math path, float64: how far float32 is off
        grads = [x.grad.double() for x in qkv]
        ref = [x.detach().double().requires_grad_() for x in qkv]
        _step(_attend("math"), ref)
        row["max_rel_diff_f32"] = max(float((a - r.grad).abs().max() / r.grad.abs().max()) for a, r in zip(grads, ref))
    return row


def fused_error(T: int) -> str:
    """What torch's fused default says when asked for a second-order step."""
    try:
        _step(_attend("fused"), _inputs(T))
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return "no error: the fused default differentiated twice"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="128,256,512,1024,2048", help="sequence lengths, comma-separated")
    ap.add_argument("--quick", action="store_true", help="T = 128, 512, 1024; 2 repeats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, help="metaddp's query rows per chunk (default: its own choice)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", nargs=2, metavar=("PATH", "T"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.repeats, args.chunk)))
        return 0
    from common import run_record, save_json

    lengths = [128, 512, 1024] if args.quick else [int(t) for t in args.T.split(",")]
    repeats = 2 if args.quick else args.repeats
    cols = ("seconds", "held_mib", "peak_mib", "rss_mib")
    chunk = args.chunk or "default"
    print(f"B={B} H={H} E={E} float32, one thread, metaddp chunk {chunk}; ratio = metaddp / math")
    print(f"{'T':>5} {'path':<8} {'seconds':>9} {'held MiB':>10} {'peak MiB':>10} {'RSS MiB':>9}  f32 rel. diff")
    rows = []
    for T in lengths:
        got = {}
        for path in PATHS:
            extra = ["--chunk", str(args.chunk)] if args.chunk else []
            out = subprocess.run([sys.executable, __file__, "--child", path, str(T), "--repeats", str(repeats), *extra],
                                 capture_output=True, text=True, check=True)
            got[path] = json.loads(out.stdout.strip().splitlines()[-1])
            r = got[path]
            diff = f"  {r['max_rel_diff_f32']:.1e}" if "max_rel_diff_f32" in r else ""
            print(f"{T:>5} {path:<8} {r['seconds']:>9.3f} {r['held_mib']:>10.2f} {r['peak_mib']:>10.2f}"
                  f" {r['rss_mib']:>9.1f}{diff}", flush=True)
        ratio = {c: got["metaddp"][c] / got["math"][c] if got["math"][c] > 0 else float("nan") for c in cols}
        print(f"{T:>5} {'ratio':<8} {ratio['seconds']:>9.2f} {ratio['held_mib']:>10.3f} {ratio['peak_mib']:>10.3f}"
              f" {ratio['rss_mib']:>9.3f}", flush=True)
        rows.append({"T": T, **got, "ratio": ratio})
    import torch

    torch.set_num_threads(1)
    fused = fused_error(lengths[0])
    print(f"{lengths[0]:>5} fused    F.scaled_dot_product_attention default (flash on the CPU), second order: {fused}")
    save_json(args.json, run_record(B=B, H=H, E=E, dtype="float32", repeats=repeats, chunk=args.chunk, rows=rows,
                                    fused_second_order=fused))
    return 0


if __name__ == "__main__":
    sys.exit(main())
