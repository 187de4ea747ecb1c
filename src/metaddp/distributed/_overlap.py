"""Leaf-gradient SUM all-reduces that start during the backward pass, bucket by bucket.

Parameters are grouped into buckets of at most ``bucket_bytes``, in reverse registration order
(the order a backward pass usually finishes them, as in DDP). A hook on every parameter
(``Tensor.register_post_accumulate_grad_hook``) fires once its ``.grad`` is final for this
backward; when every parameter of a bucket is final the bucket's all-reduce is launched
asynchronously, while autograd keeps working on the rest of the graph. :meth:`finish` launches
what is left (parameters that got no gradient on this rank count as zero), waits, and writes
the sums back.

Buckets are launched strictly in bucket order, so that every rank issues the same collectives
in the same order even when a parameter has a gradient on some ranks and not on others: a
bucket waiting for such a parameter holds back the later ones until :meth:`finish`.

Each bucket carries one has-gradient flag per parameter; after the SUM a zero flag means no
rank produced a gradient for that parameter.

Launching early is only right when every rank runs one backward pass per :meth:`finish`: a
second pass would change gradients already on their way. Code that calls ``backward()`` once
per task (the learn2learn style) accumulates instead. So every bucket also carries a
"single pass" vote about the previous step: each rank votes 1 if no gradient of that step
was accumulated twice. Buckets launch early only after two consecutive steps in which every
rank voted 1 (an agreement all ranks see alike, from the same sums); until then, and for
good once any rank accumulates, everything launches in :meth:`finish`. A rank that
accumulates after early launching has begun gets a clear error instead of stale sums; code
that announces one backward per task (``MetaDDP.clone``) votes against early launching from
the start.

Each gradient's tensor and version counter are recorded as its backward makes it final
(:class:`FinalGrads`, which the sums that start after the backward keep as well):
:meth:`finish` refuses a gradient changed since (clipping or weight decay before the SUM
would change each rank's part, or be lost once its sum has started), and an optimizer step
on gradients no :meth:`finish` summed is refused before it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .. import _host
from ._collectives import (
    DEFAULT_BUCKET_BYTES,
    Group,
    PendingSum,
    Phase,
    _plan,
    group_size,
    launch_sum,
)

# One launch_sum call per bucket must be exactly one collective: a bucket is already at most
# bucket_bytes, so it is never split again.
_ONE_BUCKET = 2**62


class FinalGrads:
    """Each trained parameter's ``.grad`` as the backward left it: the tensor and its version
    counter, recorded by a hook as the backward makes it final (not while a CUDA graph is
    recorded: its replays run no hook). A gradient changed before the SUM (clipped, decayed,
    replaced, set to ``None``) is found by :meth:`edited`, on the host, without a read of the
    device."""

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]]) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.final: dict[int, tuple[Tensor, int]] = {}

    def record(self, i: int) -> None:
        g = self.params[i].grad
        if g is not None and not _host.recording():
            self.final[i] = (g, g._version)

    def hooks(self) -> list[RemovableHandle]:
        """Record each gradient as its backward makes it final (for a sum after the
        backward)."""
        return [
            p.register_post_accumulate_grad_hook(lambda _, i=i: self.record(i))
            for i, p in enumerate(self.params)
        ]

    def edited(self) -> list[str]:
        """The parameters whose ``.grad`` changed since the backward made it final."""
        return [
            self.names[i]
            for i, (g, version) in self.final.items()
            if self.params[i].grad is not g or g._version != version
        ]

    def refuse(self, edited: list[str]) -> None:
        if edited:
            raise RuntimeError(
                f"the gradient of {edited[0]!r} was changed between backward() and "
                "sync_grads() (an in-place edit such as clip_grad_norm_ or weight decay, or a "
                "new .grad): each rank would change its own part of the SUM, a different "
                "number at every world size, and a sum already started would lose the edit. "
                "Change gradients after sync_grads(), which leaves the global gradient on "
                "every rank (with shard=True, clip with learner.clip_grad_norm_)"
            )


class GradReducer:
    """SUM of ``params``' ``.grad`` over ``group``, overlapped with the backward that makes them.

    Args:
        params: ``(name, parameter)`` pairs, the parameters whose gradients are summed.
        group: the process group to sum over.
        bucket_bytes: the largest bucket (gradients plus flags) one collective moves.
    """

    def __init__(
        self,
        params: Sequence[tuple[str, nn.Parameter]],
        group: Group = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        salt: Callable[[], int] = lambda: 0,
        rider: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self.salt = salt  # enters every bucket's tag (the settings every rank must share)
        # Values that ride in the last bucket's flags, summed with them (the guards' meta-
        # loss and verdicts, which may read every gradient: the last bucket is launched once
        # all are final): given the bucket's first gradient, a 1-d tensor like it.
        self.rider = rider
        self.rode: list[float] = []  # their SUM, after finish()
        self._riding = 0  # how many rode in the last bucket
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.grads = FinalGrads(params)
        self.group = group
        order = list(range(len(self.params)))[::-1]
        plan = _plan([self.params[i] for i in order], bucket_bytes)
        self.buckets: list[list[int]] = [[order[j] for j in b] for b in plan]
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.enabled = True
        self.early = False  # launch during backward (agreed by all ranks, see the module doc)
        # Consecutive steps in which every rank voted "single pass"; -1: the first step's
        # votes carry no evidence (there was no previous step).
        self._agreed_single = -1
        self._my_vote = 1.0  # this rank's vote about its last step
        # Set for good by code that runs one backward per task (MetaDDP.clone): it votes
        # against launching early, which a later, longer loop would break.
        self.accumulates = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)
        ]
        self._ids = {id(p) for p in self.params}
        # Every optimizer's step in the process passes here first: one that would step on
        # gradients a backward made but no finish() summed is refused.
        self._handles.append(register_optimizer_step_pre_hook(self._before_step))
        self._reset()

    def _reset(self) -> None:
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._pending: list[PendingSum | None] = [None] * len(self.buckets)
        self._next = 0
        self._stale: list[str] = []
        self._fired: set[int] = set()
        self._repeated = False
        self.grads.final = {}

    def remove(self) -> None:
        """Detach the hooks (the reducer does nothing afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Let gradients accumulate locally (several backward passes) without launching."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def _hook(self, i: int):
        def hook(p: Tensor) -> None:
            if not self.enabled:
                return
            if i in self._fired:
                self._repeated = True
            self._fired.add(i)
            self.grads.record(i)
            if not self.early:
                return
            b = self.bucket_of[i]
            if self._pending[b] is not None:
                # A second backward changed a gradient that is already on its way.
                self._stale.append(self.names[i])
                return
            self._ready[b].add(i)
            self._launch_ready()

        return hook

    def _before_step(self, optimizer: torch.optim.Optimizer, *args: object) -> None:
        if not self._fired or not any(
            id(p) in self._ids for group in optimizer.param_groups for p in group["params"]
        ):
            return
        raise RuntimeError(
            "optimizer.step() on gradients that a backward made but sync_grads() never summed "
            "over the ranks: each rank would step on its own shard's gradient, and the ranks "
            "would drift apart. Call learner.sync_grads() after loss.backward() and before "
            "optimizer.step()"
        )

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(
            self.buckets[self._next]
        ):
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        members = [self.params[i] for i in self.buckets[b]]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in members]
        flags = _host.upload(
            [float(p.grad is not None) for p in members] + [self._my_vote], members[0]
        )
        if b == len(self.buckets) - 1 and self.rider is not None:
            riding = self.rider(members[0].detach()).to(flags).reshape(-1)
            self._riding = riding.numel()
            flags = torch.cat([flags, riding])
        self._pending[b] = launch_sum(
            grads + [flags], self.group, _ONE_BUCKET, Phase.GRADIENTS, self.salt()
        )
        self._next = b + 1

    def finish(self, extra: Sequence[Tensor] = ()) -> tuple[list[str], list[float]]:
        """Launch the remaining buckets, wait for all, write the sums into ``.grad``.

        Args:
            extra: 1-d tensors to SUM as well (one more small collective), read on the host
                with the buckets' flags.

        Returns:
            The names of the parameters no rank produced a gradient for (their ``.grad`` is
            left as it was, ``None``), and the SUM of ``extra`` (concatenated).

        Raises:
            RuntimeError: a gradient changed after its bucket was launched (two backward
                passes before one :meth:`finish` without :meth:`paused`).
        """
        try:
            edited = self.grads.edited()
            while self._next < len(self.buckets):
                self._launch(self._next)
            missing: list[str] = []
            votes = []
            values = None
            if extra:
                tail = torch.cat([e.reshape(-1).to(self.params[0]) for e in extra])
                values = launch_sum([tail], self.group, _ONE_BUCKET, Phase.VALUES, self.salt())
            every = []
            for pending in self._pending:
                assert pending is not None
                every.append(pending.wait())
            tails = [] if values is None else values.wait()
            # The step's one host read: every bucket's flags, the extra values, and the step's
            # pending checks.
            read = _host.read(*(sums[-1] for sums in every), *tails)
            summed = read.pop() if tails else []
            for b, (sums, flags) in enumerate(zip(every, read, strict=True)):
                members = self.buckets[b]
                if b == len(self.buckets) - 1 and self.rider is not None:
                    self.rode = flags[len(flags) - self._riding :]
                    del flags[len(flags) - self._riding :]
                votes.append(flags.pop())
                with torch.no_grad():
                    # sums ends with the flags tensor itself, one longer than members.
                    for i, g, f in zip(members, sums, flags, strict=False):
                        p = self.params[i]
                        if f == 0:
                            missing.append(self.names[i])
                        elif p.grad is None:
                            p.grad = g
                        else:
                            p.grad.copy_(g)
            stale = self._stale
            # Every bucket carried the same votes, so every rank reads the same total.
            world = group_size(self.group)
            everyone_single = bool(votes) and votes[0] == world
            self._agreed_single = self._agreed_single + 1 if everyone_single else -(2**30)
            self.early = self._agreed_single >= 2
            self._my_vote = 0.0 if (self._repeated or stale or self.accumulates) else 1.0
        finally:
            self._reset()
        self.grads.refuse(edited)
        if stale:
            raise RuntimeError(
                f"the gradient of {stale[0]!r} changed after its all-reduce had started: "
                "backward() ran more than once before sync_grads(), after earlier steps ran it "
                "once on every rank (so gradient sums had started during the backward). Run "
                "all but the last backward inside `with model.no_sync():`, or build MetaDDP "
                "with overlap=False. Later steps no longer start sums early."
            )
        return missing, summed
