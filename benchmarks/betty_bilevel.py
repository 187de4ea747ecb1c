"""metaddp and Betty side by side on one data-reweighting problem, float64, CPU.

The problem is the test suite's reweighting lookahead (``metaddp.testing.scenarios``): a
two-class MLP, Meta-Weight-Net's weighting of each inner sample's loss, and a learned weight
decay, with the same global batch at every world size (``--batch`` inner and outer samples).
Each library's hypergradient at 2 and 4 processes is compared with *its own* one-process value
of the same method, by ``max |g_N - g_1| / max |g_1|`` (as ``metaddp verify``).

- metaddp: ``Bilevel(start="current")``, one inner SGD step, methods ``t1t2``, ``neumann``,
  ``implicit-cg`` and ``sama`` (Adam inner steps), on real gloo processes.
- Betty 0.2.1 (``pip install --no-deps --ignore-requires-python betty-ml==0.2.1``): its own
  hypergradient functions ``darts``, ``neumann``, ``cg`` and ``sama``
  (``betty.hypergradient``), called on objects that give them what its ``Problem`` gives
  (parameters, the training loss of the current batch, the config, the optimizer state).
  Betty's distributed strategy cannot start without CUDA (``engine.py``:
  ``self._rank % torch.cuda.device_count()``), so N processes are run as it would run them
  under DDP, in one process: each rank calls the function on its own shard (``autograd.grad``
  does not run DDP's hooks, so nothing crosses ranks there), and the results are averaged, as
  DDP averages ``.grad``.

Timing: one hypergradient (both libraries' functions from the same weights; metaddp with its
backward and gradient SUM), median of ``--repeats``, at 1 and 2 processes. Then whole steps
at one process, median of ``--whole-steps``: Betty's ``Engine`` with an inner ``ImplicitProblem``
(forward, backward, SGD or Adam step) and an outer one (forward, hypergradient, Adam step,
``unroll_steps=1``), against metaddp's ``Bilevel(start="current", train_inner=True)`` step
(meta-loss, backward, gradient SUM, one Adam step over the model and the weighting);
``--whole-only`` times these alone.

    python benchmarks/betty_bilevel.py --json benchmarks/results/betty_bilevel.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import metaddp as md  # noqa: E402
from common import run_record, save_json  # noqa: E402
from metaddp.distributed.launch import run_local  # noqa: E402
from metaddp.testing import scenarios as S  # noqa: E402

# metaddp's method, Betty's of the same idea, and the inner optimizer both use.
PAIRS = (("t1t2", "darts", "sgd"), ("neumann", "neumann", "sgd"), ("implicit-cg", "cg", "sgd"),
         ("sama", "sama", "adam"))
ITERATIONS = 3
LR = 0.3


def problem(method: str, optimizer: str, batch: int) -> S.BilevelProblem:
    return S.BilevelProblem(method=method, optimizer=optimizer, steps=1, n_inner=batch, n_outer=batch,
                            inner_lr=LR)


def build(p: S.BilevelProblem):
    algorithm = p.build_algorithm()
    m = {"neumann": md.bilevel.Neumann(iterations=ITERATIONS, alpha=LR),
         "implicit-cg": md.bilevel.ImplicitCG(iterations=ITERATIONS, damping=1.0)}.get(p.method)
    if m is not None:
        algorithm.method = m
    return algorithm


def metaddp_worker(probs: list[S.BilevelProblem], repeats: int) -> list[dict]:
    out = []
    for p in probs:
        learner = md.MetaDDP(build(p), md.Mesh.create())
        times = []
        for _ in range(repeats):
            learner.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            learner.meta_loss(learner.shard(1, p.task)).backward()
            learner.sync_grads()
            times.append(time.perf_counter() - t0)
        grads = torch.cat([q.grad.flatten() for k, q in learner.module.named_parameters()
                           if k.startswith("outer.")])
        out.append({"grad": grads, "seconds": statistics.median(times)})
    return out


# --- Betty, through its own hypergradient functions ----------------------------------------


@dataclasses.dataclass
class BettyConfig:
    type: str
    darts_alpha: float = 0.01
    sama_adam_alpha: float = 1.0  # Betty's default
    neumann_iterations: int = ITERATIONS
    neumann_alpha: float = LR
    cg_iterations: int = ITERATIONS
    cg_alpha: float = 1.0
    darts_multitask: bool = False
    sama_multitask: bool = False


class Lower:
    """The inner problem as Betty's hypergradient functions read it (``curr``)."""

    paths: list = []
    _strategy = "distributed"  # its DDP strategy: what N ranks would run

    def synchronize_params(self, params, all_reduce=False):
        pass  # one set of weights here

    def __init__(self, net, weighting, batch, config, optimizer=None):
        self.net, self.weighting, self.cur_batch, self.config = net, weighting, batch, config
        self.optimizer = optimizer

    def trainable_parameters(self):
        return list(self.net.parameters())

    parameters = meta_trainable_parameters = trainable_parameters

    def training_step_exec(self, batch):
        x, y = batch
        ce = F.cross_entropy(self.net(x), y, reduction="none")
        decay = 0.5 * self.weighting.log_decay.exp() * sum((w * w).sum() for w in self.net.parameters())
        return (self.weighting(ce) * ce).mean() + decay

    def get_opt_param_group_for_param(self, param):
        return self.optimizer.param_groups[0]

    def get_opt_state_for_param(self, param):
        return self.optimizer.state[param]


class Upper:
    def __init__(self, weighting):
        self.weighting = weighting

    def trainable_parameters(self):
        return list(self.weighting.parameters())


def betty_hypergradient(p: S.BilevelProblem, kind: str, world: int) -> tuple[torch.Tensor, float]:
    """Betty's hypergradient of ``kind`` with ``world`` ranks (each its own shard, then the
    mean), and the seconds of one call on one rank holding everything."""
    import betty.hypergradient as bh

    task = p.task(0)
    fn = bh.jvp_fn_mapping[kind]
    per_rank, seconds = [], 0.0
    for r in range(world):
        net, weighting = p.build_model()
        optimizer = None
        if p.optimizer == "adam":  # SAMA reads Adam's state: one step of the inner problem first
            optimizer = torch.optim.Adam(net.parameters(), lr=LR)
            warm = Lower(net, weighting, (task.support.x, task.support.y), None)
            optimizer.zero_grad()
            warm.training_step_exec(warm.cur_batch).backward()
            optimizer.step()
            weighting.zero_grad()
        s = md.data.shard_range(task.support.n, r, world)
        q = md.data.shard_range(task.query.n, r, world)
        lower = Lower(net, weighting, (task.support.x[s.start:s.stop], task.support.y[s.start:s.stop]),
                      BettyConfig(kind), optimizer)
        t0 = time.perf_counter()
        val = F.cross_entropy(net(task.query.x[q.start:q.stop]), task.query.y[q.start:q.stop])
        vector = torch.autograd.grad(val, lower.trainable_parameters())
        got = fn(vector, lower, Upper(weighting), False)
        seconds = time.perf_counter() - t0
        per_rank.append(torch.cat([g.flatten() for g in got]))
    return torch.stack(per_rank).mean(0), seconds


# --- Whole steps: forward, hypergradient and both optimizers' steps -----------------------


def metaddp_whole_steps(p: S.BilevelProblem, steps: int) -> float:
    """Seconds per whole step of metaddp's reweighting at one process: the inner problem's
    lookahead, the hypergradient, the model's own gradient on the weighted loss
    (``train_inner=True``), and one Adam step over the model and the weighting."""
    algorithm = build(p)
    algorithm.train_inner = True  # the model trains on the weighted loss in the same step
    learner = md.MetaDDP(algorithm, md.Mesh.create())
    opt = torch.optim.Adam(learner.parameters(), 1e-3)
    task = [p.task(0)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        learner.meta_loss(learner.shard(task)).backward()
        learner.sync_grads()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[steps // 5:])


def betty_whole_steps(p: S.BilevelProblem, kind: str, steps: int) -> float:
    """Seconds per whole step of Betty's engine on the same problem: the inner problem's
    forward, backward and optimizer step, then the outer problem's forward, hypergradient
    (``kind``) and optimizer step (``unroll_steps=1``)."""
    from betty.configs import Config, EngineConfig
    from betty.engine import Engine
    from betty.problems import ImplicitProblem

    task = p.task(0)
    net, weighting = p.build_model()
    inner_batch = (task.support.x, task.support.y)
    outer_batch = (task.query.x, task.query.y)
    cfg = dict(type=kind, darts_alpha=0.01, neumann_iterations=ITERATIONS, neumann_alpha=LR,
               cg_iterations=ITERATIONS, cg_alpha=1.0)

    class Inner(ImplicitProblem):
        def training_step(self, batch):
            x, y = batch
            ce = F.cross_entropy(self.module(x), y, reduction="none")
            w = self.outer.module
            decay = 0.5 * w.log_decay.exp() * sum((q * q).sum() for q in self.module.parameters())
            return (w(ce) * ce).mean() + decay

    class Outer(ImplicitProblem):
        def training_step(self, batch):
            x, y = batch
            return F.cross_entropy(self.inner.module(x), y)

    inner_opt = (torch.optim.SGD(net.parameters(), lr=LR) if p.optimizer == "sgd"
                 else torch.optim.Adam(net.parameters(), lr=LR))
    inner = Inner(name="inner", module=net, optimizer=inner_opt,
                  train_data_loader=[inner_batch] * (steps + 2), config=Config(type=kind, unroll_steps=1))
    outer = Outer(name="outer", module=weighting, optimizer=torch.optim.Adam(weighting.parameters(), 1e-3),
                  train_data_loader=[outer_batch] * (steps + 2), config=Config(**cfg))
    engine = Engine(problems=[outer, inner], config=EngineConfig(train_iters=steps, strategy="default"),
                    dependencies={"l2u": {inner: [outer]}, "u2l": {outer: [inner]}})
    times = []
    engine.train()
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.global_step += 1
        engine.train_step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[steps // 5:])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--whole-steps", type=int, default=100, help="whole steps timed per library")
    ap.add_argument("--whole-only", action="store_true", help="only the whole steps at one process")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:
        import betty  # noqa: F401
    except ImportError:
        sys.exit("needs Betty: pip install --no-deps --ignore-requires-python betty-ml==0.2.1")
    rows = []
    for batch in [] if a.whole_only else a.batch:
        probs = [problem(m, opt, batch) for m, _, opt in PAIRS]
        ours = {w: run_local(metaddp_worker, w, probs, a.repeats) for w in (2, 4)}
        ours[1] = [metaddp_worker(probs, a.repeats)]
        for i, (method, kind, opt) in enumerate(PAIRS):
            p = probs[i]
            theirs = {w: betty_hypergradient(p, kind, w) for w in (1, 2, 4)}
            row = {
                "batch": batch, "metaddp": method, "betty": kind, "inner optimizer": opt,
                "metaddp_rel_2": rel(ours[2][0][i]["grad"], ours[1][0][i]["grad"]),
                "metaddp_rel_4": rel(ours[4][0][i]["grad"], ours[1][0][i]["grad"]),
                "betty_rel_2": rel(theirs[2][0], theirs[1][0]),
                "betty_rel_4": rel(theirs[4][0], theirs[1][0]),
                "metaddp_ms_1": 1e3 * ours[1][0][i]["seconds"],
                "metaddp_ms_2": 1e3 * ours[2][0][i]["seconds"],
                "betty_ms_1": 1e3 * theirs[1][1],
            }
            rows.append(row)
    if rows:
        print(f"{'batch':>5} {'metaddp':<12} {'Betty':<8} {'ours @2':>9} {'ours @4':>9} {'Betty @2':>9} "
              f"{'Betty @4':>9} {'ours ms 1p':>10} {'ours ms 2p':>10} {'Betty ms 1p':>11}")
    for r in rows:
        print(f"{r['batch']:>5} {r['metaddp']:<12} {r['betty']:<8} {r['metaddp_rel_2']:>9.1e} "
              f"{r['metaddp_rel_4']:>9.1e} {r['betty_rel_2']:>9.1%} {r['betty_rel_4']:>9.1%} "
              f"{r['metaddp_ms_1']:>10.2f} {r['metaddp_ms_2']:>10.2f} {r['betty_ms_1']:>11.2f}")
    # Whole steps at one process: each library's forward, hypergradient and optimizer steps.
    whole = []
    for batch in a.batch:
        for method, kind, opt in PAIRS:
            p = problem(method, opt, batch)
            ours, theirs = metaddp_whole_steps(p, a.whole_steps), betty_whole_steps(p, kind, a.whole_steps)
            whole.append({"batch": batch, "metaddp": method, "betty": kind, "metaddp_ms": 1e3 * ours,
                          "betty_ms": 1e3 * theirs, "ratio": ours / theirs})
    print(f"\nwhole step, one process (ms, median of {a.whole_steps})")
    print(f"{'batch':>5} {'metaddp':<12} {'Betty':<8} {'metaddp':>8} {'Betty':>8} {'ratio':>6}")
    for r in whole:
        print(f"{r['batch']:>5} {r['metaddp']:<12} {r['betty']:<8} {r['metaddp_ms']:>8.2f} {r['betty_ms']:>8.2f}"
              f" {r['ratio']:>6.2f}")
    save_json(Path(a.json) if a.json else None, run_record(settings=vars(a), rows=rows, whole=whole))


if __name__ == "__main__":
    main()
