"""Reproducible meta-learning problems for checking invariance to the world size.

Each scenario builds its model and its global meta-batch from a seed alone, so every process
count sees the same problem. :func:`run` is what each rank executes; ``metaddp verify`` and the
test suite call it at several world sizes and compare.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._data import Batch, Task, generator_for
from .._functional import call
from .._remat import Replay
from .._share import share
from ..algorithms import ALGORITHMS as REGISTRY
from ..algorithms import Algorithm, Settings, build
from ..distributed import DEFAULT_UNIT_BYTES, Mesh, MetaDDP, global_value
from ..distributed import LAYOUTS as LAYOUTS  # re-exported: the layouts every scenario runs

ALGORITHMS = tuple(REGISTRY)


def mesh_for(layout: str) -> Mesh:
    """The mesh of a named layout (:meth:`metaddp.Mesh.for_layout`)."""
    return Mesh.for_layout(layout)


def mse_per_sample(pred: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(pred, y, reduction="none")


def ce_per_sample(pred: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(pred, y, reduction="none")


def _mlp(inputs: int, dropout: float) -> nn.Sequential:
    """The regression MLP, with dropout after its first layer where ``dropout`` is not 0."""
    drop = [nn.Dropout(dropout)] if dropout else []
    return nn.Sequential(
        nn.Linear(inputs, 16), nn.Tanh(), *drop, nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


class ContextMLP(nn.Module):
    """The regression MLP with a context vector concatenated to its input (CAVIA's)."""

    def __init__(self, context: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = _mlp(1 + context, dropout)

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        return self.net(torch.cat([x, context.expand(x.shape[0], -1)], dim=1))


class SmallConv(nn.Module):
    """Two 3x3 convolutions (each optionally followed by BatchNorm) and a linear head over
    8x8 single-channel images."""

    def __init__(
        self,
        ways: int = 3,
        width: int = 4,
        batchnorm: bool = False,
        running_stats: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, stride=2)
        self.head = nn.Linear(width * 16, ways)
        bn = lambda: nn.BatchNorm2d(width, track_running_stats=running_stats)  # noqa: E731
        self.bn1 = bn() if batchnorm else nn.Identity()
        self.bn2 = bn() if batchnorm else nn.Identity()

    def features(self, x: Tensor) -> Tensor:
        x = self.drop(torch.tanh(self.bn1(self.conv1(x))))
        x = torch.tanh(self.bn2(self.conv2(x)))
        return x.flatten(1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))

    def split_head(self) -> tuple[nn.Module, nn.Module]:
        """The split ANIL needs: the layers below the head (shared, not copied), the head."""
        return ConvBody(self), self.head


class ConvBody(nn.Module):
    """The layers of a :class:`SmallConv` below its head (shared with it, not copied)."""

    def __init__(self, net: SmallConv) -> None:
        super().__init__()
        self.conv1, self.conv2, self.bn1, self.bn2 = net.conv1, net.conv2, net.bn1, net.bn2
        self.drop = net.drop

    forward = SmallConv.features


class SelfAttention(nn.Module):
    """Multi-head self-attention written the way transformer code writes it: projections
    and ``F.scaled_dot_product_attention`` with attention dropout in training mode."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.heads, self.dropout = heads, dropout

    def forward(self, x: Tensor) -> Tensor:
        n, length, width = x.shape
        q, k, v = self.qkv(x).reshape(n, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(n, length, width))


class TinyTransformer(nn.Module):
    """A sequence regressor: an input projection, one ``nn.TransformerEncoderLayer``
    (``nn.MultiheadAttention`` inside), one causal :class:`SelfAttention` block with
    ``nn.Dropout``, and a linear read-out of the mean over positions. Dropout 0.1 everywhere,
    samples first."""

    def __init__(self, features: int = 2, width: int = 8, heads: int = 2, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.encoder = nn.TransformerEncoderLayer(
            width, heads, 2 * width, dropout=dropout, batch_first=True
        )
        self.attention = SelfAttention(width, heads, dropout)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.encoder(self.embed(x))
        h = self.norm(h + self.drop(self.attention(h)))
        return self.head(h.mean(dim=1)).squeeze(-1)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A meta-step: algorithm, model, task family, inner loop, precision, and work layout."""

    # "mlp" (sinusoid-like regression), "conv" (3-way classification), "transformer"
    # (sequence regression, dropout on: TinyTransformer) or "family" (``family``'s own)
    model: str = "mlp"
    n_tasks: int = 5
    n_support: int = 13
    n_query: int = 11
    steps: int = 3
    inner_lr: float = 0.1
    first_order: bool = False
    layout: str = "sample"
    dtype: torch.dtype = torch.float64
    seed: int = 0
    algorithm: str = "maml"  # one of ALGORITHMS, or "cavia" (on its context MLP)
    batchnorm: bool = False  # conv only: BatchNorm after each convolution, synchronized
    running_stats: bool = True  # BatchNorm tracks running statistics (False: MAML's own)
    lam: float = 20.0  # iMAML's proximal strength
    cg_steps: int = 60  # iMAML's conjugate-gradient budget
    memory: str | Replay = "default"  # "low": each step's graph rebuilt in the backward; Replay
    optimizer: str = "sgd"  # the inner optimizer by name (INNER_OPTIMIZERS)
    deterministic: bool = False  # MetaDDP's deterministic mode (bit-identical at any world)
    chunks: int = 8  # its most chunks per batch
    clip: float | None = None  # clip inner gradients to this global norm
    schedule_steps: int | None = None  # MAML++: the run's length its schedules scale to
    meta_step: int = 0  # MAML++: the meta-step its schedules are at
    batched: bool | None = None  # MAML: tasks stacked (True), one by one (False), or chosen
    shard: bool = False  # meta-parameters sharded over the sample axis (MetaDDP(shard=True))
    dropout: float = 0.0  # mlp and conv: dropout after the first layer, keyed by the samples
    check: bool = False  # MetaDDP(check=True): every step compared across the ranks
    unit_bytes: int | None = None  # sharded: MetaDDP's unit_bytes (None: its default)
    # model "family": a task family (metaddp.tasks.TaskFamily) whose network, tasks (its train
    # split, task(seed, i)) and per-sample loss make the problem; n_support and n_query are
    # then its own.
    family: Any = None

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        net: nn.Module
        if self.model == "mlp" and self.algorithm == "cavia":
            net = ContextMLP(dropout=self.dropout)
        elif self.model == "mlp":
            net = _mlp(1, self.dropout)
        elif self.model == "conv":
            net = SmallConv(
                batchnorm=self.batchnorm, running_stats=self.running_stats, dropout=self.dropout
            )
        elif self.model == "transformer":
            net = TinyTransformer()
        elif self.model == "family":
            net = self.family.model()
        else:
            raise ValueError(f"unknown model {self.model!r}")
        return net.to(self.dtype)

    @property
    def loss_fn(self) -> Callable[[Tensor, Tensor], Tensor]:
        if self.model == "family":
            return self.family.loss
        return ce_per_sample if self.model == "conv" else mse_per_sample

    def task(self, index: int) -> Task:
        """Global task ``index``: a function of the seed and the index only."""
        if self.model == "family":  # the family's data, whatever the dtype
            return self.family.task(self.seed, index)
        g = generator_for(self.seed, index)
        n = self.n_support + self.n_query
        # Drawn in float32 whatever the default dtype, so the data never depends on it.
        f32 = torch.float32
        if self.model == "mlp":
            amp = 0.1 + 4.9 * torch.rand((), generator=g, dtype=f32)
            phase = torch.pi * torch.rand((), generator=g, dtype=f32)
            x = 10 * torch.rand(n, 1, generator=g, dtype=f32) - 5
            y = amp * torch.sin(x - phase)
        elif self.model == "transformer":
            # Sequences of 5 steps of 2 features; the target weighs a sine of the first feature
            # by the second, averaged over the steps, with a task's own amplitude and phase.
            amp = 0.5 + torch.rand((), generator=g, dtype=f32)
            phase = torch.pi * torch.rand((), generator=g, dtype=f32)
            x = torch.randn(n, 5, 2, generator=g, dtype=f32)
            y = amp * (torch.sin(x[..., 0] + phase) * x[..., 1]).mean(dim=1)
        else:
            protos = torch.randn(3, 1, 8, 8, generator=g, dtype=f32)
            y = torch.arange(n) % 3
            x = protos[y] + 0.5 * torch.randn(n, 1, 8, 8, generator=g, dtype=f32)
        x = x.to(self.dtype)
        y = y if self.model == "conv" else y.to(self.dtype)
        s, q = slice(0, self.n_support), slice(self.n_support, n)
        return Task(Batch(x[s], y[s], self.n_support), Batch(x[q], y[q], self.n_query))

    def tasks(self) -> list[Task]:
        return [self.task(i) for i in range(self.n_tasks)]

    def build_algorithm(self) -> Algorithm:
        """The algorithm module around a fresh model (its parameters are the meta-parameters)."""
        if self.batchnorm and self.model != "conv":
            raise ValueError("batchnorm scenarios use the conv model")
        # iMAML's cg_tol 1e-13: converged far below the 1e-10 agreement checked between
        # world sizes.
        settings = Settings(
            inner_lr=self.inner_lr,
            steps=self.steps,
            first_order=self.first_order,
            lam=self.lam,
            cg_steps=self.cg_steps,
            cg_tol=1e-13,
            memory=self.memory,
            optimizer=self.optimizer,
            clip=self.clip,
            ways=3 if self.model == "conv" else None,
            schedule_steps=self.schedule_steps,
        )
        if self.algorithm == "cavia":  # its model takes a context: not a registry name
            from ..algorithms import CAVIA

            algorithm: Algorithm = CAVIA(
                self.build_model(), context=2, inner_lr=self.inner_lr, steps=self.steps,
                first_order=self.first_order, memory=self.memory,
                optimizer=settings.inner_optimizer(),
            ).to(self.dtype)  # fmt: skip
        else:
            algorithm = build(self.algorithm, self.build_model(), settings).to(self.dtype)
        algorithm.at_step(self.meta_step)
        if self.batched is not None:
            from ..algorithms import MAML

            assert isinstance(algorithm, MAML), "batched is a setting of MAML"
            algorithm.batched = self.batched
        return algorithm


def run(problem: Problem) -> dict:
    """One meta-step of ``problem`` on this rank: the global loss, the meta-gradient (see
    :func:`meta_gradient`) and the model's buffers after the step."""
    learner = MetaDDP(
        problem.build_algorithm(),
        Mesh.for_layout(problem.layout),
        deterministic=problem.deterministic,
        chunks=problem.chunks,
        shard=problem.shard,
        check=problem.check,
        unit_bytes=DEFAULT_UNIT_BYTES if problem.unit_bytes is None else problem.unit_bytes,
    )
    loss = learner.meta_loss(learner.shard(problem.n_tasks, problem.task), problem.loss_fn)
    loss.backward()
    learner.sync_grads()
    algorithm = learner.module
    assert isinstance(algorithm, Algorithm)
    in_model = {id(b) for b in algorithm.model.buffers()}
    with learner.gathered():  # sharded: the full meta-gradient, for the comparison
        grads = meta_gradient(algorithm)
    return {
        "loss": float(learner.global_value(loss)),
        "grads": grads,
        "buffers": {k: b.detach().clone() for k, b in algorithm.model.named_buffers()},
        # The algorithm's own (MAML++'s per-step running statistics).
        "own_buffers": {
            k: b.detach().clone() for k, b in algorithm.named_buffers() if id(b) not in in_model
        },
    }


def meta_gradient(algorithm: Algorithm) -> dict[str, Tensor]:
    """Every meta-parameter's gradient: the model's by their names in the model, any other
    (learned learning rates) by their names in the algorithm module (``lr.rates.0``...)."""
    in_model = {id(p): k for k, p in algorithm.model.named_parameters()}
    declared = getattr(algorithm, "not_reached", None)
    unused = declared() if callable(declared) else set()  # by design (MAML++'s replaced ones)
    grads = {}
    for k, p in algorithm.named_parameters():
        if k in unused:
            continue
        assert p.grad is not None, f"{k} has no meta-gradient"
        grads[in_model.get(id(p), k)] = p.grad.detach().clone()
    return grads


# --- The question this project answers: a batch of 8 split over ranks, one inner step, lr 1. ---


class SeedNet(nn.Module):
    """The user's ``Net2``: one bias-free linear unit on 4 features.

    Their ``forward`` returned ``self.conv(x).mean()``; here it returns one value per sample,
    whose global mean is that same loss, so each rank can take its share.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Linear(4, 1, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x).mean(dim=-1)


def seed_data(n: int = 100) -> Tensor:
    """The user's ``Datax``: item i is ``[0.01, 10, 0.4, 33] + i``."""
    return torch.tensor([0.01, 10, 0.4, 33]) + torch.arange(n, dtype=torch.float32)[:, None]


@dataclasses.dataclass(frozen=True)
class SeedProblem:
    """``iterations`` meta-steps of the user's objective ``l1(w) + l2(w - lr * grad l1(w))``."""

    second_order: bool = False
    iterations: int = 1
    batch_size: int = 8
    inner_lr: float = 1.0
    outer_lr: float = 1e-3


def run_seed(problem: SeedProblem) -> dict:
    """The user's meta-step with metaddp: returns weight, ``grad2`` history and losses."""
    torch.manual_seed(1234)
    seed_net = SeedNet()
    net = MetaDDP(seed_net)  # every rank splits every batch: sample-parallel
    opt = torch.optim.SGD(net.parameters(), lr=problem.outer_lr)
    data, mesh = seed_data(), net.mesh
    linear = seed_net.conv[0]
    assert isinstance(linear, nn.Linear)
    w = linear.weight
    out: dict[str, Any] = {"grad2": [], "loss1": [], "loss2": []}
    for it in range(problem.iterations):
        batch = data[it * problem.batch_size : (it + 1) * problem.batch_size]
        # This rank's part; the model's outputs are the losses, so the inputs stand in for
        # targets.
        part = Batch.split(batch, batch, mesh.sample_index, mesh.samples)
        opt.zero_grad()
        l1 = share(net(part.x), part)
        # l1's graph is kept: the objective backpropagates through l1 itself a second time.
        g = net.grad(l1, {"conv.0.weight": w}, retain_graph=True, create_graph=problem.second_order)
        l2 = share(call(net.module, {k: w - problem.inner_lr * g[k] for k in g}, part.x), part)
        (l1 + l2).backward()
        net.sync_grads()
        assert w.grad is not None
        out["grad2"].append(float(w.grad[0, 0]))
        out["loss1"].append(float(global_value(l1)))
        out["loss2"].append(float(global_value(l2)))
        opt.step()
    out["weight"] = w.detach().clone()
    return out


# --- Bilevel problems: a data-reweighting lookahead with a learned weight decay. ---


class Weighting(nn.Module):
    """Meta-Weight-Net's weighting: a small network from a sample's loss to its weight in
    (0, 1) (Shu et al. 2019), and a learned log weight decay of the inner objective."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 6), nn.Tanh(), nn.Linear(6, 1), nn.Sigmoid())
        self.log_decay = nn.Parameter(torch.tensor(-2.0))

    def forward(self, losses: Tensor) -> Tensor:
        return self.net(losses.detach().unsqueeze(1)).squeeze(1)


MOMENTUM = 0.9  # the inner SGD's momentum where a scenario asks for it
PROXIMAL = 2.0  # the proximal strength of the scenarios that start from the meta-parameters


@dataclasses.dataclass(frozen=True)
class BilevelProblem:
    """A bilevel meta-step: ``n_problems`` reweighting problems (noisy inner batch, clean
    outer batch), K inner steps, one hypergradient method, one layout."""

    method: str = "unrolled"  # a name of metaddp.algorithms.METHODS
    steps: int = 3
    inner_lr: float = 0.3
    optimizer: str = "sgd"  # "sgd", "momentum" (0.9, as torch.optim.SGD) or "adam"
    start: str = "current"  # "current" (a lookahead) or "outer" (MAML-like)
    n_problems: int = 1
    n_inner: int = 7
    n_outer: int = 3
    layout: str = "sample"
    dtype: torch.dtype = torch.float64
    seed: int = 0
    memory: str | Replay = "default"  # or "low", or a Replay tree of kept states
    minibatch: int | None = None  # each inner step on this many samples (Minibatches)
    penalty: bool = True  # the learned weight decay (and proximal term) in the inner loss
    shard: bool = False  # the model's weights sharded over the sample axis
    unit_bytes: int | None = None  # sharded: MetaDDP's unit_bytes (None: its default)

    def method_options(self) -> dict[str, Any]:
        """The method's own settings: fixed iterations, so every run takes the same iterate
        (and the CG damping keeps its system positive definite away from a minimum)."""
        table: dict[str, dict[str, Any]] = {
            "truncated": {"last": 2},
            "implicit-cg": {"iterations": 6, "damping": 1.0},
            "neumann": {"iterations": 6, "alpha": self.inner_lr},
            "t1t2": {"r": 0.01},
            "sama": {"r": 0.01},
        }
        return table.get(self.method, {})

    def build_method(self) -> Any:
        from ..algorithms import METHODS

        return METHODS[self.method](**self.method_options())

    def build_model(self) -> tuple[nn.Module, Weighting]:
        torch.manual_seed(self.seed)
        net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(self.dtype)
        return net, Weighting().to(self.dtype)

    def build_algorithm(self) -> Algorithm:
        from ..algorithms import Bilevel, Minibatches
        from ..inner import adam, sgd

        net, weighting = self.build_model()
        if not self.penalty:  # the learned decay is the penalty's: nothing else reads it
            weighting.log_decay.requires_grad_(False)

        def weighted(pred: Tensor, y: Tensor) -> Tensor:
            losses = ce_per_sample(pred, y)
            return weighting(losses) * losses

        theta = dict(net.named_parameters())

        def decay(fast: dict[str, Tensor]) -> Tensor:
            out = 0.5 * weighting.log_decay.exp() * sum((w * w).sum() for w in fast.values())
            if self.start == "outer":  # iMAML's proximal term: the start's one path
                out = out + 0.5 * PROXIMAL * sum(((fast[k] - theta[k]) ** 2).sum() for k in theta)
            return out

        opt = {
            "sgd": lambda: sgd(self.inner_lr),
            "momentum": lambda: sgd(self.inner_lr, momentum=MOMENTUM),
            "adam": lambda: adam(self.inner_lr),
        }[self.optimizer]()
        return Bilevel(
            net, outer=weighting, inner_loss=weighted, outer_loss=ce_per_sample,
            penalty=decay if self.penalty else None,
            start=self.start, steps=self.steps, optimizer=opt, method=self.build_method(),
            memory=self.memory,
            minibatches=None if self.minibatch is None else Minibatches(self.minibatch, self.seed),
        )  # fmt: skip

    def task(self, index: int) -> Task:
        """Problem ``index``: two Gaussian classes; 3 of the inner labels flipped."""
        g = generator_for(self.seed, index)
        n = self.n_inner + self.n_outer
        y = torch.arange(n) % 2
        x = torch.randn(n, 3, generator=g, dtype=torch.float32) + 1.5 * y[:, None].float()
        noisy = y.clone()
        noisy[:3] = 1 - noisy[:3]  # label noise in the inner batch only
        x = x.to(self.dtype)
        s, q = slice(0, self.n_inner), slice(self.n_inner, n)
        return Task(Batch(x[s], noisy[s], self.n_inner), Batch(x[q], y[q], self.n_outer))


def run_bilevel(problem: BilevelProblem) -> dict:
    """One hypergradient step of ``problem`` on this rank: the global outer loss and every
    outer variable's gradient (by name in the Bilevel module)."""
    learner = MetaDDP(
        problem.build_algorithm(),
        Mesh.for_layout(problem.layout),
        shard=problem.shard,
        unit_bytes=DEFAULT_UNIT_BYTES if problem.unit_bytes is None else problem.unit_bytes,
    )
    loss = learner.meta_loss(learner.shard(problem.n_problems, problem.task))
    loss.backward()
    learner.sync_grads()
    with learner.gathered():  # sharded: the full gradients, for the comparison
        grads = {
            k: p.grad.detach().clone()
            for k, p in learner.module.named_parameters()
            if p.grad is not None
        }
    return {"loss": float(learner.global_value(loss)), "grads": grads}
