"""Sharded meta-parameters (``MetaDDP(..., shard=True)``) against replicated ones, measured
side by side at 1 to 4 processes (gloo, CPU, sample layout), then an alpha-beta cost model
of one meta-step on H200 nodes built from those measurements.

The problem: second-order MAML, K = 2 inner SGD steps, Adam as the outer optimizer, on an MLP
whose weights dominate (64 -> 512 -> 512 -> 512 -> 16, tanh: 566,800 float32 parameters,
2.16 MiB; ``--hidden`` and ``--depth`` change it) and a small meta-batch (4 tasks of 12
support and 12 query samples; every rank takes 12/N of each task's samples). In each process
these variants are built from the same weights, warmed up with one step each, measured for
one step each, then timed in turn:

- ``replicated``: ``shard=False``, tasks stacked (the automatic choice for an MLP on CPU);
- ``replicated-loop``: ``shard=False``, tasks one by one (``batched=False``), as the sharded
  layout runs them for this model (``batched=None``: its 1 MiB layers are kept as rows in
  graphs, which stacked graphs keep whole): the like-for-like reference;
- ``sharded``: ``shard=True``;
- both layouts with ``memory="low"``, and with 2 tasks (what grows with the tasks).

Per rank (the largest rank's figure where ranks differ):

- held: bytes of the tensors a rank holds after a step (parameters, their gradients, the
  outer optimizer's state: the sum of their ``nbytes``);
- peak: the most bytes of tensor storage live during ``meta_loss`` + ``backward`` +
  ``sync_grads``: what was held when the step began (parameters and Adam state; gradients
  are None) plus the peak of the storages allocated inside the step (:class:`Probe`, checked
  on a toy case first), with Python's cyclic garbage collector run by the probe every 64
  operations. "Collector off": the same step without it, so storages that only reference
  cycles hold stay until the step ends; "held by reference cycles" is what ``gc.collect()``
  frees right after that step;
- communication: bytes per meta-step by kind, from ``metaddp.distributed.counting()`` (all_reduce: the
  buffer reduced; all_gather: the gathered output; reduce_scatter: the input before the
  scatter), and collective calls by kind, as the process group ran them;
- time: median seconds of ``meta_loss`` + ``backward`` + ``sync_grads`` + the Adam step over
  ``--repeats`` rounds (slowest rank), the variants alternated round by round. With 3 and 4
  processes on 2 cores the ranks wait for each other's cores: these times are not a scaling
  result.

Then :func:`predict`: a cost model of the same meta-step on 8 to 512 H200s, from these
measurements and stated hardware figures (:class:`Hardware`, :class:`Workload`). It is a
prediction, not a measurement.

    .venv/bin/python benchmarks/sharded.py --json benchmarks/results/sharded.json

``--from-json FILE`` prints the tables and the model again from a saved run.
``--stacked`` times instead the sharded step with the tasks stacked (``batched=True``)
against one by one (``batched=False``), side by side, with their collective calls.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from torch.utils.flop_counter import flop_registry  # noqa: E402

import metaddp  # noqa: E402
from common import run_record, save_json  # noqa: E402
from metaddp.distributed.launch import run_local  # noqa: E402

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
COLLECTIVES = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather",
               "allgather_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
               "reduce_scatter_": "reduce_scatter"}
BUCKET_BYTES = 25 * 2**20  # MetaDDP's default all-reduce bucket
COLLECT_EVERY = 64  # operations between the probe's runs of Python's cyclic collector

# --- what a step does, operation by operation -------------------------------------------------


class Probe(TorchDispatchMode):
    """What a block does, operation by operation (a ``TorchDispatchMode``: the autograd
    engine's backward operations and the process group's collectives pass through it too).

    - ``peak``: the most bytes of tensor storage allocated inside the block and alive at
      once. An operation's output whose storage is fresh (not one of its inputs': views,
      in-place and ``out=`` operations share their input's) is recorded by storage pointer
      with the storage's size; a ``weakref.finalize`` on the storage subtracts it when the
      storage is freed. Storages made before the block are not counted: add them apart.
    - ``flops``: matrix-multiply FLOPs (``torch.utils.flop_counter``'s formulas);
    - ``traffic``: bytes read and written by every other operation that makes a fresh
      output (its inputs' ``nbytes`` plus its outputs'): the elementwise work's memory traffic;
    - ``ops``: operations run (collectives apart);
    - ``calls`` and ``sent``: collectives by kind and the bytes of their buffers, as
      ``metaddp.distributed.counting()`` counts them (a gather's output, a reduce-scatter's input).
    """

    def __init__(self, collect_every: int | None = None) -> None:
        super().__init__()
        self.collect_every = collect_every
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self.flops = self.traffic = self.ops = 0
        self.calls: dict[str, int] = {}
        self.sent: dict[str, int] = {}

    def _free(self, key: int) -> None:
        n = self.live.pop(key, None)
        if n is not None:
            self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if func.namespace == "c10d":
            kind = COLLECTIVES.get(packet.__name__, packet.__name__)
            self.calls[kind] = self.calls.get(kind, 0) + 1
            tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
            buffer = tensors[-1] if kind == "reduce_scatter" else tensors[0]
            self.sent[kind] = self.sent.get(kind, 0) + buffer.nbytes
            return out
        self.ops += 1
        if self.collect_every and self.ops % self.collect_every == 0:
            gc.collect()  # garbage that only reference cycles hold, freed now
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in ins}
        fresh = 0
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
            if n == 0 or key in inputs or key in self.live:
                continue
            fresh += t.nbytes
            self.live[key] = n
            self.now += n
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, key)
        if packet in flop_registry:
            self.flops += flop_registry[packet](*args, **kwargs, out_val=out)
        elif fresh:
            self.traffic += fresh + sum(t.nbytes for t in ins)
        return out


def check_probe() -> None:
    """The counter on a case whose answer is known, before it is trusted."""
    with Probe() as m:
        a = torch.ones(1000)  # 4,000 bytes
        b = a * 2  # 4,000 more
        v = b[:10]  # a view: nothing new
        del b  # its storage lives on in v
        assert m.now == 8000, m.now
        del v
        assert m.now == 4000, m.now
        c = torch.empty(3000)
        del c  # the peak so far: 4,000 + 12,000
        assert m.peak == 16_000, m.peak
        a.add_(1)  # in place: nothing new
        x = torch.randn(100, 100, requires_grad=True)  # 40,000
        y = (x.sin() * 3).sum()  # sin's output freed after the product; y: 4 bytes
        assert m.now == 44_004, m.now
        y.backward()  # x.grad: 40,000 kept
        assert m.now == 84_004, m.now
        w = torch.ones(8, 16)
        z = x[:8] @ torch.ones(100, 16)  # 2 * 8 * 100 * 16 FLOPs
        del y, x, a, w, z
    assert m.now == 0, m.now
    assert m.flops == 2 * 8 * 100 * 16, m.flops


# --- the problem and its measurement --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    hidden: int = 512
    depth: int = 3  # hidden layers
    features: int = 64
    outputs: int = 16
    steps: int = 2
    n_tasks: int = 4
    fewer_tasks: int = 2  # a second meta-batch size, for what grows with the tasks
    support: int = 12
    query: int = 12
    inner_lr: float = 0.05
    repeats: int = 5
    seed: int = 0

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        h = self.hidden
        layers: list[nn.Module] = [nn.Linear(self.features, h), nn.Tanh()]
        for _ in range(self.depth - 1):
            layers += [nn.Linear(h, h), nn.Tanh()]
        return nn.Sequential(*layers, nn.Linear(h, self.outputs))

    def largest_layer(self) -> float:
        """The largest layer's share of the parameters (a layer: what a sharded forward
        gathers at a time)."""
        net = self.model()
        sizes = [sum(p.numel() for p in m.parameters(recurse=False)) for m in net.modules()]
        return max(sizes) / sum(p.numel() for p in net.parameters())

    def tasks(self, n: int) -> list[metaddp.Task]:
        out = []
        for i in range(n):
            g = metaddp.generator_for(self.seed, i)
            w = torch.randn(self.features, self.outputs, generator=g) / self.features**0.5
            x = torch.randn(self.support + self.query, self.features, generator=g)
            y = torch.tanh(x @ w)
            s = self.support
            out.append(metaddp.Task(metaddp.Batch(x[:s], y[:s], s),
                                    metaddp.Batch(x[s:], y[s:], self.query)))
        return out

    def variants(self) -> list[tuple[str, str, int]]:
        """(layout, memory, tasks): the timed three first."""
        t, fewer = self.n_tasks, self.fewer_tasks
        return [("replicated", "default", t), ("replicated-loop", "default", t),
                ("sharded", "default", t), ("replicated", "low", t), ("sharded", "low", t),
                ("replicated", "default", fewer), ("sharded", "default", fewer)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y, reduction="none").mean(1)


def name(key: tuple[str, str, int]) -> str:
    return "/".join(map(str, key))


def meta_step(made: dict, key, mode=None) -> None:  # type: ignore[no-untyped-def]
    """One timed unit: ``made[key]``'s meta-loss, backward, gradient sum and Adam step,
    inside ``mode`` (a :class:`Probe`) if given."""
    learner, opt, tasks = made[key]
    opt.zero_grad(set_to_none=True)
    with mode or contextlib.nullcontext():
        learner.meta_loss(tasks, loss_fn).backward()
        learner.sync_grads()
    opt.step()


def worker(cfg: Config) -> dict:
    """On each rank: every variant's learner, one warm-up step each, one step each under
    :class:`Probe` and ``metaddp.distributed.counting()``, then the timed rounds."""
    mesh = metaddp.Mesh.create(tasks=1)  # sample layout: every rank takes 1/N of each task
    made = {}
    for key in cfg.variants():
        layout, memory, n_tasks = key
        net = cfg.model()
        alg = metaddp.MAML(net, inner_lr=cfg.inner_lr, steps=cfg.steps, memory=memory,
                           batched=False if layout == "replicated-loop" else None)
        learner = metaddp.MetaDDP(alg, mesh, shard=layout == "sharded")
        opt = torch.optim.Adam(learner.parameters(), lr=1e-4)
        made[key] = (learner, opt, learner.shard(cfg.tasks(n_tasks)))

    step = functools.partial(meta_step, made)

    def held(key) -> dict:  # type: ignore[no-untyped-def]
        learner, opt, _ = made[key]
        params = list(learner.parameters())
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return dict(params=sum(p.nbytes for p in params),
                    grads=sum(p.grad.nbytes for p in params if p.grad is not None),
                    optimizer=sum(v.nbytes for v in state))

    for key in made:
        step(key)  # warm-up; the optimizer's state exists from here
    def probed(key, collect_every: int | None) -> tuple[Probe, metaddp.distributed.CollectiveStats, int]:  # type: ignore[no-untyped-def]
        """One step under a :class:`Probe`, Python's collector run by it every
        ``collect_every`` operations or not at all; and what ``gc.collect()`` frees after."""
        gc.collect()  # earlier steps' cyclic garbage freed now, not inside the count
        gc.freeze()  # older objects out of the collections (cheap ones)
        gc.disable()
        probe = Probe(collect_every)
        try:
            with metaddp.distributed.counting() as stats:
                step(key, probe)
        finally:
            gc.enable()
            gc.unfreeze()
        left = probe.now
        gc.collect()
        return probe, stats, left - probe.now

    out = {}
    for key in made:
        before = held(key)
        at_start = before["params"] + before["optimizer"]  # gradients are None then
        probe, stats, _ = probed(key, COLLECT_EVERY)
        row = out[name(key)] = dict(
            held=held(key), peak=at_start + probe.peak, step_peak=probe.peak,
            bytes={k: stats.by_kind.get(k, 0) for k in KINDS}, calls=stats.calls,
            calls_by_kind={k: probe.calls.get(k, 0) for k in KINDS},
            sent={k: probe.sent.get(k, 0) for k in KINDS},
            flops=probe.flops, traffic=probe.traffic, ops=probe.ops)
        if key[2] == cfg.n_tasks:
            probe, _, cycles = probed(key, None)
            row.update(peak_gc_off=at_start + probe.peak, cycles=cycles)
    timed = list(made)[:3]
    times: dict = {k: [] for k in timed}
    for _ in range(cfg.repeats):
        for key in timed:
            t0 = time.perf_counter()
            step(key)
            times[key].append(time.perf_counter() - t0)
    for key in timed:
        out[name(key)]["seconds"] = statistics.median(times[key])
    return out


STACKED = ("sharded, stacked", "sharded, one by one", "replicated, stacked")


def stacked_worker(cfg: Config) -> dict:
    """On each rank: the sharded step with the tasks stacked and one by one, and the
    replicated step stacked, warmed up, its collective calls counted and the peak of the
    storages it allocates (:class:`Probe`), then timed in turn (median seconds)."""
    mesh = metaddp.Mesh.create(tasks=1)
    made = {}
    for what in STACKED:
        alg = metaddp.MAML(cfg.model(), inner_lr=cfg.inner_lr, steps=cfg.steps,
                           batched="one by one" not in what)
        learner = metaddp.MetaDDP(alg, mesh, shard=what.startswith("sharded"))
        made[what] = (learner, torch.optim.Adam(learner.parameters(), lr=1e-4),
                      learner.shard(cfg.tasks(cfg.n_tasks)))

    step = functools.partial(meta_step, made)

    out: dict = {}
    for batched in made:
        step(batched)  # warm-up
        probe = Probe(COLLECT_EVERY)
        with metaddp.distributed.counting() as stats:
            step(batched, probe)
        out[batched] = {"calls": stats.calls, "peak": probe.peak, "seconds": []}
    for _ in range(cfg.repeats):
        for batched in made:
            t0 = time.perf_counter()
            step(batched)
            out[batched]["seconds"].append(time.perf_counter() - t0)
    return {k: dict(v, seconds=statistics.median(v["seconds"])) for k, v in out.items()}


def measure_stacked(cfg: Config, worlds: list[int]) -> None:
    print("| processes | " + " | ".join(f"{w} (ms, calls, step peak MiB)" for w in STACKED)
          + " | sharded stacked / one by one (time; peak) | sharded stacked / replicated "
          "stacked (time; peak) |")
    print("|---" * (len(STACKED) + 3) + "|")
    for n in worlds:
        res = run_local(stacked_worker, n, cfg, threads=1)
        row = {w: (1e3 * max(r[w]["seconds"] for r in res), res[0][w]["calls"],
                   max(r[w]["peak"] for r in res)) for w in STACKED}
        (ms, _, peak), (ms1, _, peak1), (msr, _, peakr) = (row[w] for w in STACKED)
        cells = " | ".join(f"{t:,.1f}, {c}, {_mib(p)}" for t, c, p in row.values())
        print(f"| {n} | {cells} | {ms / ms1:.2f}x; {peak / peak1:.2f}x | "
              f"{ms / msr:.2f}x; {peak / peakr:.2f}x |")


def measure(cfg: Config, worlds: list[int]) -> list[dict]:
    rows = []
    for n in worlds:
        t0 = time.perf_counter()
        res = run_local(worker, n, cfg, threads=1)
        row: dict = {"world": n}
        for key in res[0]:
            r0 = res[0][key]
            row[key] = dict(
                r0, held={k: max(r[key]["held"][k] for r in res) for k in r0["held"]},
                **{k: max(r[key][k] for r in res)
                   for k in ("peak", "step_peak", "peak_gc_off", "cycles") if k in r0},
                **({"seconds": max(r[key]["seconds"] for r in res)} if "seconds" in r0 else {}))
            if r0["sent"] != r0["bytes"]:
                print(f"note: {key} at {n}: the process group moved {r0['sent']}, "
                      f"metaddp.distributed.counting() counted {r0['bytes']}")
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print_world(row, cfg)
    return rows


# --- tables ----------------------------------------------------------------------------------


def zero3_minimum(cfg: Config, tasks: int) -> dict[str, float]:
    """The fewest bytes a sharded second-order step can gather and reduce-scatter (buffer
    bytes, as counted), tasks one by one, full weights kept through the backward
    (docs/design.md, "What a sharded step must move"): per task, K + 1 forwards gather
    (the weights, then each step's fast weights) and K inner gradients are reduce-scattered;
    the backward takes each one's adjoint, a reduce-scatter per gather and a gather per
    reduce-scatter. So (2K + 1) M of each per task, where the replicated step all-reduces
    2K M per task and M once."""
    m = 4 * sum(p.numel() for p in cfg.model().parameters())
    each = (2 * cfg.steps + 1) * m * tasks
    return {"all_gather": each, "reduce_scatter": each, "model_bytes": m}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def print_world(row: dict, cfg: Config) -> None:
    n, t = row["world"], cfg.n_tasks
    r, lp, s = (row[f"{v}/default/{t}"] for v in ("replicated", "replicated-loop", "sharded"))
    rl, sl = row[f"replicated/low/{t}"], row[f"sharded/low/{t}"]
    print(f"\n**{n} process{'es' if n > 1 else ''}** ({row['wall_s']:.0f} s)\n")
    print("| per rank | replicated (tasks stacked) | replicated (tasks looped) | sharded "
          "| sharded / replicated (stacked, looped) |")
    print("|---|---:|---:|---:|---:|")

    def line(what: str, a: float, b: float, c: float, fmt=_mib) -> None:  # type: ignore[no-untyped-def]
        ratio = f"{c / a:.3f}, {c / b:.3f}" if a and b else "-"
        print(f"| {what} | {fmt(a)} | {fmt(b)} | {fmt(c)} | {ratio} |")

    for k, label in (("params", "parameters"), ("grads", "gradients"),
                     ("optimizer", "Adam state")):
        line(f"held: {label}, MiB", r["held"][k], lp["held"][k], s["held"][k])
    line("held: total, MiB", *(sum(x["held"].values()) for x in (r, lp, s)))
    line("peak, `memory=\"default\"`, MiB", r["peak"], lp["peak"], s["peak"])
    line("peak, collector off, MiB", r["peak_gc_off"], lp["peak_gc_off"], s["peak_gc_off"])
    line("held by reference cycles at the end, MiB", r["cycles"], lp["cycles"], s["cycles"])
    for what, k in (("peak", "peak"), ("peak, collector off", "peak_gc_off")):
        print(f"| {what}, `memory=\"low\"`, MiB | {_mib(rl[k])} | - | {_mib(sl[k])} "
              f"| {sl[k] / rl[k]:.3f} |")
    for k in KINDS:
        print(f"| {k} bytes | {r['bytes'][k]:,} | {lp['bytes'][k]:,} | {s['bytes'][k]:,} | |")
    least = zero3_minimum(cfg, t)
    for k in ("all_gather", "reduce_scatter") if n > 1 else ():  # one process cuts nothing
        print(f"| {k} bytes, the least a sharded step moves (measured / least) | - | - "
              f"| {least[k]:,.0f} | {s['bytes'][k] / least[k]:.2f} |")
    print("| collective calls (gather, scatter, all-reduce) | "
          + " | ".join(f"{x['calls']} ({', '.join(str(x['calls_by_kind'][k]) for k in KINDS)})"
                       for x in (r, lp, s)) + " | |")
    line("ms per step (median)", r["seconds"], lp["seconds"], s["seconds"],
         fmt=lambda x: f"{1e3 * x:.1f}")


# --- the cost model ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Stated figures (not measured here) for H200 nodes of 8 GPUs."""

    gpus_per_node: int = 8
    memory: float = 141e9  # bytes of HBM3e per H200
    usable: float = 0.90  # of it for tensors (CUDA context, NCCL buffers, fragmentation)
    flops: float = 67e12  # float32 FLOP/s (non-tensor-core peak; H200 = H100 SXM compute)
    hbm: float = 4.8e12  # bytes/s
    nvlink: float = 450e9  # bytes/s per GPU per direction (NVLink 4 via NVSwitch: 900 GB/s both)
    ib: float = 50e9  # bytes/s per GPU per direction (one 400 Gb/s NDR NIC per GPU)
    alpha_nvlink: float = 2e-6  # seconds per latency step of a ring within a node
    alpha_ib: float = 5e-6  # seconds per latency step of a ring across nodes
    # Of the bound FLOPs / flops + traffic / hbm, the share a step reaches (compute = bound /
    # efficiency). This CPU's own share is measured (1 / kappa) but is not carried over: at
    # this benchmark's size much of its step is per-operation overhead, small beside
    # operations a thousand times larger on a GPU. The report says which choices kappa
    # would change.
    efficiency: float = 0.5


def cpu_rates(hidden: int, tasks: int, rows: int, params: int) -> dict:
    """This CPU's float32 matrix-multiply rate at the step's shapes, and its bandwidth for
    an elementwise operation on tensors the size of the model (one thread, best of a few)."""
    torch.set_num_threads(1)
    x, w = torch.randn(tasks, rows, hidden), torch.randn(tasks, hidden, hidden)
    a, b = torch.randn(params), torch.randn(params)

    def best(fn, n: int) -> float:  # type: ignore[no-untyped-def]
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    mm = best(lambda: [torch.bmm(x, w) for _ in range(20)], 5) / 20
    add = best(lambda: [torch.add(a, b) for _ in range(20)], 5) / 20
    return {"flops": 2 * tasks * rows * hidden * hidden / mm, "bandwidth": 3 * a.nbytes / add}


def _fit(xs: list[float], ys: list[float], nonnegative: bool = False) -> tuple[float, float]:
    """Least squares y = a + b * x (a constant through one point); with ``nonnegative``,
    a and b at least 0 (the other refitted alone when one would be negative)."""
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    if nonnegative and a < 0:
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    if nonnegative and b < 0:
        return max(0.0, my), 0.0
    return a, b


def calibrate(rows: list[dict], cfg: Config, rates: dict) -> dict:
    """The measured quantities the model scales, in units of the model's bytes M = 4P.

    Per layout (replicated: tasks stacked, the automatic choice; sharded), from the largest
    world measured (W): each collective kind's bytes and calls as ``a + b * T`` for T tasks per
    rank (two meta-batch sizes), the step's elementwise traffic likewise; from every world
    S >= 2: the step's own peak as ``u(S) * T + v(S)`` with ``u`` and ``v`` each ``c0 + c1 / S``.
    From one process: matrix-multiply FLOPs per parameter per sample, and the ratio of the
    measured step time to ``FLOPs / rate + traffic / bandwidth`` at this CPU's measured rates
    (kappa: the check of that form on the CPU)."""
    t, fewer = cfg.n_tasks, cfg.fewer_tasks
    one = next(r for r in rows if r["world"] == 1)
    top = max(rows, key=lambda r: r["world"])
    base = one[f"replicated/default/{t}"]
    params = sum(p.numel() for p in cfg.model().parameters())
    m = 4 * params
    samples = t * (cfg.support + cfg.query)
    roofline = base["flops"] / rates["flops"] + base["traffic"] / rates["bandwidth"]
    out: dict = {"params": params, "M": m, "world": top["world"],
                 "flops_per_param_sample": base["flops"] / (params * samples),
                 "cpu_roofline_s": roofline, "cpu_measured_s": base["seconds"],
                 "kappa": base["seconds"] / roofline}
    for layout in ("replicated", "sharded"):
        hi, lo = top[f"{layout}/default/{t}"], top[f"{layout}/default/{fewer}"]

        def per_task(get, hi=hi, lo=lo) -> tuple[float, float]:  # type: ignore[no-untyped-def]
            b = (get(hi) - get(lo)) / (t - fewer)
            return get(hi) - b * t, b

        c: dict = {}
        for k in KINDS:
            c[f"{k}_bytes"] = per_task(lambda r, k=k: r["bytes"][k] / m)
            c[f"{k}_calls"] = per_task(lambda r, k=k: r["calls_by_kind"][k])
        c["traffic"] = per_task(lambda r: r["traffic"] / m)
        c["ops"] = per_task(lambda r: r["ops"])
        c["held"] = sum(one[f"{layout}/default/{t}"]["held"].values()) / m  # at S = 1
        us, vs, ss = [], [], []
        for r in rows:
            if r["world"] < 2:
                continue
            a, b = r[f"{layout}/default/{t}"]["step_peak"], r[f"{layout}/default/{fewer}"]["step_peak"]
            u = (a - b) / (t - fewer) / m
            us.append(u)
            vs.append(a / m - u * t)
            ss.append(1 / r["world"])
        c["graph_per_task"] = _fit(ss, us, nonnegative=True)  # (c0, c1): c0 + c1 / S
        c["graph_fixed"] = _fit(ss, vs)
        out[layout] = c
    out["largest_layer"] = cfg.largest_layer()
    return out


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the predicted meta-step computes (stated, not measured)."""

    tasks_per_node: int = 4  # the global meta-batch: 4 tasks per node of 8 GPUs (n/2 tasks)
    samples_per_task: int = 1024  # support + query samples (tokens) of each task


LAYOUTS = {"replicated": "replicated, 8 x n/8", "sharded-node": "sharded in a node, 8 x n/8",
           "sharded-all": "sharded over all, n x 1"}


def predict(cal: dict, params: float, n: int, layout: str, hw: Hardware, work: Workload) -> dict:
    """Seconds and bytes per rank of one meta-step of a ``params``-parameter float32 model on
    ``n`` GPUs, by the alpha-beta model: a prediction, not a measurement.

    Layouts: ``replicated`` (samples = 8 x tasks = n/8, ``shard=False``), ``sharded-node``
    (the same mesh, ``shard=True``: gathers and reduce-scatters on NVLink, the shards'
    meta-gradient over the task axis on InfiniBand) and ``sharded-all`` (samples = n,
    tasks = 1, ``shard=True``: every collective over all n ranks). The global meta-batch is
    ``tasks_per_node * n / 8`` tasks in every layout, so every rank computes on the same
    number of samples; a rank adapts T = tasks_per_node tasks (on 1/8 of their samples) in
    the first two layouts and T = n/2 (on 1/n) in the last.

    time = compute + sum over collectives of (calls * alpha * latency steps + wire bytes /
    bandwidth), ring costs: an all-reduce of n bytes over p ranks puts 2(p-1)/p * n on the
    wire in 2(p-1) steps, an all-gather or a reduce-scatter (p-1)/p * n in p-1 steps; a ring
    within a node runs at NVLink's figures, one across nodes at InfiniBand's. Bytes and calls
    per kind are the measured ones in units of the model (scaled by P, linear in T); the
    replicated all-reduces are cut into 25 MiB buckets (one call each). compute = (FLOPs /
    float32 rate + elementwise traffic / HBM bandwidth) / efficiency, FLOPs and traffic as
    measured per parameter (per sample; per task). Nothing overlaps.

    memory = what a rank holds (parameters, gradients, Adam: 4 M, over S when sharded) + the
    step's own peak as measured, with Python's collector running (linear in T, in 1/S), for a
    model of the measured one's shape. Activations beyond the measured ones are neglected:
    weights dominate at these batch sizes.
    """
    g = hw.gpus_per_node
    m = 4 * params
    tasks = work.tasks_per_node * n // g
    s = n if layout == "sharded-all" else g  # ranks that share a task (and a shard)
    t = tasks * s // n  # tasks a rank adapts
    samples = tasks * work.samples_per_task / n
    c = cal["replicated" if layout == "replicated" else "sharded"]

    def lin(key: str) -> float:
        a, b = c[key]
        return a + b * t

    def link(p: int) -> tuple[float, float]:
        """(alpha, bandwidth) of a ring of ``p`` ranks: NVLink within a node, else the
        InfiniBand hop limits every step."""
        return (hw.alpha_nvlink, hw.nvlink) if p <= g else (hw.alpha_ib, hw.ib)

    def ring(kind: str, nbytes: float, p: int, calls: float) -> float:
        if p <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (p - 1) if kind == "all_reduce" else p - 1
        alpha, beta = link(p)
        return calls * steps * alpha + steps / p * nbytes / beta

    comm: dict[str, float] = {}
    moved = {k: lin(f"{k}_bytes") * m for k in KINDS}
    calls = {k: lin(f"{k}_calls") for k in KINDS}
    per_task = c["graph_per_task"][0] + c["graph_per_task"][1] / s
    fixed = c["graph_fixed"][0] + c["graph_fixed"][1] / s
    if layout == "replicated":
        # The inner gradients' all-reduces within the sample group; the last one, the
        # meta-gradient (M bytes), over every rank.
        inner = moved["all_reduce"] - m
        comm["all_reduce"] = (
            ring("all_reduce", inner, s, calls["all_reduce"] - 1 + inner / BUCKET_BYTES)
            + ring("all_reduce", m, n, math.ceil(m / BUCKET_BYTES)))
        memory = c["held"] * m + max(0.0, per_task * t + fixed) * m
    else:
        comm["all_gather"] = ring("all_gather", moved["all_gather"], s, calls["all_gather"])
        comm["reduce_scatter"] = ring("reduce_scatter", moved["reduce_scatter"], s,
                                      calls["reduce_scatter"])
        # The shards' meta-gradient over the task axis (n / s ranks, one per node), and the
        # small sums (flags, the loss) over every rank: latency only.
        comm["all_reduce"] = (ring("all_reduce", m / s, n // s, math.ceil(m / s / BUCKET_BYTES))
                              + calls["all_reduce"] * 2 * (n - 1) * link(n)[0])
        memory = c["held"] * m / s + max(0.0, per_task * t + fixed) * m
    flops = cal["flops_per_param_sample"] * params * samples
    compute = (flops / hw.flops + lin("traffic") * m / hw.hbm) / hw.efficiency
    return dict(layout=layout, gpus=n, params=params, tasks=tasks, tasks_per_rank=t,
                samples_per_rank=samples, compute_s=compute, comm_s=comm,
                seconds=compute + sum(comm.values()), memory=memory,
                fits=memory <= hw.usable * hw.memory)


def _terms(a: float, b: float, unit: str = " T") -> str:
    """``b unit + a`` for the calibration table, terms under 0.005 left out."""
    out = ""
    for value, suffix in ((b, unit), (a, "")):
        if abs(value) < 0.005:
            continue
        sign = "-" if value < 0 else "+"
        out += (f" {sign} " if out else ("-" if value < 0 else "")) + f"{abs(value):.2f}{suffix}"
    return out or "0"


def model_report(cal: dict, hw: Hardware, work: Workload, sizes: list[float],
                 detail: list[float], gpus: list[int]) -> list[dict]:
    """Print the model's inputs, its predictions and its choices; return the predictions."""
    print("\n## Cost model of one meta-step on H200 nodes: predictions, not measurements\n")
    print(f"What it takes from the run (P = {cal['params']:,}, M = 4P bytes = one float32 copy "
          f"of the model; T tasks a rank adapts; S ranks sharing a task; from {cal['world']} "
          "processes, the fits over 2 to that many):\n")
    r, sh = cal["replicated"], cal["sharded"]
    print("| per rank and meta-step | replicated | sharded |")
    print("|---|---|---|")
    for k in KINDS:
        print(f"| {k} bytes, M | " + " | ".join(_terms(*x[f"{k}_bytes"]) for x in (r, sh)) + " |")
        print(f"| {k} calls | " + " | ".join(_terms(*x[f"{k}_calls"]) for x in (r, sh)) + " |")
    print("| elementwise traffic, M | " + " | ".join(_terms(*x["traffic"]) for x in (r, sh)) + " |")
    print(f"| held (parameters, gradients, Adam), M | {r['held']:.2f} | {sh['held']:.2f} / S |")
    print("| step's own peak, M | "
          f"({_terms(*r['graph_per_task'], unit=' / S')}) T + ({_terms(*r['graph_fixed'], unit=' / S')}) "
          f"| ({_terms(*sh['graph_per_task'], unit=' / S')}) T + ({_terms(*sh['graph_fixed'], unit=' / S')}) |")
    print(f"\nMatrix-multiply FLOPs: {cal['flops_per_param_sample']:.2f} per parameter per "
          f"sample. The largest layer holds {cal['largest_layer']:.1%} of this model's "
          f"parameters. One process measured {1e3 * cal['cpu_measured_s']:.1f} ms against "
          f"{1e3 * cal['cpu_roofline_s']:.1f} ms of FLOPs / rate + traffic / bandwidth at this "
          f"CPU's measured rates: kappa = {cal['kappa']:.2f}, not carried over to the GPU "
          f"(there: the bound / efficiency = {hw.efficiency:g}).")
    print("\nStated, not measured: " + ", ".join(f"{k} = {v:g}" for k, v in
                                                 dataclasses.asdict(hw).items())
          + "; " + ", ".join(f"{k} = {v:g}" for k, v in dataclasses.asdict(work).items()))
    out = []
    print("\nThe model's choice (the fastest layout that fits), seconds per meta-step:\n")
    print("| parameters | " + " | ".join(f"{n} GPUs" for n in gpus) + " |")
    print("|---|" + "---|" * len(gpus))
    for p in sizes:
        cells = []
        for n in gpus:
            got = [predict(cal, p, n, lay, hw, work) for lay in LAYOUTS]
            out += got
            fit = [x for x in got if x["fits"]]
            best = min(fit, key=lambda x: x["seconds"]) if fit else None
            cells.append(f"{best['layout']} {best['seconds']:.2f}" if best else "none fits")
        print(f"| {p / 1e9:g} B | " + " | ".join(cells) + " |")
    slow = dataclasses.replace(hw, efficiency=1 / cal["kappa"])
    changed = []
    for p in sizes:
        for n in gpus:
            picks = []
            for h in (hw, slow):
                got = [x for x in (predict(cal, p, n, lay, h, work) for lay in LAYOUTS) if x["fits"]]
                picks.append(min(got, key=lambda x: x["seconds"])["layout"] if got else "none")
            if picks[0] != picks[1]:
                changed.append(f"{p / 1e9:g} B on {n} GPUs ({picks[0]} -> {picks[1]})")
    print(f"\nWith this CPU's kappa on the GPU too (efficiency 1/{cal['kappa']:.2f}), the choice "
          "changes at: " + (", ".join(changed) if changed else "no size and count") + ".")
    for p in detail:
        print(f"\n**{p / 1e9:g} B parameters** (M = {4 * p / 1e9:g} GB): seconds per meta-step "
              "(compute + all-gather + reduce-scatter + all-reduce) and GB per rank; * = over "
              f"{hw.usable:.0%} of {hw.memory / 1e9:g} GB\n")
        print("| GPUs | " + " | ".join(LAYOUTS.values()) + " | chosen |")
        print("|---:|" + "---|" * (len(LAYOUTS) + 1))
        for n in gpus:
            got = [predict(cal, p, n, lay, hw, work) for lay in LAYOUTS]
            cells = [f"{x['seconds']:.2f} ({x['compute_s']:.2f} + "
                     + " + ".join(f"{x['comm_s'].get(k, 0):.2f}" for k in KINDS)
                     + f"), {x['memory'] / 1e9:.0f} GB{'' if x['fits'] else ' *'}" for x in got]
            fit = [x for x in got if x["fits"]]
            best = min(fit, key=lambda x: x["seconds"])["layout"] if fit else "none fits"
            print(f"| {n} | " + " | ".join(cells) + f" | {best} |")
    return out


# --- the run -------------------------------------------------------------------------------


def provenance() -> dict:
    """Which metaddp ran: its folder, the commit of the checkout it is in, and whether that
    checkout's src differs from the commit."""
    where = Path(metaddp.__file__).resolve().parent
    def git(*a: str) -> str:  # noqa: E306
        try:
            return subprocess.run(["git", "-C", str(where), *a], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""
    return {"metaddp": str(where), "commit": git("log", "-1", "--oneline"),
            "tree": git("rev-parse", "HEAD:./"),  # the package's files at that commit
            "src_changed": bool(git("status", "--porcelain", "--", "."))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,3,4")
    ap.add_argument("--repeats", type=int, default=Config.repeats)
    ap.add_argument("--hidden", type=int, default=Config.hidden)
    ap.add_argument("--depth", type=int, default=Config.depth, help="hidden layers")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--from-json", type=Path, help="recompute the model from a saved run")
    ap.add_argument("--stacked", action="store_true",
                    help="time the sharded step stacked against one by one, and stop")
    args = ap.parse_args(argv)
    if args.stacked:
        measure_stacked(Config(hidden=args.hidden, depth=args.depth, repeats=args.repeats),
                        [int(w) for w in args.worlds.split(",") if int(w) > 1])
        return 0
    hw = Hardware()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        cfg = Config(**saved["config"])
        rows, rates = saved["rows"], saved["cpu_rates"]
        for row in rows:
            print_world(row, cfg)
    else:
        check_probe()
        cfg = Config(hidden=args.hidden, depth=args.depth, repeats=args.repeats)
        where = provenance()
        print(f"metaddp from {where['metaddp']}, commit {where['commit']}"
              + (" with uncommitted changes in its src" if where["src_changed"] else ""))
        rows = measure(cfg, [int(w) for w in args.worlds.split(",")])
        now = provenance()
        if (now["tree"], now["src_changed"]) != (where["tree"], where["src_changed"]):
            print(f"warning: metaddp changed during the run: now {now}")
        rates = cpu_rates(cfg.hidden, cfg.n_tasks, cfg.support + cfg.query,
                          sum(p.numel() for p in cfg.model().parameters()))
    print(f"\nthis CPU, one thread: {rates['flops'] / 1e9:.1f} GFLOP/s float32 (batched matrix "
          f"products at the step's shapes), {rates['bandwidth'] / 1e9:.1f} GB/s (an add of "
          "model-sized tensors)")
    if {1, 2, 4} - {r["world"] for r in rows}:
        print("\nthe cost model is fitted from the runs at 1, 2 and 4 processes: pass them in "
              "--worlds to see it")
        return 0
    cal = calibrate(rows, cfg, rates)
    gpus = [8, 16, 32, 64, 128, 256, 512]
    sizes = [0.5e9, 1e9, 2e9, 4e9, 8e9, 16e9, 32e9]
    work = Workload()
    predictions = model_report(cal, hw, work, sizes, [1e9, 4e9], gpus)
    if not args.from_json:
        save_json(args.json, run_record(
            provenance=where, config=dataclasses.asdict(cfg), rows=rows, cpu_rates=rates,
            calibration=cal, hardware=dataclasses.asdict(hw), workload=dataclasses.asdict(work),
            predictions=predictions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
