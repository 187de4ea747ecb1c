"""The gradient SUM that ends a meta-step, chosen once when ``MetaDDP`` is built.

- :class:`BucketedSum`: after the backward, every trained parameter's ``.grad`` in buckets,
  with one has-gradient flag per parameter in the same buckets.
- :class:`OverlappedSum`: the same buckets, each launched during the backward as soon as its
  gradients are final (:mod:`metaddp.distributed._overlap`).
- :class:`ExactSum`: deterministic mode, whose backward already summed the meta-gradient
  order-free; only the values and the step's checks remain.

Each carries, in the same collective, the caller's values and the *rider* (the guards' values
for the step: the summed meta-loss, finite exactly when every rank's share is, and the ranks'
verdicts), and returns their sums with the rider's last. The step's one host read happens here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from .. import _host
from .._reach import listing
from ._collectives import Group, Phase, group_size, launch_sum
from ._exact import ExactSums
from ._overlap import FinalGrads, GradReducer
from ._sharded import as_like, is_dtensor, local

Rider = Callable[[Tensor], Tensor]
"""Given a tensor of the gradients' dtype and device, a 1-d tensor to sum with them (of the
same length at every step)."""


@dataclasses.dataclass(frozen=True)
class Summing:
    """What every strategy sums with: the wrapped module (its trained parameters), the
    group, the bucket size, the settings' salt for the tag, the rider, whether a parameter
    no rank reached is allowed, and the parameters the module says its meta-loss never
    reaches (a bilevel problem's inner weights, trained by a step of the caller's own)."""

    module: nn.Module
    group: Group
    bucket_bytes: int
    salt: Callable[[], int]
    rider: Rider
    allow_unused: bool
    not_reached: frozenset[str] = frozenset()

    def raise_missing(self, missing: list[str]) -> None:
        raise_missing([n for n in missing if n not in self.not_reached], self.allow_unused)


def _trained(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def raise_missing(missing: list[str], allow_unused: bool) -> None:
    """Refuse parameters no rank produced a gradient for, unless they are allowed."""
    if missing and not allow_unused:
        raise ValueError(
            f"no rank produced a gradient for: {listing(missing)}. Call backward() on the "
            "meta-loss before sync_grads(); if these parameters are not meant to train, set "
            "requires_grad=False or build MetaDDP with allow_unused=True."
        )


class BucketedSum:
    """Every trained parameter's gradient summed after the backward, in buckets. Where there
    are ranks to sum over, a gradient changed between the backward and the sum is refused
    (:class:`FinalGrads`, as the overlapped sum does)."""

    capture_refusal: str | None = None

    def __init__(self, how: Summing) -> None:
        self.how = how
        self.grads = FinalGrads(_trained(how.module))
        self._hooks = self.grads.hooks() if group_size(how.group) > 1 else []

    def finish(self, extra: list[Tensor]) -> list[float]:
        edited = self.grads.edited()
        self.grads.final = {}
        got = self._finish(extra)
        self.grads.refuse(edited)  # after the SUM, which every rank joins
        return got

    def _finish(self, extra: list[Tensor]) -> list[float]:
        how = self.how
        named = _trained(how.module)
        params = [p for _, p in named]
        # An FSDP2 model's DTensors (distributed/_sharded.py): their rows, summed as shards.
        grads = [
            local(p.grad) if p.grad is not None else local(p.detach()).new_zeros(local(p).shape)
            for p in params
        ]
        # One has-gradient flag per parameter rides in the same buckets as the gradients.
        has_grad = [float(p.grad is not None) for p in params]
        flags = _host.upload(has_grad, params[0]) if params else torch.zeros(0)
        tail = torch.cat([flags, *(v.to(flags) for v in extra), how.rider(flags)])
        reduced = self._sum(params, grads, tail)
        # The step's one host read: these flags and every check the step left on the device.
        (got,) = _host.read(reduced[-1])
        how.raise_missing([n for (n, _), f in zip(named, got, strict=False) if f == 0])
        with torch.no_grad():
            for p, g, f in zip(params, reduced, got, strict=False):
                if f > 0 and g is not p.grad:  # one rank: the gradient is its own sum
                    self._store(p, g)
        return got[len(params) :]

    def _sum(self, params: list[nn.Parameter], grads: list[Tensor], tail: Tensor) -> list[Tensor]:
        """The SUM of each gradient, then of the tail, over the mesh."""
        how = self.how
        if group_size(how.group) == 1:  # nothing to sum (nor a tag to salt): no copies
            return grads + [tail]
        return launch_sum(
            grads + [tail], how.group, how.bucket_bytes, Phase.GRADIENTS, how.salt()
        ).wait()

    def _store(self, p: nn.Parameter, summed: Tensor) -> None:
        p.grad = summed if p.grad is None else p.grad.copy_(summed)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        yield  # nothing starts before finish()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


_NORMS = frozenset(
    {
        torch._foreach_norm,
        torch.linalg.vector_norm,
        torch.linalg.norm,
        torch.norm,
        Tensor.norm,
    }
)


class Rows(Tensor):
    """The rows of a meta-gradient that a rank holds (``shard=True``): every elementwise
    use (an optimizer's step) as a plain tensor, a norm refused, since it would be one rank's
    rows' (``torch.nn.utils.clip_grad_norm_`` on ``learner.parameters()``)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _NORMS:
            raise RuntimeError(
                "a norm of sharded gradients: with shard=True each rank holds its rows of the "
                "meta-gradient, so torch.nn.utils.clip_grad_norm_ (or any norm of .grad) would "
                "see one rank's rows. Use learner.clip_grad_norm_(max_norm), which sums the "
                "squares over the ranks"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class ShardedSum(BucketedSum):
    """Sharded meta-parameters (``MetaDDP(..., shard=True)``): the backward's reduce-scatter
    summed each shard's gradient over its sample group already, so shards are summed over
    the task axis only (the ranks that hold the same rows); every other trained parameter,
    the values and the rider over the whole mesh, as :class:`BucketedSum`. Summed shards
    are stored as :class:`Rows`, which refuse a norm."""

    capture_refusal: str | None = "the sharded layout's gathers are not recorded in CUDA graphs"

    def __init__(self, how: Summing, shards: set[int], shard_group: Group) -> None:
        super().__init__(how)
        self.shards, self.shard_group = shards, shard_group

    def _sum(self, params: list[nn.Parameter], grads: list[Tensor], tail: Tensor) -> list[Tensor]:
        how = self.how
        sharded = [i for i, p in enumerate(params) if id(p) in self.shards]
        whole = [i for i, p in enumerate(params) if id(p) not in self.shards]
        pending = [
            launch_sum(part, group, how.bucket_bytes, Phase.GRADIENTS, how.salt())
            for part, group in (
                ([grads[i] for i in sharded], self.shard_group),
                ([grads[i] for i in whole] + [tail], how.group),
            )
        ]
        rows, rest = (p.wait() for p in pending)
        out = [tail] * (len(params) + 1)
        for i, g in zip(sharded + whole + [len(params)], rows + rest, strict=True):
            out[i] = g
        return out

    def _store(self, p: nn.Parameter, summed: Tensor) -> None:
        if is_dtensor(p):  # a DTensor placed as its parameter (whose norms are global)
            p.grad = as_like(summed, p)
        elif id(p) in self.shards:  # a new tensor each step: a Rows, whatever .grad was
            p.grad = summed.as_subclass(Rows)
        else:
            super()._store(p, summed)


class OverlappedSum:
    """The buckets of :class:`BucketedSum`, launched during the backward
    (:class:`metaddp.distributed._overlap.GradReducer`)."""

    capture_refusal = (
        "overlapped gradient sums start from backward hooks on the host; build "
        "MetaDDP(..., overlap=False)"
    )

    def __init__(self, how: Summing) -> None:
        self.how = how
        self.reducer = GradReducer(
            _trained(how.module), how.group, how.bucket_bytes, salt=how.salt, rider=how.rider
        )

    def finish(self, extra: list[Tensor]) -> list[float]:
        missing, got = self.reducer.finish(extra)
        self.refuse_changed()
        self.how.raise_missing(missing)
        return [*got, *self.reducer.rode]

    def refuse_changed(self) -> None:
        """Refuse trained parameters other than those the buckets were planned for. Also
        before a step's work (no collective): a parameter frozen on one rank alone would
        otherwise change the size of the inner steps' sums there, where gloo aborts."""
        now = [p for p in self.how.module.parameters() if p.requires_grad]
        if len(now) != len(self.reducer.params) or any(
            a is not b for a, b in zip(now, self.reducer.params, strict=True)
        ):
            raise ValueError(
                "the set of trained parameters (requires_grad=True) changed on this rank after "
                "MetaDDP was built; freeze or add parameters before wrapping the module, or "
                "build MetaDDP with overlap=False and change them on every rank alike."
            )

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self.reducer.paused()

    def accumulates(self) -> None:
        """One backward per task from now on (``clone()`` loops): sums start in finish()."""
        self.reducer.accumulates = True

    def remove(self) -> None:
        self.reducer.remove()


class ExactSum:
    """Deterministic mode: the backward of ``meta_loss`` summed the meta-gradient on every
    rank (``ExactSums.spread_tasks``); only the values and the step's checks remain."""

    capture_refusal = "deterministic mode keeps per-step state on the host"

    def __init__(self, how: Summing, exact: ExactSums) -> None:
        self.how, self.exact = how, exact

    def finish(self, extra: list[Tensor]) -> list[float]:
        if not self.exact.used:
            _host.discard()
            raise RuntimeError(
                "deterministic mode: sync_grads() follows the backward of learner.meta_loss(...), "
                "which sums the meta-gradient itself; no meta_loss ran since the last "
                "sync_grads(), so these gradients would be one rank's"
            )
        self.exact.used = False
        how = self.how
        named = _trained(how.module)
        like = named[0][1].detach() if named else torch.zeros(0)
        tail = torch.cat([*(v.to(like) for v in extra), how.rider(like)])
        # The settings' salt in this SUM's tag: ranks whose algorithms differ fail here, as
        # they do at the default mode's gradient SUM.
        summed = launch_sum([tail], how.group, phase=Phase.GRADIENTS, salt=how.salt()).wait()[0]
        (got,) = _host.read(summed)
        how.raise_missing([n for n, p in named if p.grad is None])
        return got

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        yield

    def remove(self) -> None:
        pass
