"""Batch statistics over a batch split across ranks, differentiable to any order.

Per-rank BatchNorm statistics change with the number of ranks. Inside
:func:`sync_batchnorm`, every BatchNorm layer of a module computes its batch mean and
variance from SUM-reductions of ``(count, sum(x - k), sum((x - k)^2))`` per channel through the
``reduce`` it is given (a differentiable SUM over the ranks that split the batch), so the
normalisation, its gradients and its higher derivatives are those of one process on the whole
batch. ``k`` is a per-channel shift identical on every rank (the running mean when one is
tracked, else zero) that keeps ``E[(x-k)^2] - E[x-k]^2`` from cancelling catastrophically.

Nothing here knows about meta-learning: ``reduce`` is any differentiable SUM (e.g.
``MetaDDP.reduce``; the identity on one process, which gives plain batch statistics).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from .. import _host, _mask
from .._types import Reduce


def synced_batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    momentum: float,
    eps: float,
    reduce: Reduce,
) -> Tensor:
    """``F.batch_norm(x, ..., training=True, ...)`` with batch statistics over every rank's
    shard: what a layer's own ``F.batch_norm`` call becomes inside :func:`sync_batchnorm`.

    The arguments are those the layer passes (so it works under
    ``torch.func.functional_call``: the weights and buffers as they are at call time). Where
    the layer tracks running statistics they are updated in place from the *global*
    statistics (unbiased variance, as PyTorch does), hence identically on every rank.
    """
    if x.dim() < 2:
        raise ValueError(f"BatchNorm expects input of shape [N, C, ...], got {tuple(x.shape)}")
    channels = x.shape[1]
    dims = [0] + list(range(2, x.dim()))
    shape = [1, channels] + [1] * (x.dim() - 2)
    shift = (running_mean.detach() if running_mean is not None else x.new_zeros(channels)).to(
        x.dtype
    )
    xc = x - shift.view(shape)
    mask = _mask.current()
    if mask is None:
        count = x.new_full((1,), x.numel() // channels if channels else 0)
        count, s1, s2 = reduce([count, xc.sum(dims), (xc * xc).sum(dims)])
    else:
        # Padded samples (mask 0) stay out of the statistics, and so out of their gradients.
        w = mask.to(x.dtype).view([-1] + [1] * (x.dim() - 1))
        count = (w.sum() * math.prod(x.shape[2:])).reshape(1)
        xw = xc * w
        count, s1, s2 = reduce([count, xw.sum(dims), (xw * xc).sum(dims)])
    # Judged on the host at the step's one read on a GPU (metaddp._host), at once on the CPU.
    # Under vmap (tasks stacked) the count cannot leave the transform; the stacked path only
    # takes tasks with samples (metaddp.algorithms._stacked.batchable).
    if not torch._C._functorch.is_functorch_wrapped_tensor(count):
        empty = "BatchNorm over an empty global batch: no rank holds any sample"
        _host.check(count, _at_least(1, empty))
    mean_c = s1 / count  # mean of (x - shift)
    var = s2 / count - mean_c * mean_c  # biased variance, used to normalise
    y = (xc - mean_c.view(shape)) * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    if running_mean is not None and running_var is not None:
        if not torch._C._functorch.is_functorch_wrapped_tensor(count):
            _host.check(
                count,
                _at_least(
                    2,
                    "BatchNorm in training mode needs more than one value per channel over "
                    "the global batch to estimate a variance",
                ),
            )
        with torch.no_grad():
            mean = (mean_c + shift).detach()
            n = count.detach()
            running_mean.mul_(1 - momentum).add_(momentum * mean)
            running_var.mul_(1 - momentum).add_(momentum * var.detach() * (n / (n - 1)))
    return y


def _at_least(least: int, message: str) -> _host.Verdict:
    def verdict(count: list[float]) -> Exception | None:
        return ValueError(message) if count[0] < least else None

    return verdict


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in module.modules())


class _Global(TorchFunctionMode):
    """Entered around one BatchNorm layer's forward: its ``F.batch_norm`` call with batch
    statistics takes them over every rank (:func:`synced_batch_norm`); anything else is
    PyTorch's."""

    def __init__(self, sync: BatchNormSync) -> None:
        super().__init__()
        self.sync = sync

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            a = _bound(args, kwargs)
            if a is not None and a["training"]:
                return synced_batch_norm(
                    a["input"],
                    a["running_mean"],
                    a["running_var"],
                    a["weight"],
                    a["bias"],
                    float(a["momentum"]),
                    float(a["eps"]),
                    self.sync.reduce,
                )
        return func(*args, **kwargs)


_SIGNATURE = inspect.signature(F.batch_norm)  # PyTorch's own names and defaults


_NAMES = tuple(_SIGNATURE.parameters)


def _bound(args: tuple, kwargs: dict) -> dict[str, Any] | None:
    a = dict(zip(_NAMES, args, strict=False))
    if len(args) <= len(_NAMES) and not a.keys() & kwargs.keys():
        a.update(kwargs)
        if len(a) == len(_NAMES):  # every argument given, as torch's layers give them
            return a
    try:
        bound = _SIGNATURE.bind(*args, **kwargs)
    except TypeError:  # a wrong call: PyTorch's own error says what is wrong
        return None
    bound.apply_defaults()
    return bound.arguments


class _Enter:
    """A layer's forward pre-hook: the layer runs inside its :class:`BatchNormSync`'s mode."""

    def __init__(self, mode: _Global) -> None:
        self.mode = mode

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.mode.__enter__()

    def __deepcopy__(self, memo: dict) -> _Enter:
        # A copy of the module (copy.deepcopy) keeps its layers' hooks, shared: its
        # statistics are global too, and nothing of the process group is copied.
        return self


class BatchNormSync:
    """Every BatchNorm layer of a module takes global batch statistics until :meth:`remove`.

    Made by :func:`sync_batchnorm`; also a context manager that removes itself on exit.
    Nothing of the module is replaced: each layer gets a forward pre-hook and a forward hook
    (which runs even where the forward raises) that enter and leave a function mode around
    the layer's own forward, so the layer's ``F.batch_norm`` call is the one that changes.
    """

    def __init__(self, module: nn.Module, reduce: Reduce) -> None:
        self.module = module
        layers = [m for m in module.modules() if isinstance(m, _BatchNorm)]
        if any(isinstance(h, _Enter) for m in layers for h in m._forward_pre_hooks.values()):
            raise RuntimeError(
                "the BatchNorm layers of this module are already synchronized (MetaDDP does "
                "it when it wraps a module, or an enclosing sync_batchnorm): do not nest it, "
                "and call release() on a MetaDDP before wrapping its module again"
            )
        self.reduce = reduce  # read at every call: MetaDDP.local() swaps it for the identity
        mode = _Global(self)

        def leave(module: nn.Module, args: tuple, output: Any) -> None:
            mode.__exit__(None, None, None)

        self._handles = []
        for m in layers:
            self._handles.append(m.register_forward_pre_hook(_Enter(mode)))
            self._handles.append(m.register_forward_hook(leave, always_call=True))

    def remove(self) -> None:
        """Take the hooks off every layer."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> nn.Module:
        return self.module

    def __exit__(self, *exc: object) -> None:
        self.remove()


def sync_batchnorm(module: nn.Module, reduce: Reduce) -> BatchNormSync:
    """Make every BatchNorm layer of ``module`` use global batch statistics.

    :class:`metaddp.MetaDDP` does this itself for the module it wraps; call it directly only
    for hand-made set-ups without the wrapper.

    Args:
        module: any module containing ``nn.BatchNorm1d/2d/3d`` layers (others are untouched).
        reduce: a differentiable SUM over the ranks that split each batch. Every such rank
            must run the same forward passes in the same order (a rank with an empty shard
            still takes part).

    Returns:
        A handle: ``.remove()`` takes its hooks off the layers; ``with sync_batchnorm(m,
        reduce):`` takes them off on exit. Nothing else of the module is changed (running statistics
        are updated as a BatchNorm layer would, from the global statistics).
    """
    return BatchNormSync(module, reduce)
