"""``MetaDDP``: the place ``DistributedDataParallel`` had, for meta-learning.

DDP reduces gradients with hooks on the leaves' gradient accumulators, divides by the world
size, and cannot be differentiated through. Here the module runs untouched; the inner-loop
reductions are differentiable collectives (:meth:`MetaDDP.reduce`) that the wrapped algorithm
uses without being told; and after the outer backward :meth:`MetaDDP.sync_grads` SUM-reduces
every leaf's ``.grad``. Because every rank's loss is its share of the global mean, that sum
*is* the global meta-gradient.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .. import _host
from .._adapt import grad
from .._binding import LOCAL, Collectives, bind, unbind
from .._data import Batch, MetaBatch, Shard, Task
from .._functional import refuse_data_parallel, require_trained
from .._types import LossFn, MetaAlgorithm, Params, identity_reduce
from ..inner import InnerOptimizer, learned_rates
from ._batchnorm import BatchNormSync, has_batchnorm, sync_batchnorm
from ._check import from_env
from ._collectives import (
    DEFAULT_BUCKET_BYTES,
    Phase,
    all_reduce_sum,
    broadcast_,
    global_count,
    global_value,
    group_size,
    launch_sum,
    settings_salt,
)
from ._exact import DEFAULT_CHUNKS, ExactSums
from ._guards import StepGuards
from ._mesh import Mesh
from ._overlap import GradReducer


def _take(batch: Batch, samples: range) -> Batch:
    return Shard(
        batch.x[samples.start : samples.stop], batch.y[samples.start : samples.stop], batch.n
    )


def _deterministic_kernels(module: nn.Module) -> Callable[[], None]:
    """Kernels whose results do not depend on the run or on the batch's shape; returns what
    puts the process's settings back as they were (``MetaDDP.release``). On the CPU: no
    oneDNN (its convolutions change with the number of chunks stacked in one call,
    measured); the CPU kernels metaddp runs have no run-to-run variation. On a GPU also
    PyTorch's deterministic algorithms (no atomic adds) and cuDNN's deterministic choices."""
    cudnn = torch.backends.cudnn
    was = (
        torch.backends.mkldnn.enabled,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
        cudnn.deterministic,
        cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    if any(p.is_cuda for p in module.parameters()):
        # cuBLAS picks its reduction split by workspace unless told a fixed one; read when its
        # handle is made, so a process that already ran matrix products keeps its own.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Filling every new tensor with NaN (on by default with the above) costs a pass over
        # memory per allocation and makes no result more deterministic here: nothing reads
        # memory it did not write.
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
        cudnn.deterministic = True
        cudnn.benchmark = False

    def restore() -> None:
        torch.backends.mkldnn.enabled = was[0]
        torch.use_deterministic_algorithms(was[1], warn_only=was[2])
        torch.utils.deterministic.fill_uninitialized_memory = was[3]  # type: ignore[attr-defined]
        cudnn.deterministic, cudnn.benchmark = was[4], was[5]
        if was[6] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = was[6]

    return restore


def _refuse_rates_outside(module: nn.Module, deterministic: bool) -> None:
    """Raise if the algorithm's inner optimizer learns rates (tensors that require grad,
    given to ``sgd`` or ``adam``) that the wrapper would not keep alike on every rank."""
    optimizer = getattr(module, "optimizer", None)
    rates = learned_rates(optimizer) if isinstance(optimizer, InnerOptimizer) else ()
    if not rates:
        return
    if deterministic:
        raise ValueError(
            "deterministic mode learns inner learning rates through learn_lr only (those rates "
            "are spread to every task and summed order-free): build the algorithm with "
            "learn_lr='scalar', 'tensor' or 'parameter' instead of giving its optimizer rates "
            "that require grad"
        )
    ours = {id(p) for p in module.parameters()}
    outside = [r for r in rates if id(r) not in ours]
    if outside:
        raise ValueError(
            f"the inner optimizer learns {len(outside)} learning rate(s) that are not "
            "parameters of the wrapped algorithm: sync_grads() would not sum their gradients "
            "over the ranks, and every rank would train its own. Build the algorithm with "
            "learn_lr='scalar', 'tensor' or 'parameter' (its rates are then its parameters), "
            "or register the rates on it as nn.Parameters"
        )


class MetaDDP(nn.Module):
    """Keep a module's meta-parameters identical on every rank and sum their gradients.

    Args:
        module: a meta-learning algorithm (:class:`metaddp.MAML`, ``MetaSGD``, ``ANIL``,
            ``Reptile``, ``IMAML``) holding the model, or any ``nn.Module``.
        mesh: how ranks share the work (:class:`metaddp.Mesh`); default: sample-parallel.
        broadcast: copy rank 0's parameters and buffers to every rank at construction. With
            ``False``, the ranks' weights are compared instead and a difference is an error.
        allow_unused: leave ``.grad`` as ``None`` for a parameter that got no gradient on any
            rank, instead of raising.
        bucket_bytes: size of the flattened buckets each collective moves.
        overlap: start each bucket's gradient SUM during the outer backward, as soon as its
            gradients are final, and wait for them in :meth:`sync_grads`. Early starts begin
            only after every rank ran exactly one backward per ``sync_grads()`` for two steps
            in a row. A loop that calls ``backward()`` once per task (the ``clone()`` /
            ``adapt()`` style) is seen, and its sums then start in ``sync_grads()``: the same
            result, without the overlap. ``with learner.no_sync():`` accumulates explicitly.
        check: check mode (default: the ``METADDP_CHECK`` environment variable). Before every
            forward of a module with parameters, the weights it runs on must be identical on
            the ranks that split a task's samples, and :meth:`meta_loss` checks that every
            task's shards add up to its global sizes; a difference raises
            :class:`metaddp.OutOfSyncError` naming the tensor. Costs nothing when off.
        deterministic: the same bits at any number of processes and layout (MAML,
            first-order MAML, Meta-SGD): every batch is cut by global index into at most
            ``chunks`` chunks, each computed alone, and every sum is a fixed-point integer
            sum (:mod:`metaddp.algorithms._exact`). :meth:`shard` cuts tasks into whole
            chunks; the meta-gradient is complete on every rank after the backward, and
            :meth:`sync_grads` only reads the step's checks. It turns oneDNN off (whose CPU
            convolutions change with the batch's shape) and, for a module on a GPU, sets
            ``torch.use_deterministic_algorithms(True)``; bits agree for the same torch
            build, device type and thread count. Costs in BENCHMARKS.md.
        chunks: with ``deterministic``, the most chunks a batch is cut into. Keep it fixed
            across the runs to compare; sample axes longer than it leave ranks idle.

    What the wrapper does to the module, so that results never depend on the world size:

    - It binds its reductions to the module: ``learner.meta_loss(tasks, loss_fn)`` (or
      ``learner.module.meta_loss(...)``), ``clone()`` and ``adapt()`` reduce inner gradients
      over the sample axis and count the meta-batch's tasks globally, without a keyword.
    - Every BatchNorm layer takes the statistics of the task's whole batch, summed over the
      ranks that split it (the identity on one rank). Per-shard statistics would make the
      result depend on the split, so they are never used; the cost is one small
      differentiable SUM per BatchNorm layer per forward.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh | None = None,
        *,
        broadcast: bool = True,
        allow_unused: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        check: bool | None = None,
        deterministic: bool = False,
        chunks: int = DEFAULT_CHUNKS,
    ) -> None:
        super().__init__()
        if isinstance(module, (DistributedDataParallel, nn.DataParallel)):
            raise TypeError(
                f"MetaDDP takes the place of {type(module).__name__}: pass the bare module "
                "(`model.module`) and let MetaDDP keep ranks in sync. DDP's gradient hooks "
                "neither reduce autograd.grad results nor let autograd see the reduction."
            )
        if isinstance(module, MetaDDP):
            raise TypeError("this module is already wrapped in MetaDDP")
        refuse_data_parallel(module)
        require_trained(module)
        _refuse_rates_outside(module, deterministic)
        self.module = module
        self.mesh = mesh if mesh is not None else Mesh.create()
        self.allow_unused = allow_unused
        self.bucket_bytes = bucket_bytes
        self.checking = from_env() if check is None else bool(check)
        self.guards = StepGuards(module, self.mesh, every_step=self.checking)
        state = list(module.parameters()) + list(module.buffers())
        if broadcast:
            broadcast_(state, src=0, group=self.mesh.group)
        else:
            self.check_in_sync()
        self.exact: ExactSums | None = None
        self._restore_settings: Callable[[], None] | None = None  # what a mode changed
        # Each trained parameter's .grad as sync_grads() left it, with its version: while a
        # .grad is that tensor, unchanged, it holds a SUM over the ranks already.
        self._summed: dict[int, tuple[weakref.ref[Tensor], int]] = {}
        if deterministic:
            self.exact = ExactSums(self.mesh, chunks)
            self._restore_settings = _deterministic_kernels(module)
        # Hooks only where there is something to overlap with: on one rank the sum is a copy.
        self._reducer: GradReducer | None = None
        if overlap and group_size(self.mesh.group) > 1 and self.exact is None:
            trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            if trained:
                self._reducer = GradReducer(
                    trained,
                    self.mesh.group,
                    bucket_bytes,
                    salt=self._settings_salt,
                    rider=self.guards.before_sum,
                )
        self._collectives = Collectives(
            self.reduce,
            self._count_tasks,
            repr(self.mesh),
            step_ends_in_sync=True,
            exact=self.exact,
            split=True,
            check_loss=self.guards.loss_out,
            samples_split=self.mesh.samples > 1,
            check_share=self.guards.share_in,
        )
        bind(module, self._collectives)
        self._batchnorm: BatchNormSync | None = (
            sync_batchnorm(module, self._batch_statistics) if has_batchnorm(module) else None
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def reduce(self, tensors: list[Tensor]) -> list[Tensor]:
        """Differentiable SUM over the ranks that share a task's samples (for inner loops)."""
        return all_reduce_sum(tensors, group=self.mesh.sample_group, bucket_bytes=self.bucket_bytes)

    def _batch_statistics(self, tensors: list[Tensor]) -> list[Tensor]:
        # Deterministic mode's chunks pool their statistics order-free; elsewhere (and for
        # adapt() in that mode) the differentiable SUM.
        if self.exact is not None and self.exact.pooling():
            return self.exact.pool(tensors)
        return self.reduce(tensors)

    def _settings_salt(self) -> int:
        # The wrapped module's settings (an algorithm's inner steps, learning rate...) enter
        # the meta-gradient SUM's tag: ranks whose settings differ fail there, in every
        # layout, even where no inner-loop collective would have told them apart.
        signature = getattr(self.module, "signature", None)
        return settings_salt(signature()) if callable(signature) else 0

    def _count_tasks(self, n_local: int) -> int:
        # Ranks of one sample group hold the same tasks; the task axis holds different ones.
        return global_count(n_local, self.mesh.task_group)

    def capture_refusal(self) -> str | None:
        """Why this learner's meta-step cannot be recorded in a CUDA graph, or ``None``."""
        if self.exact is not None:
            return "deterministic mode keeps per-step state on the host"
        if self._reducer is not None:
            return (
                "overlapped gradient sums start from backward hooks on the host; build "
                "MetaDDP(..., overlap=False)"
            )
        if self.checking:
            return "check mode compares sizes and weights across ranks on the host"
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            backend = torch.distributed.get_backend()
            if backend != "nccl":
                return (
                    f"{backend} collectives cannot be recorded in a CUDA graph; across "
                    "processes that needs the NCCL backend"
                )
        return None

    def release(self) -> None:
        """Undo what the wrapper did to the module (bindings, BatchNorm, hooks) and to the
        process (deterministic mode's kernel settings)."""
        unbind(self.module)
        if self._restore_settings is not None:
            self._restore_settings()
            self._restore_settings = None
        if self._batchnorm is not None:
            self._batchnorm.remove()
            self._batchnorm = None
        self.guards.remove()
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = None

    @contextlib.contextmanager
    def local(self) -> Iterator[nn.Module]:
        """Run the module on this process alone inside the block (whole tasks, no collective):
        identity reductions, plain batch statistics, no check. For work one rank does by
        itself, such as drawing a figure after training."""
        bind(self.module, LOCAL)
        if self._batchnorm is not None:
            self._batchnorm.reduce = identity_reduce
        try:
            with self.guards.local():
                yield self.module
        finally:
            bind(self.module, self._collectives)
            if self._batchnorm is not None:
                self._batchnorm.reduce = self._batch_statistics

    # --- the front door ---------------------------------------------------------------

    def _algorithm(self, what: str) -> MetaAlgorithm:
        if not isinstance(self.module, MetaAlgorithm):
            raise TypeError(
                f"MetaDDP.{what} needs a meta-learning algorithm, but this wraps a "
                f"{type(self.module).__name__}: wrap metaddp.MAML(model, ...) (or MetaSGD, "
                "ANIL, Reptile, IMAML) instead of the bare model"
            )
        return self.module

    def shard(
        self, tasks: int | Sequence[Task], make_task: Callable[[int], Task] | None = None
    ) -> MetaBatch:
        """This rank's part of a global meta-batch: its task group's tasks, each cut to its
        share of the samples. ``tasks`` is the whole meta-batch, or its size with
        ``make_task(i)`` building global task ``i`` (then only this rank's tasks are built)."""
        batch = self._cut(tasks, make_task)
        self.guards.tasks_in(batch)
        return batch

    def _cut(
        self, tasks: int | Sequence[Task], make_task: Callable[[int], Task] | None
    ) -> MetaBatch:
        m = self.mesh
        if self.exact is None:
            return MetaBatch.shard(
                tasks,
                make_task,
                task_index=m.task_index,
                task_parts=m.tasks,
                sample_index=m.sample_index,
                sample_parts=m.samples,
            )
        # Deterministic mode: every batch cut into whole chunks (ExactSums.cut).
        whole = MetaBatch.shard(tasks, make_task, task_index=m.task_index, task_parts=m.tasks)
        cut = self.exact.cut
        out = MetaBatch(
            [Task(*(_take(b, cut(b.n).samples) for b in t)) for t in whole],
            whole.n,
            whole.indices,
        )
        out.source = whole.source
        return out

    def meta_loss(self, tasks: Sequence[Task], loss_fn: LossFn) -> Tensor:
        """This rank's share of the meta-batch's mean query loss, through the wrapped algorithm.

        Args:
            tasks: this rank's tasks, each cut to this rank's samples: a
                :class:`metaddp.MetaBatch` (from :meth:`shard`), or a list (then the
                global task count is one integer SUM over the task axis).
            loss_fn: per-sample loss (``reduction='none'``).

        Then ``loss.backward()``, :meth:`sync_grads` and ``optimizer.step()``.
        """
        algorithm = self._algorithm("meta_loss")
        self.guards.tasks_in(tasks)
        searches = self.guards.searches
        with self.guards.own_loop():
            loss = algorithm.meta_loss(tasks, loss_fn)
        if self.guards.searches == searches:  # an algorithm that does not call loss_out itself
            self.guards.loss_out(loss, loss_fn)
        if self._summed and loss.requires_grad:
            loss.register_hook(self._before_backward)
        return loss

    def _before_backward(self, grad: Tensor) -> None:
        # Runs as the backward of a meta-loss starts, before any .grad is added to.
        if held := self._still_summed():
            self._refuse_summed(held, "this backward would add to them")

    def _still_summed(self) -> list[str]:
        """The trained parameters whose ``.grad`` is still the SUM the last sync_grads()
        wrote, untouched since (not zeroed, replaced or added to)."""
        if not self._summed:
            return []
        held = []
        for name, p in self.module.named_parameters():
            kept, g = self._summed.get(id(p)), p.grad
            if kept is not None and g is not None and kept[0]() is g and g._version == kept[1]:
                held.append(name)
        return held

    def _refuse_summed(self, names: list[str], what: str) -> None:
        _host.discard()  # the step ends here: its pending checks go with it
        raise RuntimeError(
            "the gradients of "
            + ", ".join(names[:5])
            + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            + f" still hold the SUM over ranks that the last sync_grads() wrote, and {what}: "
            "sync_grads() would sum them again, multiplying them by the number of ranks. Zero "
            "the gradients once the optimizer has used them (optimizer.zero_grad()); to "
            "accumulate several meta-batches, run backward() on each (all but the last inside "
            "`with learner.no_sync():`) and sync_grads() once, after the last."
        )

    def adapt(self, support: Batch, loss_fn: LossFn, *, steps: int | None = None) -> Params:
        """The wrapped algorithm's fast weights after adapting to ``support``."""
        batches = {"the support": support}
        self.guards.refuse_whole(batches)
        if self.guards.schedule.due():
            self.guards.check_batch_sizes(batches)
        with self.guards.own_loop():
            return self._algorithm("adapt").adapt(support, loss_fn, steps=steps)

    def clone(self) -> Any:
        """A learner with its own fast weights (learn2learn's ``clone()``), reducing its inner
        gradients over the sample axis: ``learner.adapt(share)``, ``learner(x)``."""
        algorithm = self._algorithm("clone")
        self._not_exact("clone()")
        clone = getattr(algorithm, "clone", None)
        if clone is None:
            raise TypeError(f"{type(algorithm).__name__} has no clone()")
        if self._reducer is not None:
            # Clone loops run one backward per task: sums cannot start during a backward.
            self._reducer.accumulates = True
        return clone()

    @overload
    def grad(
        self,
        loss: Tensor,
        params: Mapping[str, Tensor],
        *,
        create_graph: bool = ...,
        retain_graph: bool | None = ...,
    ) -> Params: ...
    @overload
    def grad(
        self,
        loss: Tensor,
        params: Sequence[Tensor],
        *,
        create_graph: bool = ...,
        retain_graph: bool | None = ...,
    ) -> list[Tensor]: ...
    def grad(self, loss, params, *, create_graph=True, retain_graph=None):
        """For hand-written inner loops: the gradient of the *global* loss.

        ``torch.autograd.grad(loss, params)`` followed by the differentiable SUM over the
        ranks that split the batch, so every rank gets the same, global gradient.
        ``loss`` must be this rank's share (:func:`metaddp.share`). ``create_graph=True``
        keeps second-order terms; a first-order step whose loss is backpropagated again
        later needs ``retain_graph=True``.
        """
        self._not_exact("grad()")
        self.guards.share_in(loss, "learner.grad(loss, params)")
        return grad(
            loss, params, reduce=self.reduce, create_graph=create_graph, retain_graph=retain_graph
        )

    def _not_exact(self, what: str) -> None:
        if self.exact is not None:
            raise TypeError(
                f"MetaDDP.{what} is not available in deterministic mode, whose meta-gradient "
                "comes whole from learner.meta_loss(...): a hand-written loop would sum in "
                "float order. Use meta_loss, or build MetaDDP without deterministic=True"
            )

    def global_value(self, share: Tensor) -> Tensor:
        """The global value of a share (a loss, for logging): SUM over all ranks, detached."""
        return global_value(share, self.mesh.group)

    def check_sizes(self, tasks: Sequence[Task]) -> None:
        """Raise :class:`metaddp.OutOfSyncError` unless every task's shards, summed over the
        sample axis, are its declared global sizes (three small collectives)."""
        self.guards.check_sizes(tasks)

    # --- gradients ----------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside, followed
        by :meth:`sync_grads`, sums the accumulated gradients (as ``DDP.no_sync``)."""
        if self._reducer is None:
            yield
            return
        with self._reducer.paused():
            yield

    def check_in_sync(self) -> None:
        """Raise if any parameter or buffer differs between ranks (one collective)."""
        self.guards.check_in_sync()

    def sync_grads(self, values: Tensor | None = None) -> list[float]:
        """SUM every meta-parameter's ``.grad`` over all ranks of the mesh (bucketed).

        Call after the outer ``backward()`` and before ``optimizer.step()``. A parameter with
        no gradient on some ranks counts as zero there; one with no gradient on any rank is
        an error unless ``allow_unused``.

        This ends the meta-step: its checks, left on the device (a non-finite inner
        gradient, ranks out of step), are read here, with one host read for the whole step.

        Args:
            values: a 1-d tensor (a loss share, stop votes...) to SUM over all ranks as well,
                in the same read: no extra wait for the device.

        Returns:
            The SUM of ``values`` on the host (empty without ``values``).
        """
        extra = [] if values is None else [values.detach().reshape(-1)]
        if self.exact is not None:
            got = self._finish_exact(extra)
        elif self._reducer is not None:
            if held := self._still_summed():
                self._refuse_summed(held, "no backward has added to them since")
            missing, got = self._reducer.finish(extra)
            self._check_trained_unchanged()
            self._raise_missing(missing)
            self._remember_summed()
            self.guards.after_sum(self._reducer.rode)
            return got
        else:
            got = self._sum_grads(extra)
        # The guards' meta-loss rode last in the same SUM: judged alike on every rank.
        self.guards.after_sum(got[-1])
        return got[:-1]

    def _sum_grads(self, extra: list[Tensor]) -> list[float]:
        """The SUM of every trained parameter's ``.grad``, with ``extra`` and the guards' value
        in the same buckets; returns their sums."""
        if held := self._still_summed():
            self._refuse_summed(held, "no backward has added to them since")
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else p.detach().new_zeros(p.shape) for p in params]
        # One has-gradient flag per parameter rides in the same buckets as the gradients.
        has_grad = [float(p.grad is not None) for p in params]
        flags = _host.upload(has_grad, params[0]) if params else torch.zeros(0)
        tail = torch.cat([flags, *(v.to(flags) for v in extra), self.guards.before_sum(flags)])
        reduced = launch_sum(
            grads + [tail],
            self.mesh.group,
            self.bucket_bytes,
            Phase.GRADIENTS,
            self._settings_salt(),
        ).wait()
        # The step's one host read: these flags and every check the step left on the device.
        (got,) = _host.read(reduced[-1])
        names = {id(p): n for n, p in self.module.named_parameters()}
        missing = [names[id(p)] for p, f in zip(params, got, strict=False) if f == 0]
        self._raise_missing(missing)
        with torch.no_grad():
            for p, g, f in zip(params, reduced, got, strict=False):
                if f > 0:
                    p.grad = g if p.grad is None else p.grad.copy_(g)
        self._remember_summed()
        return got[len(params) :]

    def _remember_summed(self) -> None:
        self._summed = {
            id(p): (weakref.ref(p.grad), p.grad._version)
            for p in self.module.parameters()
            if p.grad is not None
        }

    def _finish_exact(self, extra: list[Tensor]) -> list[float]:
        # Deterministic mode: the backward of meta_loss already summed the meta-gradient on
        # every rank (ExactSums.spread_tasks); only the values and the step's checks remain.
        assert self.exact is not None
        if not self.exact.used:
            _host.discard()
            raise RuntimeError(
                "deterministic mode: sync_grads() follows the backward of learner.meta_loss(...), "
                "which sums the meta-gradient itself; no meta_loss ran since the last "
                "sync_grads(), so these gradients would be one rank's"
            )
        self.exact.used = False
        params = [p for p in self.module.parameters() if p.requires_grad]
        like = params[0].detach() if params else torch.zeros(0)
        tail = torch.cat([*(v.to(like) for v in extra), self.guards.before_sum(like)])
        # The settings' salt in this SUM's tag: ranks whose algorithms differ fail here, as
        # they do at the default mode's gradient SUM.
        summed = launch_sum(
            [tail], self.mesh.group, phase=Phase.GRADIENTS, salt=self._settings_salt()
        ).wait()[0]
        (got,) = _host.read(summed)
        names = {id(p): n for n, p in self.module.named_parameters()}
        self._raise_missing([names[id(p)] for p in params if p.grad is None])
        return got

    def _check_trained_unchanged(self) -> None:
        assert self._reducer is not None
        now = [p for p in self.module.parameters() if p.requires_grad]
        if len(now) != len(self._reducer.params) or any(
            a is not b for a, b in zip(now, self._reducer.params, strict=True)
        ):
            raise ValueError(
                "the set of trained parameters (requires_grad=True) changed after MetaDDP was "
                "built; freeze or add parameters before wrapping the module, or build MetaDDP "
                "with overlap=False."
            )

    def _raise_missing(self, missing: list[str]) -> None:
        if missing and not self.allow_unused:
            raise ValueError(
                "no rank produced a gradient for: "
                + ", ".join(missing[:5])
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                + ". Call backward() on the meta-loss before sync_grads(); if these parameters "
                "are not meant to train, set requires_grad=False or build MetaDDP with "
                "allow_unused=True."
            )
