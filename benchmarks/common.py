"""The meta-step every benchmark times, and one implementation of it per library.

Every implementation computes the same thing from the same weights and data: the gradient of
the mean over tasks of the query loss after ``steps`` inner SGD steps on the support loss,
second order (create_graph everywhere). Each returns ``{name: meta-gradient}`` so that the
benchmark can check it against a float64 reference before trusting its time.

Peers are optional (``pip install metaddp[bench]``); an implementation whose library is
missing is skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import metaddp

# --- problems ---------------------------------------------------------------------------


def conv4(ways: int = 5, hidden: int = 64, channels: int = 1, smooth: bool = False) -> nn.Module:
    """The Conv-4 of MAML's Omniglot experiments: 4 x (3x3 conv, batch norm, ReLU, 2x2 max-pool).

    Batch norm uses the current batch's statistics (``track_running_stats=False``, as MAML
    does), so the network has no buffers and every implementation treats it alike.
    ``smooth``: softplus and 2x2 average pooling instead of ReLU and max-pooling, whose
    choices (a sign, the largest of four) a last-bit change can flip.
    """

    def block(cin: int) -> list[nn.Module]:
        act, pool = (nn.Softplus(), nn.AvgPool2d(2)) if smooth else (nn.ReLU(), nn.MaxPool2d(2))
        return [nn.Conv2d(cin, hidden, 3, padding=1),
                nn.BatchNorm2d(hidden, track_running_stats=False), act, pool]

    return nn.Sequential(*block(channels), *block(hidden), *block(hidden), *block(hidden),
                         nn.Flatten(), nn.Linear(hidden, ways))


def sine_mlp() -> nn.Module:
    """MAML's sinusoid regressor: 1 -> 40 -> 40 -> 1 with ReLU."""
    return nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark problem: a model, a task family and an inner loop."""

    name: str
    model: str  # "conv4", "conv4-smooth" or "mlp"
    n_tasks: int
    steps: int = 1
    inner_lr: float = 0.4
    ways: int = 5
    shots: int = 1
    queries: int = 15  # per class for conv4; samples for mlp
    size: int = 28
    seed: int = 0
    hidden: int = 64  # Conv-4's channels
    device: str = "cpu"

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        torch.manual_seed(self.seed)
        if self.model.startswith("conv4"):
            net = conv4(self.ways, self.hidden, smooth=self.model == "conv4-smooth")
        else:
            net = sine_mlp()
        return net.to(dtype).to(self.device)

    @property
    def loss_fn(self) -> Callable[[Tensor, Tensor], Tensor]:
        """Per-sample loss (``reduction='none'``, as metaddp's share convention needs)."""
        if self.model.startswith("conv4"):
            return lambda out, y: F.cross_entropy(out, y, reduction="none")
        return lambda out, y: F.mse_loss(out, y, reduction="none").flatten(1).mean(1)

    def mean_loss(self, out: Tensor, y: Tensor) -> Tensor:
        return self.loss_fn(out, y).mean()

    def tasks(self, dtype: torch.dtype = torch.float32) -> list[metaddp.Task]:
        """Synthetic tasks, a function of the seed and the task index only."""
        out = []
        for i in range(self.n_tasks):
            g = metaddp.generator_for(self.seed, i)
            if self.model.startswith("conv4"):
                protos = torch.rand(self.ways, 1, self.size, self.size, generator=g)

                def draw(per_class: int) -> tuple[Tensor, Tensor]:
                    y = torch.arange(self.ways).repeat(per_class)
                    x = protos[y] + 0.3 * torch.randn(len(y), 1, self.size, self.size, generator=g)
                    return x.to(dtype), y

                (sx, sy), (qx, qy) = draw(self.shots), draw(self.queries)
            else:
                amp = 0.1 + 4.9 * torch.rand((), generator=g)
                phase = torch.pi * torch.rand((), generator=g)
                x = 10 * torch.rand(self.shots + self.queries, 1, generator=g) - 5
                y = amp * torch.sin(x - phase)
                sx, sy = x[: self.shots].to(dtype), y[: self.shots].to(dtype)
                qx, qy = x[self.shots :].to(dtype), y[self.shots :].to(dtype)
            d = self.device
            out.append(metaddp.Task(metaddp.Batch(sx.to(d), sy.to(d), len(sx)),
                                    metaddp.Batch(qx.to(d), qy.to(d), len(qx))))
        return out


CONV = Case("Conv-4, 5-way 1-shot, 15 queries", "conv4", n_tasks=4)
SINE = Case("sinusoid MLP, 10-shot, 10 queries", "mlp", n_tasks=25, inner_lr=0.01, shots=10, queries=10)

# --- implementations ---------------------------------------------------------------------
# Each: make(case, net, tasks) -> step() returning {name: grad}. ``net`` is shared; every
# step starts from zeroed gradients.

Step = Callable[[], dict[str, Tensor]]


def _grads(net: nn.Module) -> dict[str, Tensor]:
    return {k: p.grad.detach().clone() for k, p in net.named_parameters()}


def make_metaddp(case: Case, net: nn.Module, tasks, batched: bool | None = None,
                 **settings) -> Step:
    maml = metaddp.MAML(net, inner_lr=case.inner_lr, steps=case.steps, batched=batched,
                        **settings)

    def step():
        net.zero_grad(set_to_none=True)
        maml.meta_loss(tasks, case.loss_fn).backward()
        return _grads(net)

    step.maml = maml  # what it chose (maml.conv.chosen) stays readable
    return step


def make_loop(case: Case, net: nn.Module, tasks) -> Step:
    """Per-task autograd: adapt each task with create_graph, backward through its query loss."""
    names = [k for k, _ in net.named_parameters()]

    def step():
        net.zero_grad(set_to_none=True)
        theta = [p for _, p in net.named_parameters()]
        for t in tasks:
            fast = theta
            for _ in range(case.steps):
                out = torch.func.functional_call(net, dict(zip(names, fast)), (t.support.x,))
                g = torch.autograd.grad(case.mean_loss(out, t.support.y), fast, create_graph=True)
                fast = [w - case.inner_lr * gi for w, gi in zip(fast, g)]
            out = torch.func.functional_call(net, dict(zip(names, fast)), (t.query.x,))
            (case.mean_loss(out, t.query.y) / len(tasks)).backward()
        return _grads(net)

    return step


def make_vmap(case: Case, net: nn.Module, tasks) -> Step:
    """Hand-written torch.func: grad of the inner loss, vmap over tasks, grad of the mean."""
    from torch.func import functional_call, grad, vmap

    xs, ys = torch.stack([t.support.x for t in tasks]), torch.stack([t.support.y for t in tasks])
    xq, yq = torch.stack([t.query.x for t in tasks]), torch.stack([t.query.y for t in tasks])

    def task_loss(params, sx, sy, qx, qy):
        fast = params
        for _ in range(case.steps):
            g = grad(lambda p: case.mean_loss(functional_call(net, p, (sx,)), sy))(fast)
            fast = {k: fast[k] - case.inner_lr * g[k] for k in fast}
        return case.mean_loss(functional_call(net, fast, (qx,)), qy)

    def meta(params):
        return vmap(task_loss, in_dims=(None, 0, 0, 0, 0))(params, xs, ys, xq, yq).mean()

    def step():
        params = {k: p.detach() for k, p in net.named_parameters()}
        return {k: g.detach() for k, g in grad(meta)(params).items()}

    return step


def make_higher(case: Case, net: nn.Module, tasks) -> Step:
    import higher

    opt = torch.optim.SGD(net.parameters(), lr=case.inner_lr)

    def step():
        net.zero_grad(set_to_none=True)
        for t in tasks:
            with higher.innerloop_ctx(net, opt, copy_initial_weights=False) as (fnet, diffopt):
                for _ in range(case.steps):
                    diffopt.step(case.mean_loss(fnet(t.support.x), t.support.y))
                (case.mean_loss(fnet(t.query.x), t.query.y) / len(tasks)).backward()
        return _grads(net)

    return step


def make_torchopt(case: Case, net: nn.Module, tasks) -> Step:
    import torchopt

    inner = torchopt.MetaSGD(net, lr=case.inner_lr)

    def step():
        net.zero_grad(set_to_none=True)
        start = torchopt.extract_state_dict(net)
        for t in tasks:
            for _ in range(case.steps):
                inner.step(case.mean_loss(net(t.support.x), t.support.y))
            (case.mean_loss(net(t.query.x), t.query.y) / len(tasks)).backward()
            torchopt.recover_state_dict(net, start)
        return _grads(net)

    return step


def make_learn2learn(case: Case, net: nn.Module, tasks) -> Step:
    import learn2learn as l2l

    maml = l2l.algorithms.MAML(net, lr=case.inner_lr, first_order=False)

    def step():
        net.zero_grad(set_to_none=True)
        for t in tasks:
            learner = maml.clone()
            for _ in range(case.steps):
                learner.adapt(case.mean_loss(learner(t.support.x), t.support.y))
            (case.mean_loss(learner(t.query.x), t.query.y) / len(tasks)).backward()
        return _grads(net)

    return step


class NotApplicable(Exception):
    """Raised by a ``make_X`` whose row means nothing for this case (the reason is the message)."""


def _parallel_metalearn(case: Case, net: nn.Module, tasks) -> Step:
    """parallel-metalearn's ``algorithms.MAML`` on ``net``: its vmap backend, second order, SGD.

    ``MAML.step`` is its whole meta-step: zero the gradients, vmap its inner loop (``torch.func.grad``
    of the support loss, ``InnerSGD``) over the tasks, backward the mean query loss, then
    ``optimizer.step()``, here an outer optimizer whose step leaves the weights alone so that the
    meta-gradient stays in ``.grad`` to be compared.
    """
    from metalearn.algorithms import MAML
    from metalearn.inner_optimizers import InnerSGD
    from metalearn.loss import BaseLoss, CategoricalAccuracy, CrossEntropy
    from metalearn.model_wrappers import MAML_Model

    class Plain(nn.Module):
        """MAML_Model calls ``backbone(x, training=..., num_step=...)`` and ``head(...)`` alike,
        which ``nn.Sequential`` and ``nn.Linear`` do not take."""

        def __init__(self, module: nn.Module):
            super().__init__()
            self.module = module

        def forward(self, x, **flags):
            return self.module(x)

    class CaseLoss(BaseLoss):
        """The case's mean loss in its loss interface (it has cross-entropy only)."""

        def forward(self, out_dict, targets, model_states=None, **kwargs):
            loss = case.mean_loss(out_dict["logits"], targets["labels"])
            return loss, loss.detach()

    class KeepWeights(torch.optim.SGD):
        def step(self, closure=None):
            return None

    model = MAML_Model(backbone=Plain(net[:-1]), head=Plain(net[-1]))  # the same Parameters as net
    loss = (CrossEntropy(metric_fn=CategoricalAccuracy())  # its default metric_fn=None raises TypeError
            if case.model.startswith("conv4") else CaseLoss())
    inner = InnerSGD(model.get_fast_weights(), first_order=False, inner_lr=case.inner_lr,
                     max_inner_steps=case.steps, learn_lr=False)
    algo = MAML(model=model, optimizer=KeepWeights(model.parameters(), lr=0.0), inner_optimizer=inner,
                support_loss_fn=loss, inner_steps=case.steps, chunk_size=len(tasks),
                device=torch.device(case.device), backend="vmap")
    batch = (torch.stack([t.support.x for t in tasks]), {"labels": torch.stack([t.support.y for t in tasks])},
             torch.stack([t.query.x for t in tasks]), {"labels": torch.stack([t.query.y for t in tasks])})

    def step():
        algo.step(iter([batch]), training=True)
        return _grads(net)

    return step


def make_parallel_metalearn(case: Case, net: nn.Module, tasks) -> Step:
    """parallel-metalearn on ``net`` as it is, torch's ``nn.BatchNorm2d`` included."""
    return _parallel_metalearn(case, net, tasks)


def make_parallel_metalearn_bn(case: Case, net: nn.Module, tasks) -> Step:
    """parallel-metalearn with its own BatchNorm layer in place of torch's, as it means to be used.

    Its ``ModelTranslator.convert_to_functional`` does this swap, but in 0.5.6 it raises
    TypeError (it passes ``learn_gamma``/``learn_beta``, which its ``BatchNorm`` does not take);
    then the swap is done here the same way, on a copy, with the same weights and names.
    """
    import copy

    from metalearn.nn_models import ModelTranslator
    from metalearn.nn_models.basic_layers import BatchNorm

    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules()):
        raise NotApplicable("no batch norm in this model: it would repeat the parallel-metalearn (vmap) row")
    try:
        fnet = ModelTranslator.convert_to_functional(net)
    except TypeError:
        fnet = copy.deepcopy(net)
        for parent in list(fnet.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.modules.batchnorm._BatchNorm):
                    bn = BatchNorm(child.num_features, eps=child.eps, momentum=child.momentum,
                                   affine=child.affine, track_running_stats=child.track_running_stats)
                    if child.affine:
                        bn.weight, bn.bias = child.weight, child.bias
                    setattr(parent, name, bn)
    return _parallel_metalearn(case, fnet, tasks)


def make_floor(case: Case, net: nn.Module, tasks) -> Step:
    """Not a meta-step: one plain forward+backward over every support and query sample."""
    x = torch.cat([torch.cat([t.support.x, t.query.x]) for t in tasks])
    y = torch.cat([torch.cat([t.support.y, t.query.y]) for t in tasks])

    def step():
        net.zero_grad(set_to_none=True)
        case.mean_loss(net(x), y).backward()
        return _grads(net)

    return step


IMPLEMENTATIONS: dict[str, Callable[..., Step]] = {
    "metaddp": make_metaddp,
    "metaddp batched=True": lambda c, n, t: make_metaddp(c, n, t, batched=True),
    "metaddp batched=True conv=grouped": lambda c, n, t: make_metaddp(c, n, t, batched=True,
                                                                      conv="grouped"),
    "metaddp batched=False": lambda c, n, t: make_metaddp(c, n, t, batched=False),
    "torch.func grad+vmap (hand-written)": make_vmap,
    "per-task autograd loop": make_loop,
    "higher": make_higher,
    "TorchOpt MetaSGD": make_torchopt,
    "learn2learn": make_learn2learn,
    "parallel-metalearn (vmap)": make_parallel_metalearn,
    "parallel-metalearn (vmap), its own BatchNorm": make_parallel_metalearn_bn,
    "floor: plain batched fwd+bwd (not a meta-step)": make_floor,
}


def available(names) -> tuple[dict[str, Callable[..., Step]], dict[str, str]]:
    """The implementations whose libraries import, and why the others were skipped."""
    ok, skipped = {}, {}
    modules = {"higher": "higher", "TorchOpt MetaSGD": "torchopt", "learn2learn": "learn2learn",
               "parallel-metalearn (vmap)": "metalearn",
               "parallel-metalearn (vmap), its own BatchNorm": "metalearn"}
    for name in names:
        mod = modules.get(name)
        if mod is not None:
            try:
                __import__(mod)
            except Exception as e:  # ImportError, or a peer broken against this torch
                skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0][:120]
                continue
        ok[name] = IMPLEMENTATIONS[name]
    return ok, skipped


# --- measuring ---------------------------------------------------------------------------


def reference_grads(case: Case) -> dict[str, Tensor]:
    """The meta-gradient in float64 by the plain per-task loop (the numbers to agree with)."""
    net = case.build(torch.float64)
    return make_loop(case, net, case.tasks(torch.float64))()


def max_rel_diff(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """``max |got - want| / max |want|`` over every entry of every parameter."""
    scale = max(float(w.abs().max()) for w in want.values())
    return max(float((got[k].double().cpu() - want[k].double().cpu()).abs().max())
               for k in want) / scale


def time_round_robin(steps: dict[str, Step], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of every step, interleaved: round r runs every implementation once.

    Interleaving spreads the load of anything else running on the machine over all rows
    alike, so ratios stay meaningful on a shared machine even when absolute times drift.
    """
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        for s in steps.values():
            s()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for k, s in steps.items():
            sync()
            t0 = time.perf_counter()
            s()
            sync()  # a GPU step is done when its kernels are, not when they are queued
            times[k].append(time.perf_counter() - t0)
    return times


def step_times(step: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``step`` (warm it up first)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def median_ms(ts: list[float]) -> float:
    return 1e3 * statistics.median(ts)


def peak_rss_mib() -> float:
    """This process's peak resident memory since start or :func:`reset_peak_rss`, in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_rss() -> None:
    """Reset the peak to the current resident memory (Linux; a no-op elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def machine() -> str:
    import platform

    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} logical cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, Python {platform.python_version()}")


def run_record(**fields) -> dict:
    """A result record stamped with the date, the machine and the command that made it."""
    import sys

    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=machine(),
                command="python " + " ".join(sys.argv), **fields)


def save_json(path, record: dict) -> None:
    """Write ``record`` to ``path`` (if given), creating its folder."""
    import json

    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
