"""The one device check: what the GPU path does, in one run that fits a short lease.

Sections (each runs even if an earlier one failed; each writes its rows to the results):

- ``exact``: one-process meta-gradients on the device in float64 (stacked and looped MAML,
  MAML's BatchNorm synchronized by MetaDDP, Meta-SGD, the low-memory mode) against the same
  step in float64 on the CPU and against an independent per-task autograd loop.
- ``peers``: one second-order MAML meta-step side by side (Conv-4 with BatchNorm, 5-way
  1-shot, 15 queries, 32 tasks, K = 1 and 5): metaddp's automatic choice, hand-written
  vmap, the per-task loop, higher, TorchOpt, and the plain batched forward+backward floor;
  each row's median time, meta-gradient error against float64 and peak device memory.
- ``syncs``: a MetaDDP meta-step under ``torch.cuda.set_sync_debug_mode("error")`` (on the
  CPU: metaddp's host reads, counted as a device's), stacked and looped.
- ``graphs``: ``metaddp.distributed.CapturedStep`` (Conv-4 with BatchNorm, 32 tasks, K = 1 and 5, with
  and without MetaDDP; a looped conv with running statistics): one meta-step against eager
  and eager against itself from the same weights (bits: cuDNN's default algorithm picks are
  not reproducible run to run; ``--cudnn-deterministic`` makes them so), 6 SGD steps against
  eager, each step's time, and a non-finite inner gradient and a batch of another shape
  through a replay.
- ``kernels``: one Conv-4 layer's convolution, dense (as the floor runs it) against grouped
  (as the stacked step runs per-task weights), NCHW and channels-last.
- ``train``: ``metaddp train`` with and without ``--cuda-graphs``: the same losses.
- ``memory``: second order against K (1 to 100 on CUDA): default, ``memory="low"`` and
  first-order peak device memory (the whole and the step's own) and time (the median of 3
  steps up to K = 25, one step above).
- ``ranks``: two processes on this one device (gloo carrying device tensors: NCCL needs one
  GPU per rank), sample-parallel, against one process.
- ``profile``: where a stacked Conv-4 meta-step's device time goes, against hand-written vmap
  and the plain batched floor (torch.profiler: kernels by kind, the top 10, launches).
- ``cudnn`` (only when named): the stacked step with cuDNN's algorithms chosen by heuristics
  (PyTorch's default) and by trying them (``torch.backends.cudnn.benchmark``).
- ``stacked_conv``: the stacked step's forward convolutions each way ``MAML(conv=...)`` names
  (``auto``, measured per shape, the default; grouped; per task; transposed; channels-last),
  eager and graphed, float32 and TF32, with the ways ``auto`` chose.
- ``hvp``: the low mode's Hessian-vector product reverse over reverse against forward over
  reverse (``benchmarks/hvp_modes.py``): on the CPU reverse over reverse is faster.

    python benchmarks/device_check.py OUT [--device cuda|cpu] [--quick]

Writes ``OUT/device_check.json`` and ``OUT/device_check.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metaddp as md  # noqa: E402
from common import (  # noqa: E402
    CONV,
    IMPLEMENTATIONS,
    available,
    make_metaddp,
    max_rel_diff,
    median_ms,
    reference_grads,
    run_record,
    time_round_robin,
)
from metaddp import _host  # noqa: E402
from metaddp.distributed import Mesh  # noqa: E402
from metaddp.testing import scenarios as S  # noqa: E402


def peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_mib(device: str) -> float | None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    return None


def live_mib(device: str) -> float | None:
    """What the allocator holds for live tensors now (made before a step: weights, data, and
    whatever earlier sections left alive)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / 2**20
    return None


def on(problem: S.Problem, device: str) -> tuple:
    alg = problem.build_algorithm().to(device)
    tasks = [
        md.Task(*(md.Batch(b.x.to(device), b.y.to(device), b.n) for b in (t.support, t.query)))
        for t in problem.tasks()
    ]
    return alg, tasks


def grads_of(alg, tasks, loss_fn, wrap: bool) -> dict[str, torch.Tensor]:
    alg.zero_grad(set_to_none=True)
    if wrap:
        learner = md.MetaDDP(alg, Mesh.for_layout("sample"))
        learner.meta_loss(tasks, loss_fn).backward()
        learner.sync_grads()
        learner.release()
    else:
        alg.meta_loss(tasks, loss_fn).backward()
    return {k: v.detach().double().cpu() for k, v in S.meta_gradient(alg).items()}


EXACT = {
    "MAML MLP, K=3, stacked": (S.Problem("mlp", steps=3), True, False),
    "MAML MLP, K=3, loop": (S.Problem("mlp", steps=3), False, False),
    "MAML conv + BatchNorm (batch statistics), K=2, stacked, MetaDDP": (
        S.Problem("conv", batchnorm=True, running_stats=False, steps=2, inner_lr=0.3),
        True,
        True,
    ),
    "MAML conv + BatchNorm (running statistics), K=2, loop, MetaDDP": (
        S.Problem("conv", batchnorm=True, steps=2, inner_lr=0.3),
        False,
        True,
    ),
    "Meta-SGD MLP, K=2": (S.Problem("mlp", steps=2, algorithm="metasgd"), None, False),
    "MAML MLP, K=3, memory='low'": (S.Problem("mlp", steps=3, memory="low"), False, False),
}


def section_exact(device: str, quick: bool) -> list[dict]:
    rows = []
    for name, (p, batched, wrap) in EXACT.items():
        want_alg, want_tasks = on(p, "cpu")
        want = grads_of(want_alg, want_tasks, p.loss_fn, wrap)
        alg, tasks = on(p, device)
        if batched is not None and hasattr(alg, "batched"):
            alg.batched = batched
        got = grads_of(alg, tasks, p.loss_fn, wrap)
        rows.append({"problem": name, "vs_cpu_float64": max_rel_diff(got, want)})
    # An independent reference: the plain per-task autograd loop in float64 on the CPU.
    case = dataclasses.replace(CONV, n_tasks=4, hidden=8 if quick else 64)
    ref = reference_grads(case)
    dev = dataclasses.replace(case, device=device)
    for label, batched in (("stacked", True), ("loop", False)):
        net = dev.build(torch.float64)
        maml_step = (
            IMPLEMENTATIONS["metaddp batched=True"]
            if batched
            else IMPLEMENTATIONS["metaddp batched=False"]
        )
        step = maml_step(dev, net, dev.tasks(torch.float64))
        rows.append(
            {
                "problem": f"Conv-4 + BatchNorm, 4 tasks, K=1, {label}, float64",
                "vs_independent_loop": max_rel_diff(step(), ref),
            }
        )
    return rows


PEERS = [
    "metaddp",
    "torch.func grad+vmap (hand-written)",
    "per-task autograd loop",
    "higher",
    "TorchOpt MetaSGD",
    "floor: plain batched fwd+bwd (not a meta-step)",
]


def make_captured(case, net: torch.nn.Module, tasks, **settings) -> Callable[[], dict[str, torch.Tensor]]:
    """metaddp's automatic choice replayed from a CUDA graph (recorded here, before timing)."""
    maml = md.MAML(net, inner_lr=case.inner_lr, steps=case.steps, **settings)
    captured = md.distributed.CapturedStep(maml, case.loss_fn, warmup=1)

    def step() -> dict[str, torch.Tensor]:
        net.zero_grad(set_to_none=True)
        captured(tasks)
        return {n: p.grad.detach().clone() for n, p in net.named_parameters()}

    step()  # eager
    step()  # recorded and replayed: the calls that follow, error included, are replays
    step.maml = maml
    return step


def section_peers(device: str, quick: bool) -> list[dict]:
    impls, skipped = available(PEERS)
    impls = {**impls, "metaddp autocast=bfloat16":
             lambda c, n, t: make_metaddp(c, n, t, autocast=torch.bfloat16)}
    if device.startswith("cuda"):
        impls = {"metaddp CapturedStep (CUDA graph)": make_captured, **impls}
    rows = []
    n_tasks, repeats = (4, 2) if quick else (32, 6)
    for k in (1,) if quick else (1, 5):
        case = dataclasses.replace(CONV, n_tasks=n_tasks, steps=k, device=device,
                                   hidden=8 if quick else 64)
        ref = reference_grads(dataclasses.replace(case, device=device))
        steps, errors, peaks = {}, {}, {}
        for name, make in impls.items():
            net = case.build()
            steps[name] = make(case, net, case.tasks())
            peak_reset(device)
            errors[name] = max_rel_diff(steps[name](), ref)
            peaks[name] = peak_mib(device)
        times = time_round_robin(steps, repeats)
        base = median_ms(times["metaddp"])
        for name, ts in times.items():
            rows.append({"K": k, "tasks": n_tasks, "implementation": name,
                         "median_ms": median_ms(ts), "vs_metaddp": median_ms(ts) / base,
                         "max_rel_diff": errors[name], "peak_mib": peaks[name]})
    rows += [{"implementation": name, "skipped": why} for name, why in skipped.items()]
    return rows


def section_syncs(device: str, quick: bool) -> list[dict]:
    rows = []
    for label, p, batched in (
        ("conv + BatchNorm, stacked", S.Problem("conv", batchnorm=True, running_stats=False,
                                                steps=2, dtype=torch.float32), True),
        ("conv + BatchNorm (running stats), loop", S.Problem("conv", batchnorm=True, steps=2,
                                                             dtype=torch.float32), False),
        ("MLP, stacked, K=3", S.Problem("mlp", steps=3, dtype=torch.float32), True),
    ):
        alg, tasks = on(p, device)
        alg.batched = batched
        learner = md.MetaDDP(alg, Mesh.for_layout("sample"))
        batch = md.MetaBatch(tasks, len(tasks), range(len(tasks)))
        for _ in range(2):  # warm-up
            alg.zero_grad(set_to_none=True)
            learner.meta_loss(batch, p.loss_fn).backward()
            learner.sync_grads()
        alg.zero_grad(set_to_none=True)
        row = {"case": label}
        if device.startswith("cuda"):
            # Every host synchronisation in the step raises; sync_grads' one read is outside.
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss = learner.meta_loss(batch, p.loss_fn)
                loss.backward()
                row["syncs_before_sync_grads"] = "none"
            except RuntimeError as e:
                row["syncs_before_sync_grads"] = str(e).splitlines()[0][:200]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            learner.sync_grads()
        else:
            with _host.as_on_a_device(), _host.counting() as reads:
                learner.meta_loss(batch, p.loss_fn).backward()
                learner.sync_grads()
            row["host_reads_per_step"] = reads.reads
        learner.release()
        rows.append(row)
    return rows


def _graph_cases(device: str) -> list[tuple]:
    """(label, learner factory, two meta-batches, loss) for the CUDA-graph section."""
    cases = []
    for k in (1, 5):
        case = dataclasses.replace(CONV, n_tasks=32, steps=k, device=device)
        other = dataclasses.replace(case, seed=1)

        def make(case=case, wrap=True):
            net = case.build()
            alg = md.MAML(net, inner_lr=case.inner_lr, steps=case.steps, batched=True)
            return md.MetaDDP(alg, Mesh.for_layout("sample")) if wrap else alg

        for wrap in (True, False):
            label = f"Conv-4 + BatchNorm, 32 tasks, K={k}, stacked" + (", MetaDDP" if wrap else "")
            cases.append((label, lambda c=case, w=wrap: make(c, w),
                          case.tasks(), other.tasks(), case.loss_fn))
    small = S.Problem("conv", batchnorm=True, steps=2, inner_lr=0.3, dtype=torch.float32)
    cases.append(("small conv + BatchNorm (running statistics), K=2, loop, MetaDDP",
                  lambda: md.MetaDDP(small.build_algorithm().to(device), Mesh.for_layout("sample")),
                  [_to(t, device) for t in small.tasks()],
                  [_to(t, device) for t in dataclasses.replace(small, seed=1).tasks()],
                  small.loss_fn))
    return cases


def section_graphs(device: str, quick: bool) -> list[dict]:
    """metaddp.distributed.CapturedStep: 6 SGD steps on alternating meta-batches, graphed against eager
    from the same weights (parameters, BatchNorm buffers compared), then each meta-step's
    time; a non-finite inner gradient and a batch of another shape through the replay."""
    if not device.startswith("cuda"):
        return [{"skipped": "CUDA graphs need a CUDA device"}]
    rows = []
    for label, make, tasks_a, tasks_b, loss_fn in _graph_cases(device):
        row: dict = {"case": label}
        try:
            learners = {"eager": make(), "graph": make()}
            again = make()  # a second eager learner: is eager itself the same bits twice?
            wrapped = hasattr(learners["eager"], "mesh")

            def batch(tasks):
                return md.MetaBatch(tasks, len(tasks), range(len(tasks))) if wrapped else tasks

            a, b = batch(tasks_a), batch(tasks_b)
            captured = md.distributed.CapturedStep(learners["graph"], loss_fn)

            def run(name, tasks):
                learner = learners[name]
                learner.zero_grad(set_to_none=True)
                if name == "eager":
                    learner.meta_loss(tasks, loss_fn).backward()
                else:
                    captured(tasks)
                if wrapped:
                    learner.sync_grads()

            # One meta-step from the same weights: the graph's first call records and replays.
            # Eager against eager tells whether any difference is the graph's or the kernels'
            # own (cuDNN may pick run-to-run nondeterministic algorithms unless told not to).
            def grads_after_one(name, learner):
                if name == "again":
                    learner.zero_grad(set_to_none=True)
                    learner.meta_loss(a, loss_fn).backward()
                    if wrapped:
                        learner.sync_grads()
                else:
                    run(name, a)
                return {n: p.grad.detach().clone() for n, p in learner.named_parameters()
                        if p.grad is not None}

            one = {n: grads_after_one(n, m) for n, m in [*learners.items(), ("again", again)]}
            for name in ("graph", "again"):
                row[f"one_step_{name}_vs_eager"] = max_rel_diff(one[name], one["eager"])
                row[f"one_step_{name}_equal"] = all(
                    torch.equal(one[name][k], one["eager"][k]) for k in one["eager"])
            del again
            opts = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in learners.items()}
            for i in range(6):
                for name in learners:
                    run(name, a if i % 2 == 0 else b)
                    opts[name].step()
            state = {n: dict(m.state_dict()) for n, m in learners.items()}
            row["graph_vs_eager_after_6_steps"] = max_rel_diff(
                {k: v.double() for k, v in state["graph"].items() if v.is_floating_point()},
                {k: v.double() for k, v in state["eager"].items() if v.is_floating_point()})
            row["recorded"] = captured.recorded
            times = time_round_robin({n: (lambda n=n: run(n, a)) for n in learners}, 10)
            row["eager_ms"] = median_ms(times["eager"])
            row["graph_ms"] = median_ms(times["graph"])
            row["speedup"] = row["eager_ms"] / row["graph_ms"]
            nan = [md.Task(md.Batch(t.support.x * float("nan"), t.support.y, t.support.n),
                           t.query) for t in tasks_a]
            try:
                run("graph", batch(nan))
                row["non_finite_inner_gradient"] = "no error"
            except FloatingPointError as e:
                row["non_finite_inner_gradient"] = str(e)[:120]
            try:
                run("graph", batch(tasks_a[:-1]))
                row["other_shape"] = "no error"
            except ValueError as e:
                row["other_shape"] = str(e)[:120]
        except Exception as e:
            _host.discard()
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        rows.append(row)
    return rows


def section_kernels(device: str, quick: bool) -> list[dict]:
    """What a stacked step's convolutions cost against the floor's: Conv-4's second layer
    (64 -> 64 channels, 3x3) over 32 tasks x 80 images at 14x14, forward and backward, as
    the floor runs it (one dense convolution, shared weights) and as the stacked step does
    (per-task weights: one grouped convolution of 32 groups), in NCHW and channels-last."""
    tasks, images, ch, size = (4, 10, 8, 14) if quick else (32, 80, 64, 14)
    dense_x = torch.randn(tasks * images, ch, size, size, device=device, requires_grad=True)
    dense_w = torch.randn(ch, ch, 3, 3, device=device, requires_grad=True)
    group_x = torch.randn(images, tasks * ch, size, size, device=device, requires_grad=True)
    group_w = torch.randn(tasks * ch, ch, 3, 3, device=device, requires_grad=True)
    rows = []
    for layout in ("NCHW", "channels_last"):
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format

        def run(x, w, groups, fmt=fmt):
            x = x.detach().to(memory_format=fmt).requires_grad_()
            w = w.detach().to(memory_format=fmt).requires_grad_()

            def step() -> dict[str, torch.Tensor]:
                y = torch.nn.functional.conv2d(x, w, padding=1, groups=groups)
                gx, gw = torch.autograd.grad(y.square().sum(), (x, w))
                return {"gx": gx, "gw": gw}

            return step

        steps = {"dense (floor)": run(dense_x, dense_w, 1),
                 "grouped (stacked)": run(group_x, group_w, tasks)}
        times = time_round_robin(steps, 3 if quick else 20)
        rows += [{"layout": layout, "convolution": name, "median_ms": median_ms(ts)}
                 for name, ts in times.items()]
    return rows


def section_train(device: str, quick: bool) -> list[dict]:
    """``metaddp train`` on the device, with and without ``--cuda-graphs``: the same losses
    (metrics.csv), and each run's wall time."""
    if not device.startswith("cuda"):
        return [{"skipped": "--cuda-graphs needs a CUDA device"}]
    import csv
    import subprocess
    import tempfile

    rows, losses = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for graphs in (False, True):
            out = Path(tmp) / f"run-{graphs}"
            cmd = [sys.executable, "-m", "metaddp", "train", "sinusoid", "--steps", "40",
                   "--eval-every", "0", "--eval-tasks", "20", "--no-progress", "--out", str(out),
                   *(["--cuda-graphs"] if graphs else [])]
            t0 = time.perf_counter()
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            row = {"cuda_graphs": graphs, "rc": run.returncode,
                   "seconds": time.perf_counter() - t0}
            if run.returncode:
                row["stderr"] = run.stderr[-400:]
            else:
                with open(out / "metrics.csv", newline="") as f:
                    losses[graphs] = [r["meta_loss"] for r in csv.DictReader(f)]
            rows.append(row)
    if len(losses) == 2:
        rows.append({"meta_losses_equal": losses[False] == losses[True],
                     "steps": len(losses[True])})
    return rows


def section_memory(device: str, quick: bool) -> list[dict]:
    rows = []
    # What earlier sections left (cycles not yet collected, cached blocks) is not this one's.
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    ks = (1, 5) if quick else (1, 5, 10, 25, 50, 100)
    repeats = 1 if quick else 3
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    case = dataclasses.replace(CONV, n_tasks=2 if quick else 8, device=device,
                               hidden=8 if quick else 64)
    tasks = case.tasks()
    for k in ks:
        row: dict = {"K": k}
        for mode in ("default", "low", "first-order"):
            net = case.build()
            weights = sum(p.numel() * p.element_size() for p in net.parameters())
            alg = md.MAML(net, inner_lr=case.inner_lr, steps=k, batched=False,
                          first_order=mode == "first-order",
                          memory="low" if mode == "low" else "default")
            try:
                net.zero_grad(set_to_none=True)
                alg.meta_loss(tasks, case.loss_fn).backward()  # warm-up
                seconds, peak, before = [], None, None
                for _ in range(repeats if k <= 25 else 1):  # medians where steps are short
                    net.zero_grad(set_to_none=True)
                    sync()
                    if peak is None:
                        peak_reset(device)
                        before = live_mib(device)
                    t0 = time.perf_counter()
                    alg.meta_loss(tasks, case.loss_fn).backward()
                    sync()  # a step is done when its kernels are, not when they are queued
                    seconds.append(time.perf_counter() - t0)
                    if peak is None:
                        peak = peak_mib(device) or 0.0
                # The step's own peak is the peak less what was live before it; the low
                # mode's part of it that grows with K is its kept weights: the K - 1 a task
                # keeps while its gradient is computed (in meta_loss, one task at a time),
                # and one gradient per task until the backward.
                cuda = device.startswith("cuda")
                row[mode] = {"seconds": statistics.median(seconds), "seconds_all": seconds,
                             "peak_mib": peak if cuda else None, "live_before_mib": before,
                             "step_peak_mib": peak - before if cuda else None,
                             "kept_weights_mib": (k - 1 + len(tasks)) * weights / 2**20
                             if mode == "low" else 0.0}
            except torch.OutOfMemoryError:
                row[mode] = {"error": "out of memory"}
            del alg, net
        rows.append(row)
    return rows


def _ranks_worker(device: str) -> dict[str, torch.Tensor]:
    p = S.Problem("conv", batchnorm=True, running_stats=False, steps=2, inner_lr=0.3)
    alg = p.build_algorithm().to(device)
    learner = md.MetaDDP(alg, Mesh.for_layout("sample"))
    tasks = learner.shard(p.n_tasks, lambda i: _to(p.task(i), device))
    learner.meta_loss(tasks, p.loss_fn).backward()
    learner.sync_grads()
    return {k: v.detach().cpu() for k, v in S.meta_gradient(alg).items()}


def _to(task: md.Task, device: str) -> md.Task:
    return md.Task(*(md.Batch(b.x.to(device), b.y.to(device), b.n)
                     for b in (task.support, task.query)))


def section_ranks(device: str, quick: bool) -> list[dict]:
    from metaddp.distributed.launch import run_local

    one = run_local(_ranks_worker, 1, device)[0]
    two = run_local(_ranks_worker, 2, device)
    return [{"case": "conv + BatchNorm, K=2, 2 processes (gloo) vs 1, float64",
             "device": device,
             "max_rel_diff": max(max_rel_diff(r, one) for r in two)}]


def _deterministic_worker(device: str, layout: str = "sample") -> dict[str, torch.Tensor]:
    p = S.Problem("conv", batchnorm=True, running_stats=False, steps=2, inner_lr=0.3,
                  dtype=torch.float32, deterministic=True)
    alg = p.build_algorithm().to(device)
    learner = md.MetaDDP(alg, Mesh.for_layout(layout), deterministic=True)
    tasks = learner.shard(p.n_tasks, lambda i: _to(p.task(i), device))
    learner.meta_loss(tasks, p.loss_fn).backward()
    learner.sync_grads()
    return {k: v.detach().cpu() for k, v in S.meta_gradient(alg).items()}


def section_deterministic(device: str, quick: bool) -> list[dict]:
    """Deterministic mode on the device: the same bits run to run, and at 2 to 4 processes
    (gloo, sharing the device) in the sample, task and hybrid layouts as at 1; each run in
    fresh processes, one thread each."""
    from metaddp.distributed.launch import run_local

    one = run_local(_deterministic_worker, 1, device, threads=1)[0]
    again = run_local(_deterministic_worker, 1, device, threads=1)[0]

    def equal(a: dict, b: dict) -> bool:
        return all(torch.equal(a[k], b[k]) for k in a)

    case = "conv + BatchNorm, K=2, float32, deterministic=True"
    rows = [{"case": case, "device": device, "processes": 1, "run_to_run_equal": equal(again, one)}]
    worlds = [(2, "sample")] if quick else [(2, "sample"), (3, "sample"), (4, "sample"),
                                            (2, "task"), (4, "hybrid")]
    for n, layout in worlds:
        got = run_local(_deterministic_worker, n, device, layout, threads=1)
        rows.append({"case": case, "device": device, "processes": n, "layout": layout,
                     "equal_to_one_process": all(equal(r, one) for r in got),
                     "max_rel_diff": max(max_rel_diff(r, one) for r in got)})
    return rows


def section_hvp(device: str, quick: bool) -> list[dict]:
    """``benchmarks/hvp_modes.py`` on the device: the sinusoid MLP's 25 stacked tasks and one
    Conv-4 task, each way's time and ``H v`` error against float64."""
    import hvp_modes

    rounds = 2 if quick else 20
    return [row for name in ("mlp", "conv") for row in hvp_modes.measure(name, device, rounds)]


_KINDS = (  # (kind, substrings of a kernel's or operator's lower-cased name), first match
    # cuDNN names its BatchNorm kernels bn_fw_* / bn_bw_*: before convolutions, whose cuDNN
    # kernels are named by algorithm (direct, dgrad/wgrad engines, implicit GEMM, FFT).
    ("batch norm", ("batch_norm", "batchnorm", "bn_fw", "bn_bw")),
    ("convolution", ("conv", "implicit_gemm", "xmma_fprop", "xmma_dgrad", "xmma_wgrad",
                     "dgrad", "wgrad", "winograd", "fft2d")),
    ("matrix product", ("gemm", "bmm", "matmul", "mm_", "cutlass")),
    ("pooling", ("pool",)),
    ("copy", ("copy", "memcpy", "memset", "cat", "fill", "transpose")),
    ("reduction", ("reduce", "sum", "mean", "norm")),
)


def _kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in _KINDS if any(key in low for key in keys)), "elementwise, other")


# The stacked step, the peer that batches tasks the same way, and the plain batched floor.
_STACKED_AND_FLOOR = ("metaddp", "torch.func grad+vmap (hand-written)",
                      "floor: plain batched fwd+bwd (not a meta-step)")


def _kernels(prof) -> dict[str, list[float]]:
    """CUDA kernels of a ``torch.profiler`` run: name -> [launches, microseconds]."""
    out: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = out.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.elapsed_us()
    return out


def section_profile(device: str, quick: bool) -> list[dict]:
    """Where one second-order Conv-4 meta-step's device time goes (torch.profiler): metaddp
    stacked, hand-written vmap and the plain batched floor, K = 1, 32 tasks. On CUDA the
    kernels (count and time per step, by kind, and the top 10); on the CPU the operators."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    rows = []
    n_tasks, reps = (4, 2) if quick else (32, 3)
    case = dataclasses.replace(CONV, n_tasks=n_tasks, steps=1, device=device,
                               hidden=8 if quick else 64)
    for name in _STACKED_AND_FLOOR:
        step = IMPLEMENTATIONS[name](case, case.build(), case.tasks())
        for _ in range(2):
            step()
        with profile(activities=[activity]) as prof:
            for _ in range(reps):
                step()
            if cuda:
                torch.cuda.synchronize()
        if cuda:
            by_name = _kernels(prof)
        else:
            by_name = {e.key: [e.count, e.self_cpu_time_total] for e in prof.key_averages()
                       if e.key.startswith("aten::")}
        kinds: dict[str, float] = {}
        for key, (_, us) in by_name.items():
            kinds[_kind(key)] = kinds.get(_kind(key), 0.0) + us / reps / 1e3
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:10]
        rows.append({
            "implementation": name, "K": 1, "tasks": n_tasks,
            "what": "CUDA kernels" if cuda else "CPU operators (self time)",
            "ms_per_step": sum(us for _, us in by_name.values()) / reps / 1e3,
            "launches_per_step": sum(n for n, _ in by_name.values()) / reps if cuda else None,
            "ms_by_kind": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [{"name": k[:90], "per_step": n / reps if cuda else None,
                     "ms_per_step": round(us / reps / 1e3, 3)} for k, (n, us) in top],
        })
    return rows


def section_cudnn(device: str, quick: bool) -> list[dict]:
    """cuDNN's algorithm choice for the stacked step's grouped convolutions: the stacked
    Conv-4 meta-step (K = 1, 32 tasks), hand-written vmap and the floor, timed with
    ``torch.backends.cudnn.benchmark`` off (PyTorch's default: heuristics) and on (each
    shape's algorithms tried once, the fastest kept); each one's error against float64."""
    if not device.startswith("cuda"):
        return [{"skipped": "cuDNN runs on CUDA devices only"}]
    from torch.profiler import ProfilerActivity, profile

    names = _STACKED_AND_FLOOR
    rows = []
    was = torch.backends.cudnn.benchmark
    try:
        for k in (1, 5):
            case = dataclasses.replace(CONV, n_tasks=32, steps=k, device=device)
            ref = reference_grads(case)
            for bench in (False, True):
                torch.backends.cudnn.benchmark = bench
                steps = {n: IMPLEMENTATIONS[n](case, case.build(), case.tasks()) for n in names}
                errors = {n: max_rel_diff(step(), ref) for n, step in steps.items()}
                times = time_round_robin(steps, 6, warmup=2)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    steps["metaddp"]()
                    torch.cuda.synchronize()
                top = sorted(_kernels(prof).items(), key=lambda kv: -kv[1][1])[:3]
                for n in names:
                    rows.append({"K": k, "cudnn_benchmark": bench, "implementation": n,
                                 "median_ms": median_ms(times[n]), "max_rel_diff": errors[n]})
                rows.append({"K": k, "cudnn_benchmark": bench,
                             "metaddp_top_kernels": [{"name": n[:90], "ms": round(us / 1e3, 3)}
                                                     for n, (_, us) in top]})
    finally:
        torch.backends.cudnn.benchmark = was
    return rows


def section_stacked_conv(device: str, quick: bool) -> list[dict]:
    """The stacked step's forward convolutions each way ``MAML(conv=...)`` names: measured
    per shape (``auto``, the default), one grouped convolution, one per task, one transposed
    convolution, channels-last. Second-order MAML, Conv-4 with BatchNorm, 32 tasks, K = 1
    and 5, eager and replayed from a CUDA graph, in full float32 and with TF32; each one's
    time and error against float64, and what ``auto`` chose per layer."""
    from metaddp.algorithms._conv_ways import WAYS

    cuda = device.startswith("cuda")
    n_tasks, reps, ks = (4, 2, (1,)) if quick else (32, 6, (1, 5))
    cases = {k: dataclasses.replace(CONV, n_tasks=n_tasks, steps=k, device=device,
                                    hidden=8 if quick else 64) for k in ks}
    refs = {k: reference_grads(c) for k, c in cases.items()}
    was = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    rows = []
    try:
        for tf32 in (False, True) if cuda else (False,):
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
            for k, case in cases.items():
                steps, errors, chosen = {}, {}, {}
                for way in ("auto", *WAYS):
                    makers = {"eager": make_metaddp}
                    if cuda:
                        makers["CUDA graph"] = make_captured
                    for how, make in makers.items():
                        name = f"{how}, {way}"
                        try:  # one way failing leaves the others' rows
                            net = case.build()
                            step = make(case, net, case.tasks(), batched=True, conv=way)
                            errors[name] = max_rel_diff(step(), refs[k])
                            steps[name] = step
                            chosen[name] = sorted(set(step.maml.conv.chosen.values()))
                        except Exception as e:
                            _host.discard()
                            rows.append({"K": k, "tasks": n_tasks, "tf32": tf32, "way": name,
                                         "error": f"{type(e).__name__}: {e}"[:300]})
                floor = IMPLEMENTATIONS["floor: plain batched fwd+bwd (not a meta-step)"]
                steps["floor"] = floor(case, case.build(), case.tasks())
                times = time_round_robin(steps, reps, warmup=2)
                for name, ts in times.items():
                    rows.append({"K": k, "tasks": n_tasks, "tf32": tf32, "way": name,
                                 "median_ms": median_ms(ts), "max_rel_diff": errors.get(name),
                                 "chosen": chosen.get(name)})
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = was
    return rows


SECTIONS = {
    "exact": section_exact,
    "syncs": section_syncs,
    "peers": section_peers,
    "graphs": section_graphs,
    "kernels": section_kernels,
    "train": section_train,
    "memory": section_memory,
    "ranks": section_ranks,
    "deterministic": section_deterministic,
    "hvp": section_hvp,
    "profile": section_profile,
    "cudnn": section_cudnn,
    "stacked_conv": section_stacked_conv,
}


# Sections whose question is answered, run only when named: ``cudnn`` (cuDNN's benchmark
# mode did not change the slow grouped kernel on an H200, BENCHMARKS.md).
ON_REQUEST = ("cudnn",)


def markdown(out: dict) -> str:
    lines = [f"# Device check, {out['date']}", "",
             f"{out['machine']}; device {out['device']}; TF32 {out.get('tf32')}", ""]
    for name, sec in out["sections"].items():
        lines += [f"## {name} ({sec.get('seconds', 0):.0f} s)", ""]
        if "error" in sec:
            lines += ["```", sec["error"], "```", ""]
            continue
        for row in sec["rows"]:
            lines.append("- " + json.dumps(row))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (CI keeps it alive)")
    ap.add_argument("--sections", default=",".join(s for s in SECTIONS if s not in ON_REQUEST),
                    help=f"comma-separated, from {', '.join(SECTIONS)} (default: all but "
                         f"{', '.join(ON_REQUEST)})")
    tf32 = ap.add_mutually_exclusive_group()
    tf32.add_argument("--tf32", dest="no_tf32", action="store_false",
                      help="leave PyTorch's TF32 defaults: cuDNN convolutions may then run in "
                           "TF32, and every float32 error column measures TF32, not the code")
    tf32.add_argument("--no-tf32", dest="no_tf32", action="store_true", default=True,
                      help="float32 convolutions and matrix products in full float32 on CUDA "
                           "(the default here)")
    ap.add_argument("--cudnn-deterministic", action="store_true",
                    help="torch.backends.cudnn.deterministic = True: only cuDNN algorithms "
                         "that give the same bits run to run")
    args = ap.parse_args(argv)
    if args.cudnn_deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        torch.set_num_threads(1)
    out = run_record(device=args.device, sections={},
                     tf32={"cudnn": torch.backends.cudnn.allow_tf32,
                           "matmul": torch.backends.cuda.matmul.allow_tf32},
                     cudnn_deterministic=torch.backends.cudnn.deterministic)
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    failed = 0
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            rows = SECTIONS[name](args.device, args.quick)
            out["sections"][name] = {"rows": rows}
        except Exception:
            failed += 1
            out["sections"][name] = {"error": traceback.format_exc()[-2000:]}
        out["sections"][name]["seconds"] = time.perf_counter() - t0
        print(f"{name}: {out['sections'][name]['seconds']:.1f} s", flush=True)
        (args.out / "device_check.json").write_text(json.dumps(out, indent=1, default=str))
    (args.out / "device_check.md").write_text(markdown(out))
    print(markdown(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
