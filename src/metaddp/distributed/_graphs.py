"""A meta-step recorded once in a CUDA graph and replayed: the same kernels, no Python.

A stacked second-order meta-step launches a few thousand kernels, most of them small: on a
GPU its time is mostly the host's (Python, dispatch, launches), not the kernels'. A CUDA graph
records the step's kernels once and replays them with one launch. On an H200 (BENCHMARKS.md)
the same recording, made by hand, of a Conv-4 step with BatchNorm over 32 tasks ran 2.2x
faster than eager at one inner step and 3.6x at five, with the same meta-gradient bit for bit.

What a replay can and cannot do follows from what a graph is: fixed kernels on fixed memory.

- The tasks' tensors are copied into the buffers the graph reads. A batch of other shapes,
  dtypes or counts than the recorded one is an error, not a silent re-record.
- The parameters and buffers must stay where they were (an optimizer's in-place update is
  fine; ``module.to(...)`` or replacing a parameter is an error), and the algorithm's
  settings and the modules' train/eval mode as they were (a changed inner learning rate
  would otherwise replay the old one).
- The step's checks (a non-finite inner gradient, ranks out of step) are recorded with it
  and read after each replay, in the same one host read per step as without a graph: at
  the end of the call, or in the ``sync_grads`` that ends a ``MetaDDP`` step.
- ``.grad`` behaves as after ``backward()``: set where it was ``None``, added to otherwise.
- Anything that needs the host inside the step cannot be recorded, and says so: a task
  count from a plain list under a ``MetaDDP`` (pass ``learner.shard(...)``'s MetaBatch),
  deterministic mode, check mode, overlapped gradient sums, gloo collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .. import _host
from .._data import MetaBatch, Task
from .._types import LossFn


class _Stepper(Protocol):
    def meta_loss(self, tasks: Sequence[Task], loss_fn: LossFn) -> Tensor: ...
    def parameters(self) -> Any: ...
    def buffers(self) -> Any: ...
    def modules(self) -> Any: ...


def _flatten(tasks: Sequence[Task]) -> tuple[list[Tensor], tuple[Any, ...]]:
    """The tasks' tensors, and everything else a recorded step depends on."""
    tensors: list[Tensor] = []
    shape: list[Any] = []
    for task in tasks:
        for batch in (task.support, task.query):
            tensors += [batch.x, batch.y]
            shape.append(
                (batch.n, *((tuple(t.shape), t.dtype, t.device) for t in (batch.x, batch.y)))
            )
    if isinstance(tasks, MetaBatch):
        shape.append(("meta-batch", tasks.n, tasks.indices))
    return tensors, tuple(shape)


def _describe(signature: tuple[Any, ...]) -> str:
    tasks = [s for s in signature if s[0] != "meta-batch"]
    first = tasks[0] if tasks else None
    if first is None:
        return "no task"
    n, (xs, xd, _), (ys, _, _) = first
    return f"{len(tasks) // 2} task(s), the first's support x {list(xs)} {xd}, y {list(ys)}, n={n}"


class CapturedStep:
    """``step(tasks)``: ``learner.meta_loss(tasks, loss_fn).backward()``, replayed from a
    CUDA graph.

    The first ``warmup`` calls run eagerly (on a side stream, as recording needs); the next
    one records the step and replays it; every later call copies its tasks in and replays.
    Then, as without a graph: ``learner.sync_grads()`` under a ``MetaDDP``, and
    ``optimizer.step()``.

    Args:
        learner: a meta-learning algorithm (``metaddp.MAML`` ...) or a ``metaddp.MetaDDP``.
        loss_fn: per-sample loss (``reduction='none'``), the same on every call.
        warmup: eager calls before recording (libraries set themselves up lazily: cuBLAS
            handles, autograd's device threads).

    Returns (per call): this rank's loss share, detached.

    Raises:
        ValueError: tasks not on a CUDA device, or of other shapes than the recorded ones;
            under a ``MetaDDP``, tasks given as a plain list.
        RuntimeError: parameters or buffers moved, or settings or train/eval mode changed,
            since recording; a learner whose step needs the host (the reason is named).
    """

    def __init__(self, learner: _Stepper, loss_fn: LossFn, *, warmup: int = 3) -> None:
        if warmup < 1:
            raise ValueError(
                f"warmup must be at least 1 (recording follows eager calls), got {warmup}"
            )
        refusal = getattr(learner, "capture_refusal", None)
        reason = refusal() if callable(refusal) else None
        if reason is not None:
            raise RuntimeError(f"this meta-step cannot be recorded in a CUDA graph: {reason}")
        self.learner, self.loss_fn, self.warmup = learner, loss_fn, warmup
        self.calls = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._signature: tuple[Any, ...] = ()
        self._inputs: list[Tensor] = []
        self._loss: Tensor | None = None
        self._grads: list[Tensor | None] = []
        self._checks: list[tuple[Tensor, _host.Verdict]] = []
        self._ends_in_sync = False
        self._where: list[int] = []
        self._mode: tuple[Any, ...] = ()

    @property
    def recorded(self) -> bool:
        """Whether the step is recorded (later calls replay it)."""
        return self._graph is not None

    def _trained(self) -> list[nn.Parameter]:
        return [p for p in self.learner.parameters() if p.requires_grad]

    def _addresses(self) -> list[int]:
        return [t.data_ptr() for t in (*self.learner.parameters(), *self.learner.buffers())]

    def _settings(self) -> tuple[Any, ...]:
        """What the recorded kernels were chosen by besides the tensors: the algorithm's
        settings (inner steps, learning rate...) and every module's train/eval mode."""
        algorithm = getattr(self.learner, "module", self.learner)
        signature = getattr(algorithm, "signature", None)
        return (
            signature() if callable(signature) else None,
            tuple(m.training for m in self.learner.modules()),
        )

    def __call__(self, tasks: Sequence[Task]) -> Tensor:
        tensors, signature = _flatten(tasks)
        if not tensors or any(t.device.type != "cuda" for t in tensors):
            raise ValueError(
                "CapturedStep records CUDA graphs: every task's tensors must be on a CUDA "
                "device (on the CPU, call learner.meta_loss(...).backward() directly)"
            )
        if hasattr(self.learner, "mesh") and not isinstance(tasks, MetaBatch):
            raise ValueError(
                "under a MetaDDP, pass learner.shard(...)'s MetaBatch: a plain list's global "
                "task count is a collective read on the host, which a graph cannot record"
            )
        self.calls += 1
        if self._graph is None:
            if self.calls <= self.warmup:
                return self._eager(tasks)
            self._record(tasks, tensors, signature)
        elif signature != self._signature:
            was, now = _describe(self._signature), _describe(signature)
            where = " (they differ in a later task or in the meta-batch's positions)"
            raise ValueError(
                f"this step was recorded for {was}; got {now}{where if was == now else ''}. "
                "Use one CapturedStep per batch shape, or run the step eagerly."
            )
        elif self._addresses() != self._where:
            raise RuntimeError(
                "the learner's parameters or buffers moved since the step was recorded "
                "(module.to(), a replaced parameter): the graph would read stale memory. "
                "Build a new CapturedStep."
            )
        elif self._settings() != self._mode:
            raise RuntimeError(
                "the algorithm's settings or a module's train/eval mode changed since the "
                f"step was recorded ({self._mode[0]} -> {self._settings()[0]}): a replay would "
                "run the recorded ones. Build a new CapturedStep."
            )
        return self._replay(tensors)

    def _eager(self, tasks: Sequence[Task]) -> Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = self.learner.meta_loss(tasks, self.loss_fn)
            loss.backward()
        torch.cuda.current_stream().wait_stream(side)
        return loss.detach()

    def _record(
        self, tasks: Sequence[Task], tensors: list[Tensor], signature: tuple[Any, ...]
    ) -> None:
        self._signature = signature
        self._inputs = [t.detach().clone() for t in tensors]
        recorded = _substitute(tasks, self._inputs)
        params = self._trained()
        # Recording runs no kernel; the gradients it allocates are the graph's own buffers.
        # The caller's are put back after it and receive each replay's (see _deliver).
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        failed: BaseException | None = None  # the step's own error, before the capture's
        try:
            torch.cuda.synchronize()
            try:
                with _host.capturing(), torch.cuda.graph(graph):
                    try:
                        loss = self.learner.meta_loss(recorded, self.loss_fn)
                        loss.backward()
                    except BaseException as e:
                        failed = e
            except BaseException:
                if failed is None:
                    raise
            if failed is not None:
                raise failed
            self._ends_in_sync = _host.in_step()
            self._checks = _host.take()
        except BaseException:
            _host.discard()
            raise
        finally:
            recorded_grads = [p.grad for p in params]
            for p, g in zip(params, kept, strict=True):
                p.grad = g
        self._grads = recorded_grads
        self._loss = loss.detach()
        self._graph = graph
        self._where = self._addresses()
        self._mode = self._settings()

    def _replay(self, tensors: list[Tensor]) -> Tensor:
        assert self._graph is not None and self._loss is not None
        params = self._trained()
        torch._foreach_copy_(self._inputs, [t.detach() for t in tensors], non_blocking=True)
        self._graph.replay()
        _deliver(params, self._grads)
        if self._ends_in_sync:
            _host.resume(self._checks)  # read by the sync_grads that ends the step
        elif self._checks:
            _host.judge(self._checks)
        return self._loss.clone()


def _substitute(tasks: Sequence[Task], tensors: list[Tensor]) -> Sequence[Task]:
    """``tasks`` with their tensors replaced, in :func:`_flatten`'s order."""
    it = iter(tensors)
    out = [
        Task(*(type(b)(next(it), next(it), b.n) for b in (task.support, task.query)))
        for task in tasks
    ]
    if isinstance(tasks, MetaBatch):
        return MetaBatch(out, tasks.n, tasks.indices)
    return out


def _deliver(params: list[nn.Parameter], grads: list[Tensor | None]) -> None:
    """A replay's gradients into ``.grad`` as ``backward()`` would put them: a copy where
    ``.grad`` is ``None`` (the graph's buffers are rewritten by the next replay), added
    otherwise."""
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g)
