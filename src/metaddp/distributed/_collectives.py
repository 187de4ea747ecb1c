"""Differentiable, bucketed collectives.

The one primitive the exact meta-gradient needs is a SUM all-reduce that autograd can see:
its backward is again a SUM all-reduce of the incoming gradient (the adjoint of "sum over
ranks, broadcast the result" is itself), so it composes to any order of differentiation.

Tensors are flattened into buckets of at most ``bucket_bytes`` (one per dtype and device),
every bucket is launched asynchronously, then all are awaited: the number of calls depends on
the bytes moved, not on how many parameter tensors a model has.

Every float32/float64 bucket carries one extra element, a tag derived from this rank's call
sequence number, the bucket size and the :class:`Phase` of the meta-step it belongs to (an
inner-loop SUM, its adjoint in a backward pass, the meta-gradient SUM, a value for logging).
After the SUM it must equal ``world * tag`` exactly; if not, ranks are out of step (different
inner-step counts, a rank that skipped a step, one rank in its backward while another still
adapts) and a :class:`CollectiveError` says so at that very collective, instead of returning
silently wrong numbers. With
:func:`set_strict` on, a small header is compared *before* each collective too, which also
catches ranks whose bucket sizes differ (gloo aborts the process on those otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import sys
import zlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _host

Group = dist.ProcessGroup | None

DEFAULT_BUCKET_BYTES = 25 * 2**20
_TAGGED = (torch.float32, torch.float64)
# Tags stay below 2**12 so that world * tag is exact in float32 for any world below 2**12.
_TAG_MODULUS = 4093
# Half-precision buckets carry their tag as 16 bits, one element each: summed over agreeing
# ranks every element is 0 or the world size, which these formats hold exactly up to 2**8
# (bfloat16's 8 significant bits) and 2**11 (float16's 11); any disagreement in any bit
# shows as a value in between. Larger groups leave such buckets untagged.
_BIT_TAGGED = {torch.bfloat16: 2**8, torch.float16: 2**11}
_TAG_BITS = 16


class Phase(enum.IntEnum):
    """Which part of a meta-step a SUM belongs to (it enters the bucket's tag)."""

    FORWARD = 0  # a differentiable SUM in a forward pass: inner gradients, BatchNorm statistics
    BACKWARD = 1  # its adjoint, inside a backward pass
    GRADIENTS = 2  # the meta-gradient SUM after the outer backward
    VALUES = 3  # values: losses for logging, evaluation results

    def describe(self) -> str:
        return _PHASE_TEXT[self]


_PHASE_TEXT = {
    Phase.FORWARD: "a differentiable all-reduce in a forward pass (an inner step's gradients, "
    "or a BatchNorm layer's statistics where the model has one)",
    Phase.BACKWARD: "the adjoint all-reduce in a backward pass",
    Phase.GRADIENTS: "the meta-gradient all-reduce (sync_grads; its tag also carries the "
    "algorithm's settings)",
    Phase.VALUES: "a value all-reduce (losses, evaluation)",
}


SKIPPED = (
    "Where ranks split a task's samples, each runs every task's forwards, losses and "
    "backward passes, in the same order: a rank that holds no query sample of a task still "
    "runs its loss and backward (md.share of an empty part is a zero that joins the sums), "
    "never `if mask.any(): loss.backward()`."
)


class CollectiveError(RuntimeError):
    """Ranks disagreed on a collective, or one timed out: the message says what likely happened."""


@dataclasses.dataclass
class CollectiveStats:
    """What collectives this process launched: one ``call`` per bucket or header exchange."""

    calls: int = 0
    elements: int = 0
    bytes: int = 0
    by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    """Bytes per kind of collective (``all_reduce``, ``all_gather``: the gathered buffer,
    ``reduce_scatter``: the buffer before the scatter)."""


_stats: list[CollectiveStats] = []
_sequence: dict[int, int] = {}
_strict = False


def set_strict(on: bool) -> None:
    """Compare a small header across ranks before every collective (one extra tiny call each)."""
    global _strict
    _strict = bool(on)


def strict() -> bool:
    return _strict


@contextlib.contextmanager
def counting() -> Iterator[CollectiveStats]:
    """Count the collectives launched inside the block."""
    stats = CollectiveStats()
    _stats.append(stats)
    try:
        yield stats
    finally:
        # By identity: an inner block's stats may equal an outer one's (both still zero).
        del _stats[next(i for i, s in enumerate(_stats) if s is stats)]


def _record(elements: int, nbytes: int, kind: str = "all_reduce") -> None:
    for s in _stats:
        s.calls += 1
        s.elements += elements
        s.bytes += nbytes
        s.by_kind[kind] = s.by_kind.get(kind, 0) + nbytes


def group_size(group: Group = None) -> int:
    """Number of ranks in ``group``; 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Group = None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def comm_device(group: Group = None) -> torch.device:
    """Where tensors must live for this group's backend (NCCL: the current CUDA device)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _next_sequence(group: Group) -> int:
    key = id(group)
    seq = _sequence.get(key, 0)
    _sequence[key] = seq + 1
    return seq


def _describe(what: str, seq: int, numel: int) -> str:
    return f"{what} (call #{seq} on this group, {numel} elements)"


def _guard(work_fn, what: str):
    try:
        return work_fn()
    except CollectiveError:
        raise
    except RuntimeError as e:  # gloo/NCCL timeouts and connection resets surface as RuntimeError
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        low = text.lower()
        if "timed out" in low or "timeout" in low:
            raise CollectiveError(
                f"{what} timed out on rank {group_rank()}: this process waited for the others "
                "and at least one never joined. Likely cause: a process stalled (stopped, "
                "deadlocked, or lost its machine), another process raised an error and stopped, "
                "or the ranks disagree on how many collectives to run (different inner-step "
                "counts or meta-batch layouts, or a task's loss and backward that one rank "
                f"skipped). Look at the other processes' output first. "
                f"({text})"
            ) from e
        if "closed" in low or "reset" in low or "broken pipe" in low:
            raise CollectiveError(
                f"{what} lost its connection on rank {group_rank()}: another process ended in "
                "the middle of the collective. Likely cause: another rank raised an error and "
                "stopped, or was killed, or the ranks disagree on how many collectives to run "
                "(different inner-step counts or meta-batch layouts) and it had finished. Look "
                f"at the other processes' output first. ({text})"
            ) from e
        raise CollectiveError(
            f"{what} failed on rank {group_rank()}: {e}\n"
            "Likely cause: the ranks disagree on how many collectives to run (different "
            "inner-step counts or meta-batch layouts per rank), or another rank raised an "
            "exception and stopped. Look at the other ranks' output first."
        ) from e


def _check_header(group: Group, seq: int, numel: int, kind: int, what: str, device) -> None:
    header = torch.tensor([seq, numel, kind], dtype=torch.float64, device=device)
    both = torch.cat([header, -header])
    _record(both.numel(), both.numel() * 8)
    _guard(lambda: dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group), what)
    hi, lo = both[:3], -both[3:]
    if not torch.equal(hi, lo):
        raise CollectiveError(
            f"ranks are out of step at {_describe(what, seq, numel)} on rank {group_rank()}: "
            f"across ranks the call number ranges {int(lo[0])}..{int(hi[0])}, the size "
            f"{int(lo[1])}..{int(hi[1])}. Every rank must run the same collectives in the same "
            "order: check that inner-step counts, models and meta-batch layouts agree."
        )


def agree_on_site(group: Group, numel: int, what: str, why: str = SKIPPED) -> None:
    """Before a check's collective, whose size depends on where it is called: compare where
    every rank is (its caller's name) and the size, in one tiny MAX. Ranks at different
    checks (one ran a forward, a loss or an inner step that another skipped) get one error on
    every rank, instead of a collective of mismatched sizes that gloo ends by aborting the
    process, or one that pairs two unrelated checks. ``why`` says what likely differs."""
    caller = sys._getframe(2).f_code.co_qualname
    site = zlib.crc32(caller.encode()) % 2**24
    device = comm_device(group)
    header = torch.tensor([site, numel], dtype=torch.float64, device=device)
    both = torch.cat([header, -header])
    _record(both.numel(), both.numel() * 8)
    _guard(lambda: dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group), what)
    if not torch.equal(both[:2], -both[2:]):
        raise CollectiveError(
            f"ranks are at different collectives: rank {group_rank()} is at a {what} in "
            f"{caller} ({numel} elements), another rank elsewhere. {why}"
        )


def _plan(tensors: Sequence[Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` per bucket: same dtype and device, at most ``bucket_bytes`` each."""
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, tuple[int, int]] = {}  # (dtype, device) -> (bucket index, bytes)
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        slot = open_bucket.get(key)
        if slot is None or (slot[1] + nbytes > bucket_bytes and slot[1] > 0):
            buckets.append([i])
            open_bucket[key] = (len(buckets) - 1, nbytes)
        else:
            buckets[slot[0]].append(i)
            open_bucket[key] = (slot[0], slot[1] + nbytes)
    return buckets


def _bits_agree(world: int, got: list[float]) -> bool:
    return all(b in (0, world) for b in got)


class PendingSum:
    """SUM all-reduces launched asynchronously; :meth:`wait` returns the reduced tensors.

    Made by :func:`launch_sum`. Until :meth:`wait`, the inputs may change freely: each bucket
    was copied into its own flat buffer at launch.
    """

    def __init__(
        self, tensors: list[Tensor], group: Group, world: int, phase: Phase, salt: int
    ) -> None:
        self._tensors, self._group, self._world = tensors, group, world
        self._phase, self._what, self._salt = phase, phase.describe(), salt
        self._launched: list[tuple] = []
        self._out: list[Tensor] | None = None

    def _launch(self, idx: list[int]) -> None:
        tensors, group, what = self._tensors, self._group, self._what
        device = comm_device(group)
        parts = [tensors[i].detach().reshape(-1) for i in idx]
        dtype = parts[0].dtype
        numel = sum(p.numel() for p in parts)
        seq = _next_sequence(group)
        code = seq * 31 + numel + self._phase * 1021 + self._salt
        tag = None  # (elements at the bucket's end, their verdict)
        if dtype in _TAGGED:
            value = float(1 + code % _TAG_MODULUS)
            parts.append(torch.full((1,), value, dtype=dtype, device=parts[0].device))
            # The verdicts hold numbers, not this object: a closure over it would tie its
            # buckets into a reference cycle that only the garbage collector frees.
            world = self._world
            tag = (1, self._tag_verdict(lambda got: got == [world * value], seq, numel))
        elif self._world <= _BIT_TAGGED.get(dtype, 0):
            # Made on the device (a fill and a shift), so no host-to-device copy waits.
            shifts = torch.arange(_TAG_BITS, device=parts[0].device)
            bits = torch.full((_TAG_BITS,), code % 2**_TAG_BITS, device=parts[0].device)
            parts.append(((bits >> shifts) & 1).to(dtype))
            tag = (
                _TAG_BITS,
                self._tag_verdict(functools.partial(_bits_agree, self._world), seq, numel),
            )
        flat = torch.cat(parts).to(device)
        if _strict:
            _check_header(group, seq, numel, int(self._phase), what, device)
        _record(flat.numel(), flat.numel() * flat.element_size())
        work = _guard(lambda: dist.all_reduce(flat, group=group, async_op=True), what)
        self._launched.append((idx, flat, work, tag))

    def _tag_verdict(
        self, agree: Callable[[list[float]], bool], seq: int, numel: int
    ) -> _host.Verdict:
        what, rank = self._what, group_rank()

        def verdict(got: list[float]) -> Exception | None:
            if agree(got):
                return None
            summed = ", ".join(f"{g:g}" for g in got)
            return CollectiveError(
                f"ranks are out of step at {_describe(what, seq, numel)} on rank {rank}: "
                "another rank was at a different collective (the sequence tags summed to "
                f"{summed}, which agreeing ranks never give). Every rank must run the same "
                "collectives in the same order: check that inner-step counts, algorithms and "
                f"meta-batch layouts agree on all ranks. {SKIPPED}"
            )

        return verdict

    def wait(self) -> list[Tensor]:
        """Wait for every bucket, check its tag, and return the sums (new tensors), in order."""
        if self._out is not None:
            return self._out
        tensors = self._tensors
        out: list[Tensor | None] = [None] * len(tensors)
        for idx, flat, work, tag in self._launched:
            _guard(work.wait, self._what)
            if tag is not None:
                # Judged on the host at the step's one read (metaddp._host), not here: a read
                # would wait for the device. A copy, so the bucket itself is not kept alive.
                width, verdict = tag
                _host.check(flat[-width:].clone(), verdict)
            offset = 0
            for i in idx:
                t = tensors[i]
                out[i] = flat[offset : offset + t.numel()].view(t.shape).to(t.device)
                offset += t.numel()
        self._out = out  # type: ignore[assignment]
        self._tensors = []
        return self._out  # type: ignore[return-value]


def launch_sum(
    tensors: Sequence[Tensor],
    group: Group = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    phase: Phase = Phase.VALUES,
    salt: int = 0,
) -> PendingSum:
    """Start the SUM over ``group`` of each tensor, bucketed, without waiting. Not differentiable.

    Every bucket (at most ``bucket_bytes``, one dtype and device) is one asynchronous
    all-reduce; the caller overlaps other work and then calls :meth:`PendingSum.wait`.
    On one rank nothing is launched and ``wait`` returns clones. ``salt`` (an integer every
    rank must agree on, e.g. from the algorithm's settings) enters the tags as well.
    """
    tensors = list(tensors)
    world = group_size(group)
    pending = PendingSum(tensors, group, world, phase, salt)
    if world == 1 or not tensors:
        pending._out = [t.detach().clone() for t in tensors]
        return pending
    for idx in _plan(tensors, bucket_bytes):
        pending._launch(idx)
    return pending


def origin_salt(group: Group) -> int:
    """The tag salt of the adjoint of the collective that ``group`` runs next: derived from its
    call number, which agreeing ranks share. An adjoint tagged with it pairs only with the
    adjoint of the same forward collective: where ranks run their backward passes over
    different tasks (each skipping another task's query loss), as many collectives of the same
    size meet, and only this salt tells them apart."""
    return (_sequence.get(id(group), 0) * 131 + 17) % _TAG_MODULUS


_ADJOINT = {Phase.FORWARD: Phase.BACKWARD, Phase.BACKWARD: Phase.FORWARD}


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(group, bucket_bytes, phase, salt, adjoint_salt, *tensors):
        return tuple(launch_sum(tensors, group, bucket_bytes, phase, salt).wait())

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.bucket_bytes, ctx.phase, _, ctx.adjoint_salt = inputs[:5]

    @staticmethod
    def backward(ctx, *grads):
        # The adjoint of y_r = sum_s x_s (for every rank r) is dx_s = sum_r dy_r: the same
        # all-reduce. Calling the Function again (not a bare collective) keeps it on the
        # graph when create_graph=True, so third and higher orders work as well.
        # The adjoint runs in a backward pass (and its own adjoint in a forward one again),
        # tagged with the forward's call number.
        group, phase = ctx.group, _ADJOINT.get(ctx.phase, ctx.phase)
        summed = _AllReduceSum.apply(
            group, ctx.bucket_bytes, phase, ctx.adjoint_salt, origin_salt(group), *grads
        )
        return (None, None, None, None, None, *summed)

    @staticmethod
    def vmap(info, in_dims, *args):
        # Under torch.vmap (tasks stacked), a SUM over ranks is elementwise: one collective
        # carries every task's tensor at once, whatever dimension the tasks are stacked on.
        # Unbatched inputs are summed as they are (every task shares them).
        out = _AllReduceSum.apply(*args)
        return tuple(out), tuple(in_dims[5:])


def all_reduce_sum(
    tensors: Sequence[Tensor],
    group: Group = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    phase: Phase = Phase.FORWARD,
) -> list[Tensor]:
    """Differentiable SUM over ``group`` of each tensor, bucketed. Identity on one rank.

    ``phase`` says which part of a meta-step this SUM belongs to (it enters the out-of-step
    tag); the backward runs the adjoint phase.
    """
    tensors = list(tensors)
    if group_size(group) == 1 or not tensors:
        return tensors
    return list(_AllReduceSum.apply(group, bucket_bytes, phase, 0, origin_salt(group), *tensors))


def all_reduce_counts(counts: Sequence[int], group: Group = None) -> list[int]:
    """Exact integer SUM over ``group`` (global sample or task counts)."""
    counts = [int(c) for c in counts]
    if group_size(group) == 1:
        return counts
    t = torch.tensor(counts, dtype=torch.int64, device=comm_device(group))
    _record(t.numel(), t.numel() * 8)
    _guard(lambda: dist.all_reduce(t, group=group), "count all-reduce")
    return [int(v) for v in t.tolist()]


def broadcast_(tensors: Sequence[Tensor], src: int = 0, group: Group = None) -> None:
    """Overwrite ``tensors`` in place with rank ``src``'s values (bucketed)."""
    tensors = list(tensors)
    if group_size(group) == 1 or not tensors:
        return
    device = comm_device(group)
    for idx in _plan(tensors, DEFAULT_BUCKET_BYTES):
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx]).to(device)
        _record(flat.numel(), flat.numel() * flat.element_size())
        _guard(lambda flat=flat: dist.broadcast(flat, src=src, group=group), "broadcast")
        offset = 0
        with torch.no_grad():
            for i in idx:
                t = tensors[i]
                t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()


def max_abs_difference(tensors: Sequence[Tensor], group: Group = None) -> list[float]:
    """Per tensor, the largest |x_rank - x_rank'| over ranks (0.0 on one rank). One call."""
    tensors = list(tensors)
    if group_size(group) == 1 or not tensors:
        return [0.0] * len(tensors)
    device = comm_device(group)
    flat = torch.cat([t.detach().reshape(-1).to(device, torch.float64) for t in tensors])
    agree_on_site(group, flat.numel(), "consistency check")
    both = torch.cat([flat, -flat])
    _record(both.numel(), both.numel() * 8)
    _guard(lambda: dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group), "consistency check")
    spread = both[: flat.numel()] + both[flat.numel() :]  # max - min, elementwise
    out, offset = [], 0
    for t in tensors:
        out.append(float(spread[offset : offset + t.numel()].max()) if t.numel() else 0.0)
        offset += t.numel()
    return out


def global_count(n_local: int, group: Group = None) -> int:
    """Total number of samples (or tasks) over ``group``: an exact integer all-reduce."""
    return all_reduce_counts([n_local], group)[0]


def global_value(shares: Tensor | Sequence[Tensor], group: Group = None) -> Tensor:
    """The global value of a share (for logging): SUM over ranks, detached."""
    if isinstance(shares, Tensor):
        return all_reduce_sum([shares.detach()], group, phase=Phase.VALUES)[0].detach()
    values = all_reduce_sum([s.detach() for s in shares], group, phase=Phase.VALUES)
    return torch.stack(values).detach()


def settings_salt(settings: str) -> int:
    """A tag salt from a settings string: the same on every rank for the same settings (a CRC,
    not Python's per-process ``hash``)."""
    return zlib.crc32(settings.encode()) % _TAG_MODULUS
