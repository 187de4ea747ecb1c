"""``MetaDDP``: the place ``DistributedDataParallel`` had, for meta-learning.

DDP reduces gradients with hooks on the leaves' gradient accumulators, divides by the world
size, and cannot be differentiated through. Here the module runs untouched; the inner-loop
reductions are differentiable collectives the algorithm calls through :attr:`reduce`; and
after the outer backward :meth:`sync_grads` SUM-reduces every leaf's ``.grad``. Because every
rank's loss is its share of the global mean, that sum *is* the global meta-gradient.
With ``overlap`` (the default on more than one rank) that sum starts during the outer backward,
one bucket as soon as its gradients are final (:class:`metaddp._overlap.GradReducer`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ._collectives import (
    DEFAULT_BUCKET_BYTES, all_reduce_sum, all_reduce_sum_, broadcast_, group_size, max_abs_difference,
)
from ._overlap import GradReducer
from ._world import Mesh


class MetaDDP(nn.Module):
    """Keep a module's meta-parameters identical on every rank and sum their gradients.

    Args:
        module: any ``nn.Module`` (a model, or an algorithm such as :class:`metaddp.MAML`
            holding the model and learnable hyper-parameters).
        mesh: how ranks share the work (:class:`metaddp.Mesh`); default: sample-parallel.
        broadcast: copy rank 0's parameters and buffers to every rank at construction. With
            ``False``, the ranks' weights are compared instead and a difference is an error.
        allow_unused: leave ``.grad`` as ``None`` for a parameter that got no gradient on any
            rank, instead of raising.
        bucket_bytes: size of the flattened buckets each collective moves.
        overlap: start each bucket's gradient all-reduce during the outer backward, as soon as
            its gradients are final, and only wait for them in :meth:`sync_grads`. Then
            backward() must run once per sync_grads() (accumulate inside :meth:`no_sync`).
    """

    def __init__(
        self, module: nn.Module, mesh: Mesh | None = None, *, broadcast: bool = True,
        allow_unused: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
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
        self.module = module
        self.mesh = mesh if mesh is not None else Mesh.create()
        self.allow_unused = allow_unused
        self.bucket_bytes = bucket_bytes
        state = list(module.parameters()) + list(module.buffers())
        if broadcast:
            broadcast_(state, src=0, group=self.mesh.group)
        else:
            self.check_in_sync()
        # Hooks only where there is something to overlap with: on one rank the sum is a copy.
        self._reducer: GradReducer | None = None
        if overlap and group_size(self.mesh.group) > 1:
            trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            if trained:
                self._reducer = GradReducer(trained, self.mesh.group, bucket_bytes)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def reduce(self):
        """Differentiable SUM over the ranks that share a task's samples (for the inner loop)."""
        return functools.partial(all_reduce_sum, group=self.mesh.sample_group,
                                 bucket_bytes=self.bucket_bytes)

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
        named = list(self.module.named_parameters()) + list(self.module.named_buffers())
        spread = max_abs_difference([t for _, t in named], group=self.mesh.group)
        bad = [f"{name} (max difference {d:.3g})" for (name, _), d in zip(named, spread) if d > 0]
        if bad:
            raise ValueError(
                "ranks hold different weights: " + ", ".join(bad[:5])
                + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
                + ". Seed every rank alike, load the same checkpoint, or build MetaDDP with "
                "broadcast=True to copy rank 0's weights."
            )

    def sync_grads(self) -> None:
        """SUM every meta-parameter's ``.grad`` over all ranks of the mesh (bucketed).

        Call after the outer ``backward()`` and before ``optimizer.step()``. A parameter with
        no gradient on some ranks counts as zero there; one with no gradient on any rank is
        an error unless ``allow_unused``.
        """
        if self._reducer is not None:
            missing = self._reducer.finish()
            self._check_trained_unchanged()
            self._raise_missing(missing)
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            return
        grads = [p.grad if p.grad is not None else p.detach().new_zeros(p.shape) for p in params]
        # One has-gradient flag per parameter rides in the same buckets as the gradients.
        flags = params[0].detach().new_tensor([float(p.grad is not None) for p in params])
        all_reduce_sum_(grads + [flags], group=self.mesh.group, bucket_bytes=self.bucket_bytes)
        names = {id(p): n for n, p in self.module.named_parameters()}
        missing = [names[id(p)] for p, f in zip(params, flags.tolist()) if f == 0]
        self._raise_missing(missing)
        for p, g, f in zip(params, grads, flags.tolist()):
            if f > 0:
                p.grad = g

    def _check_trained_unchanged(self) -> None:
        assert self._reducer is not None
        now = [p for p in self.module.parameters() if p.requires_grad]
        if len(now) != len(self._reducer.params) or any(a is not b for a, b in zip(now, self._reducer.params)):
            raise ValueError(
                "the set of trained parameters (requires_grad=True) changed after MetaDDP was "
                "built; freeze or add parameters before wrapping the module, or build MetaDDP "
                "with overlap=False."
            )

    def _raise_missing(self, missing: list[str]) -> None:
        if missing and not self.allow_unused:
            raise ValueError(
                "no rank produced a gradient for: " + ", ".join(missing[:5])
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                + ". Call backward() on the meta-loss before sync_grads(); if these parameters "
                "are not meant to train, set requires_grad=False or build MetaDDP with "
                "allow_unused=True."
            )
