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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch
from torch import Tensor, nn

from .._adapt import grad
from .._binding import LOCAL, Collectives, bind, set_sharding, unbind
from .._data import Batch, BatchKey, MetaBatch, Task
from .._types import LossFn, MetaAlgorithm, Params, identity_reduce
from ._batchnorm import BatchNormSync, has_batchnorm, sync_batchnorm
from ._check import from_env
from ._collectives import (
    DEFAULT_BUCKET_BYTES,
    all_reduce_sum,
    broadcast_,
    counting,
    global_count,
    global_value,
    group_size,
    settings_salt,
)
from ._exact import DEFAULT_CHUNKS, ExactSums, deterministic_kernels
from ._guards import StepGuards, refuse_at_construction
from ._mesh import Mesh
from ._sharded import (
    DEFAULT_UNIT_BYTES,
    ROWS,
    ShardedReduce,
    Sharding,
    fsdp_refusal,
    has_dtensors,
    is_dtensor,
    local,
    refuse_sharded,
)
from ._sums import BucketedSum, ExactSum, OverlappedSum, ShardedSum, Summing


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
        check: check mode (default: the ``METADDP_CHECK`` environment variable): the checks
            that compare ranks (:mod:`metaddp.distributed._guards`) run on every meta-step
            instead of the first and a sparse sample of later ones, and before every forward
            of a module with parameters the weights it runs on must be identical on the ranks
            that split a task's samples, inside metaddp's own loops too.
        deterministic: the same bits at any number of processes and layout (every built-in
            algorithm; docs/algorithms.md lists what it refuses): every batch is cut by global
            index into at most ``chunks`` chunks, each computed alone, and every sum is a
            fixed-point integer sum (:mod:`metaddp.algorithms._exact`). :meth:`shard` cuts tasks
            into whole chunks; the meta-gradient is complete on every rank after the backward,
            and :meth:`sync_grads` only reads the step's checks. It turns oneDNN off (whose CPU
            convolutions change with the batch's shape) and, for a module on a GPU, sets
            ``torch.use_deterministic_algorithms(True)``; bits agree for the same torch build,
            device type and thread count. Costs in BENCHMARKS.md.
        chunks: with ``deterministic``, the most chunks a batch is cut into. Keep it fixed
            across the runs to compare; sample axes longer than it leave ranks idle.
        shard: keep only this rank's rows of every meta-parameter of the model (ZeRO-3 over
            the sample axis, :mod:`metaddp.distributed._sharded`): forwards gather them, the
            inner steps and the meta-gradient stay shards, and an optimizer built on
            ``learner.parameters()`` keeps state for the rows this rank holds. The same
            meta-gradient; each rank holds ``1/samples`` of the weights, gradients and
            optimizer state. The algorithms that declare it run sharded: every built-in
            one (Meta-SGD's learned rates cut with their weights, ANIL's body sharded and
            its head whole), unless configured with what reads whole weights (an inner
            optimizer that is not entry by entry, MAML++'s per-step BatchNorm, a
            :class:`metaddp.Bilevel` method other than ``Unrolled``: a ``ValueError`` says
            which; docs/algorithms.md); ``with learner.gathered():`` (on every rank) puts the
            full weights in the model, for evaluation or a checkpoint. A model sharded by
            FSDP2's ``fully_shard`` is sharded this way whatever ``shard`` says: its
            DTensors' rows are the shards and their ``.grad`` the meta-gradient's
            (sample layout only; docs/design.md).
        unit_bytes: with ``shard``, a layer whose weights come to fewer bytes is gathered
            with the other small ones at the start of every forward and kept whole in the
            autograd graph; larger layers are gathered as they run, and again for the
            backward. 0: every layer on its own.

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
        shard: bool = False,
        unit_bytes: int = DEFAULT_UNIT_BYTES,
    ) -> None:
        super().__init__()
        if isinstance(module, MetaDDP):
            raise TypeError("this module is already wrapped in MetaDDP")
        refuse_at_construction(module, deterministic)
        self.mesh = mesh if mesh is not None else Mesh.create()
        # A model sharded by FSDP2's fully_shard is adopted: sharded as shard=True shards,
        # its DTensors' rows the shards (distributed/_sharded.py).
        adopt = has_dtensors(module)
        try:
            model = refuse_sharded(module, deterministic) if shard or adopt else None
        except (TypeError, ValueError) as e:
            if adopt and not shard:  # said as what it is: the FSDP2 model is sharded
                raise type(e)(f"a model sharded by FSDP2 runs as with shard=True, and {e}") from e
            raise
        if adopt:
            assert model is not None
            inside = {id(p) for p in model.parameters()}
            outside = [
                n for n, p in module.named_parameters() if is_dtensor(p) and id(p) not in inside
            ]
            if outside:  # ANIL shards its body alone: a head cut by fully_shard has no gather
                raise TypeError(
                    f"a model sharded by FSDP2: {outside[0]!r} is a DTensor outside the part "
                    f"of the model that {type(module).__name__} shards: apply fully_shard to "
                    "that part alone"
                )
            why = fsdp_refusal(model, self.mesh.task_group, self.mesh.sample_group)
            if why is not None:
                raise TypeError(f"a model sharded by FSDP2: {why}")
        self.module = module
        self.bucket_bytes = bucket_bytes
        self.checking = from_env() if check is None else bool(check)
        self.guards = StepGuards(module, self.mesh, every_step=self.checking)
        # An FSDP2 model's DTensors hold each rank's own rows: not broadcast, not compared.
        state = [t for t in [*module.parameters(), *module.buffers()] if not is_dtensor(t)]
        if broadcast:
            broadcast_(state, src=0, group=self.mesh.group)
        else:
            self.check_in_sync()
        # Cut after the weights agree: every rank keeps its rows of the same tensors.
        self.sharding: Sharding | None = None
        if model is not None and (self.mesh.samples > 1 or adopt):
            self.sharding = Sharding(
                model, self.mesh.sample_group, unit_bytes=unit_bytes, adopt=adopt
            )
            self.sharding.cut()
            set_sharding(model, self.sharding)
            shards = set(map(id, self.sharding.parameters().values()))
            self.guards.sharded = (shards, self.mesh.task_group)
        self.exact = ExactSums(self.mesh, chunks) if deterministic else None
        # What a mode changed in the process, put back by release().
        self._restore_settings = deterministic_kernels(module) if deterministic else None
        # The gradient sum, chosen once. Overlapped only where there is something to overlap
        # with: on one rank the sum is a copy.
        how = Summing(
            module,
            self.mesh.group,
            bucket_bytes,
            self._settings_salt,
            self.guards.rider,
            allow_unused,
            _not_reached(module),
        )
        self.sums: BucketedSum | OverlappedSum | ExactSum | ShardedSum
        if self.exact is not None:
            self.sums = ExactSum(how, self.exact)
        elif self.sharding is not None:
            self.sums = ShardedSum(how, shards, self.mesh.task_group)
        elif overlap and group_size(self.mesh.group) > 1:
            self.sums = OverlappedSum(how)
        else:
            self.sums = BucketedSum(how)
        self._collectives = Collectives(
            self.reduce
            if self.sharding is None
            else ShardedReduce(self.sharding, self._sample_sum),
            self._count_tasks,
            repr(self.mesh),
            step_ends_in_sync=True,
            exact=self.exact,
            split=True,
            check_loss=self.guards.loss_out,
            samples_split=self.mesh.samples > 1,
            check_share=self.guards.share_in,
            note=self.guards.note,
            printing=self.guards.printing,
            counting=counting,
        )
        bind(module, self._collectives)
        self._batchnorm: BatchNormSync | None = (
            sync_batchnorm(module, self._batch_statistics) if has_batchnorm(module) else None
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def reduce(self, tensors: list[Tensor]) -> list[Tensor]:
        """Differentiable SUM over the ranks that share a task's samples (for inner loops).

        Sharded (``shard=True``), the gradients of shards are already the global
        gradient's rows (the gather's adjoint summed them), so they pass as they are; any
        other tensor is refused, since it would be one rank's."""
        if self.sharding is not None:
            return self.sharding.passed(tensors)
        return self._sample_sum(tensors)

    def _sample_sum(self, tensors: list[Tensor]) -> list[Tensor]:
        return all_reduce_sum(tensors, group=self.mesh.sample_group, bucket_bytes=self.bucket_bytes)

    def _batch_statistics(self, tensors: list[Tensor]) -> list[Tensor]:
        # Deterministic mode's chunks pool their statistics order-free; elsewhere (and for
        # adapt() in that mode) the differentiable SUM.
        if self.exact is not None and self.exact.pooling():
            return self.exact.pool(tensors)
        return self._sample_sum(tensors)

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
        if self.sharding is not None:
            return "the sharded layout's gathers are not recorded in CUDA graphs"
        if self.sums.capture_refusal is not None:
            return self.sums.capture_refusal
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
        self.sums.remove()
        if self.sharding is not None:  # the full weights back in the model: a collective
            self.sharding.remove()
            self.sharding = None

    def _saving(self) -> contextlib.AbstractContextManager[object]:
        # Sharded: graphs keep shards, and the backward gathers again (distributed/_regather).
        if self.sharding is None:
            return contextlib.nullcontext()
        return self.sharding.saving()

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        """With ``shard=True``: the full meta-parameters in the model inside the block, this
        rank's rows again after it (changes made inside are kept). A collective: every rank
        enters it. Evaluation on one rank (:meth:`local`) and plain ``model(x)`` calls go
        inside it. Without sharding, nothing happens."""
        if self.sharding is None:
            return contextlib.nullcontext()
        return self.sharding.gathered()

    @contextlib.contextmanager
    def local(self) -> Iterator[nn.Module]:
        """Run the module on this process alone inside the block (whole tasks, no collective):
        identity reductions, plain batch statistics, no check. For work one rank does by
        itself, such as drawing a figure after training. With ``shard=True``, inside
        :meth:`gathered` only (each rank holds its rows of the weights)."""
        if self.sharding is not None and not self.sharding.holding_full():
            raise RuntimeError(
                "learner.local() runs the model on this process alone, but with shard=True it "
                "holds this rank's rows of the weights: enter `with learner.gathered():` on "
                "every rank first, then local() inside it"
            )
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
        ``make_task(i)`` building global task ``i`` (then only this rank's tasks are built).
        On checked steps the ranks' meta-batches are compared (docs/guarantees.md)."""
        m = self.mesh
        if self.exact is None:
            batch = MetaBatch.shard(
                tasks,
                make_task,
                task_index=m.task_index,
                task_parts=m.tasks,
                sample_index=m.sample_index,
                sample_parts=m.samples,
            )
        else:  # every batch cut into whole chunks (ExactSums.cut)
            whole = MetaBatch.shard(tasks, make_task, task_index=m.task_index, task_parts=m.tasks)
            batch = self.exact.cut_meta_batch(whole)
        self.guards.tasks_in(batch)
        self._refuse_changed()
        return batch

    def meta_loss(self, tasks: Sequence[Task], loss_fn: LossFn | None = None) -> Tensor:
        """This rank's share of the meta-batch's mean query loss, through the wrapped algorithm.

        Args:
            tasks: this rank's tasks, each cut to this rank's samples: a
                :class:`metaddp.MetaBatch` (from :meth:`shard`), or a list (then the
                global task count is one integer SUM over the task axis). For a
                :class:`metaddp.Bilevel` problem, ``support`` is the inner batch and
                ``query`` the outer one.
            loss_fn: per-sample loss (``reduction='none'``); a ``Bilevel`` with losses of its
                own needs none.

        Then ``loss.backward()``, :meth:`sync_grads` and ``optimizer.step()``.
        """
        algorithm = self._algorithm("meta_loss")
        self.guards.tasks_in(tasks)
        self._refuse_changed()
        searches = self.guards.searches
        with (
            self.guards.own_loop(),
            self.guards.meta_loss_call(tasks),
            self._saving(),
            self.guards.other_draws(),
        ):
            loss = (
                algorithm.meta_loss(tasks)
                if loss_fn is None
                else algorithm.meta_loss(tasks, loss_fn)
            )
        if (
            self.guards.searches == searches and loss_fn is not None
        ):  # an algorithm that does not call loss_out itself
            self.guards.loss_out(loss, loss_fn)
        return loss

    def _refuse_changed(self) -> None:
        # After tasks_in: on a checked step the ranks' comparison names a rank-different
        # freeze on every rank; on the others this rank refuses its own, before any collective.
        if isinstance(self.sums, OverlappedSum):
            self.sums.refuse_changed()

    def adapt(
        self,
        support: Batch,
        loss_fn: LossFn | None = None,
        *,
        steps: int | None = None,
        **options: Any,
    ) -> Params:
        """The wrapped algorithm's fast weights after adapting to ``support`` (``loss_fn``:
        the per-sample loss of its inner steps; a prototypical network takes none).
        ``options``: the algorithm's own (``Bilevel``'s ``weighted=False``)."""
        batches: dict[BatchKey, Batch] = {"the support": support}
        self.guards.refuse_whole(batches)
        self.guards.moved = True
        if self.guards.schedule.due():
            self.guards.check_batch_sizes(batches)
        with self.guards.own_loop(), self._saving(), self.guards.other_draws():
            return self._algorithm("adapt").adapt(support, loss_fn, steps=steps, **options)

    def clone(self) -> Any:
        """A learner with its own fast weights (learn2learn's ``clone()``), reducing its inner
        gradients over the sample axis: ``learner.adapt(share)``, ``learner(x)``."""
        algorithm = self._algorithm("clone")  # deterministic mode: the algorithm refuses
        clone = getattr(algorithm, "clone", None)
        if clone is None:
            raise TypeError(f"{type(algorithm).__name__} has no clone()")
        if isinstance(self.sums, OverlappedSum):
            self.sums.accumulates()  # one backward per task: no sum starts during a backward
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
        ``loss`` must be this rank's share (:func:`metaddp.share` of a batch).
        ``create_graph=True`` keeps second-order terms; a first-order step whose loss is
        backpropagated again later needs ``retain_graph=True``.
        """
        self._not_exact("grad()")
        self.guards.share_in(loss, "learner.grad(loss, params)")
        reduce: Any = self.reduce
        rule = getattr(self.module, "fast_reduce", None)  # an algorithm's (Algorithm)
        if self.sharding is not None and callable(rule):
            # The algorithm's own rule for its fast weights' gradients: a sharded weight's
            # rows as they are, by name; ANIL's head, whole, summed.
            reduce = rule(self._collectives.reduce)
        return grad(
            loss, params, reduce=reduce, create_graph=create_graph, retain_graph=retain_graph
        )

    def _not_exact(self, what: str) -> None:
        if self.exact is not None:
            raise TypeError(
                f"MetaDDP.{what} is not available in deterministic mode, whose meta-gradient "
                "comes whole from learner.meta_loss(...): a hand-written loop would sum in "
                "float order. Use meta_loss, or build MetaDDP without deterministic=True"
            )

    def sharded_state_dict(self) -> dict[str, Tensor]:
        """The wrapped module's ``state_dict`` with every sharded parameter as a DTensor of
        the mesh (``Shard(0)`` along ``"sample"``, ``Replicate()`` along ``"task"``) holding
        this rank's rows, not a copy: save it with ``torch.distributed.checkpoint.save``,
        which writes every row once. To resume, on any number of processes, build the
        learner, take its ``sharded_state_dict()``, ``torch.distributed.checkpoint.load``
        into it and :meth:`load_sharded_state_dict` it. Without sharding: the plain one."""
        state = self.module.state_dict()
        if self.sharding is None or self.mesh.device_mesh is None or self.sharding.adopted:
            return state  # an FSDP2 model's state holds its DTensors already
        from torch.distributed.tensor import DTensor, Replicate, Shard

        cuts = {id(p): self.sharding.cuts[n] for n, p in self.sharding.parameters().items()}
        for name, p in self.module.named_parameters():
            cut = cuts.get(id(p))
            if cut is not None and name in state:
                state[name] = DTensor.from_local(
                    p.detach(),
                    self.mesh.device_mesh,
                    [Replicate(), Shard(0)],
                    run_check=False,
                    shape=cut.shape,
                    stride=torch.empty(cut.shape, device="meta").stride(),
                )
        for meta in getattr(state, "_metadata", {}).values():  # DTensors: whole, not rows
            meta.pop(ROWS, None)
        return state

    def load_sharded_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Load what :meth:`sharded_state_dict` gave (filled by
        ``torch.distributed.checkpoint.load``): this rank's rows of each DTensor."""
        from torch.distributed.tensor import DTensor

        if self.sharding is not None and self.sharding.adopted:  # DTensors into DTensors
            self.module.load_state_dict(state)
            return
        rows = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
        if self.sharding is None:
            self.module.load_state_dict(rows)
            return
        self.sharding.loading_rows = True
        try:
            self.module.load_state_dict(rows)
        finally:
            self.sharding.loading_rows = False

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> Tensor:
        """Scale every trained parameter's ``.grad`` by ``min(1, max_norm / (norm + eps))``
        after :meth:`sync_grads`, ``norm`` the 2-norm of the whole meta-gradient, and return
        the norm (as ``torch.nn.utils.clip_grad_norm_``). With ``shard=True`` a rank holds
        rows of the gradients, so torch's function would see this rank's rows only; here
        the squares of the rows are summed over the sample group (one small collective)."""
        grads = [p.grad for p in self.module.parameters() if p.requires_grad and p.grad is not None]
        if not grads:
            return torch.zeros(())
        rows = (
            set()
            if self.sharding is None
            else {id(p.grad) for p in self.sharding.parameters().values()}
        )
        held = [id(g) in rows for g in grads]
        with torch.no_grad():  # an FSDP2 model's DTensor gradients: their rows, in place
            grads = [local(g) for g in grads]
        squares = [g.detach().as_subclass(Tensor).double().square().sum() for g in grads]
        part = sum((q for q, r in zip(squares, held, strict=True) if r), squares[0] * 0)
        whole = sum((q for q, r in zip(squares, held, strict=True) if not r), squares[0] * 0)
        if any(held):
            part = global_value(part, self.mesh.sample_group)
        norm = (part + whole).sqrt()
        coef = torch.clamp(max_norm / (norm + eps), max=1.0)
        with torch.no_grad():
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm.to(grads[0].dtype)

    def global_value(self, share: Tensor) -> Tensor:
        """The global value of a share (a loss, for logging): SUM over all ranks, detached."""
        return global_value(share, self.mesh.group)

    def check_sizes(self, tasks: Sequence[Task]) -> None:
        """Raise :class:`metaddp.OutOfSyncError` unless every task's shards, summed over the
        sample axis, are its declared global sizes (three small collectives)."""
        self.guards.check_sizes(tasks)

    def check_in_sync(self) -> None:
        """Raise if any parameter or buffer differs between ranks (one collective)."""
        self.guards.check_in_sync()

    # --- gradients ----------------------------------------------------------------------

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients locally; the next one outside, followed
        by :meth:`sync_grads`, sums the accumulated gradients (as ``DDP.no_sync``)."""
        return self.sums.paused()

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
        if self.exact is None:
            self.guards.before_sum()
        self.guards.work_agrees()
        got = self.sums.finish([] if values is None else [values.detach().reshape(-1)])
        if self.sharding is not None and self.sharding.regather is not None:
            self.sharding.regather.sweep()  # the backward's gathers are freed by now
        # The guards' rider came last in the same SUM: judged alike on every rank.
        riding = len(got) - (0 if values is None else values.numel())
        self.guards.after_sum(got[-riding:], summed=self.exact is None)
        return got[:-riding]


def _not_reached(module: nn.Module) -> frozenset[str]:
    """The parameters a module says its meta-loss never reaches (``not_reached()``, as
    :class:`metaddp.Bilevel` with ``start="current"``): the gradient SUM does not require
    theirs."""
    declared = getattr(module, "not_reached", None)
    return frozenset(declared()) if callable(declared) else frozenset()
