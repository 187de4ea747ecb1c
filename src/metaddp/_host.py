"""Reading device values on the host: inside a meta-step, once.

On a GPU, reading a device value on the host (``.item()``, ``bool(t)``, ``.tolist()``) waits
for every kernel queued before it. A meta-step that checked each inner step's gradient and
each bucket's tag as it went would stall the stream dozens of times. So a check is made of
two parts: a device tensor computed where the check belongs, and a verdict that judges its
value on the host.

Inside a step (from :func:`begin_step` to the :func:`read` that ends it: an algorithm's
``meta_loss`` begins one, and ends it itself or, under a ``MetaDDP``, leaves the end to
``sync_grads``), a check on an accelerator waits on the device,
and the step's one read fetches them together with what it needs itself in one transfer,
then raises the first failed check's error: the same error an immediate check would raise,
only later in the step. A check on the CPU costs nothing to read and is judged at once, as
is any check outside a step: so on the CPU, ranks that fall out of step fail at the first
collective they disagree on, while on a GPU they fail at the end of the step (or, if one
blocks in a collective the other never joins first, after the collective timeout, whose
error names the likely cause).

:func:`counting` counts the reads that would wait for a device; :func:`as_on_a_device` makes
CPU values behave as a device's, so that tests see on the CPU what a GPU would pay.

The pending checks are the process's, not a learner's: a process runs one meta-step at a time
(its device stream is one), so this module's queue is the documented one-process default that
every learner in the process shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

Verdict = Callable[[list[float]], "Exception | None"]
"""Judges a check's values on the host: the error to raise, or ``None`` when they pass."""

# A step that never ends (a meta_loss without sync_grads) reads its checks at this many.
_MOST_PENDING = 1024


@dataclasses.dataclass
class HostReads:
    """Host transfers the library made inside the block (one per :func:`read` of values)."""

    reads: int = 0


_counters: list[HostReads] = []
_pending: list[tuple[Tensor, Verdict]] = []
_in_step = False
_cpu_as_device = False
_capturing = False


class CaptureError(RuntimeError):
    """A step being recorded into a CUDA graph asked for a device value on the host."""


@contextlib.contextmanager
def as_on_a_device() -> Iterator[None]:
    """Inside the block, CPU values are deferred and counted as an accelerator's would be."""
    global _cpu_as_device
    before, _cpu_as_device = _cpu_as_device, True
    try:
        yield
    finally:
        _cpu_as_device = before


def _costly(t: Tensor) -> bool:
    return _cpu_as_device or t.device.type != "cpu"


@contextlib.contextmanager
def counting() -> Iterator[HostReads]:
    """Count the library's host reads inside the block."""
    stats = HostReads()
    _counters.append(stats)
    try:
        yield stats
    finally:
        _counters.remove(stats)


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Inside the block a CUDA graph is being recorded: every check stays pending (the graph
    recomputes its value on each replay; take them with :func:`take`), the step's read of
    them is left to the replay, and any other host read raises :class:`CaptureError`."""
    global _capturing
    before, _capturing = _capturing, True
    try:
        yield
    finally:
        _capturing = before


def take() -> list[tuple[Tensor, Verdict]]:
    """The pending checks, handed over (to be judged after a graph's replay); ends the step."""
    global _in_step
    taken = list(_pending)
    _pending.clear()
    _in_step = False
    return taken


def resume(checks: Sequence[tuple[Tensor, Verdict]]) -> None:
    """Begin a step with ``checks`` pending, as if it had made them itself (a replayed graph's
    checks, read by the ``sync_grads`` that ends its step)."""
    begin_step()
    _pending.extend(checks)


def judge(checks: Sequence[tuple[Tensor, Verdict]]) -> None:
    """Read ``checks`` in one transfer and raise the first failed one's error."""
    _raise_first(checks, _fetch([v for v, _ in checks]))


def _raise_first(checks: Sequence[tuple[Tensor, Verdict]], values: list[list[float]]) -> None:
    """Judge each check by its value on the host (``values`` may go on past the checks)."""
    for (_, verdict), got in zip(checks, values, strict=False):
        error = verdict(got)
        if error is not None:
            raise error


def begin_step() -> None:
    """From now until the next :func:`read`, checks wait on the device."""
    global _in_step
    _in_step = True


def in_step() -> bool:
    return _in_step


def recording() -> bool:
    """Whether a CUDA graph is being recorded (:func:`capturing`)."""
    return _capturing


def check(value: Tensor, verdict: Verdict) -> None:
    """Judge ``value`` with ``verdict``: at the step's read for a device value inside a step,
    else now (without reading the step's pending checks)."""
    if _capturing or (_in_step and _costly(value) and len(_pending) < _MOST_PENDING):
        _pending.append((value.detach(), verdict))
        return
    (got,) = _fetch([value])
    error = verdict(got)
    if error is not None:
        raise error


def discard() -> None:
    """Drop the pending checks and end the step (its work failed: nothing to judge)."""
    global _in_step
    _pending.clear()
    _in_step = False


def read(*tensors: Tensor, end_step: bool = True) -> list[list[float]]:
    """The values of ``tensors`` on the host, fetched in one transfer with every pending
    check; raises the first failed check's error (after clearing them all).

    Args:
        tensors: what the caller needs on the host (any dtypes; read as float64, which holds
            every flag, count and tag exactly).
        end_step: end the current step (checks are judged at once until the next one).
    """
    global _in_step
    if _capturing and not tensors:  # the step's checks: read after each replay instead
        if end_step:
            _in_step = False
        return []
    pending = list(_pending)
    _pending.clear()
    if end_step:
        _in_step = False
    values = _fetch([v for v, _ in pending] + list(tensors))
    _raise_first(pending, values)
    return values[len(pending) :]


def upload(values: Sequence[float], like: Tensor) -> Tensor:
    """``values`` as a 1-d tensor of ``like``'s dtype on its device, without a wait.

    A copy from ordinary (pageable) host memory to a GPU first waits for the device's
    stream; one from pinned memory, made asynchronous, does not.
    """
    t = torch.tensor(list(values), dtype=like.dtype)
    if like.device.type == "cuda":
        return t.pin_memory().to(like.device, non_blocking=True)
    return t.to(like.device)


def _fetch(tensors: Sequence[Tensor]) -> list[list[float]]:
    if not tensors:
        return []
    if _capturing:
        raise CaptureError(
            "this meta-step reads a device value on the host, which a CUDA graph cannot "
            "record; run it without CapturedStep"
        )
    if any(_costly(t) for t in tensors):
        for c in _counters:
            c.reads += 1
    sizes = [t.numel() for t in tensors]
    flat: list[float] = []
    devices = {t.device for t in tensors}
    if len(devices) == 1:
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    else:  # one transfer per device, each in the order given
        by_device = {
            d: torch.cat(
                [t.reshape(-1).to(torch.float64) for t in tensors if t.device == d]
            ).tolist()
            for d in devices
        }
        offsets = dict.fromkeys(devices, 0)
        for t in tensors:
            o = offsets[t.device]
            flat.extend(by_device[t.device][o : o + t.numel()])
            offsets[t.device] = o + t.numel()
    out, o = [], 0
    for n in sizes:
        out.append(flat[o : o + n])
        o += n
    return out
