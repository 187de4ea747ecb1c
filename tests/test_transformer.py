"""A transformer meta-trained with dropout on, at world sizes 1 to 3 and, in the hybrid layout,
4 (the shared process groups of tests/conftest.py; the problems are
tests/compared_workers.py's, run where its ``runs_at`` says), against a float64
single-process reference written here.

The reference shares nothing with metaddp but the model's initial weights
(``p.build_model().state_dict()``) and the tasks (``p.task(i)``): TinyTransformer's forward
written out from its weights (``nn.TransformerEncoderLayer``, post-norm, ReLU, then the
causal attention block), and its dropout masks from the key specification of keyed dropout,
implemented again here with numpy integers (a blake2b digest of the keys, the ``lowbias32``
hash), so a mask keyed by anything else (a rank's own generator, a local sample index, the
calls counted in another order) fails the comparison.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct

import numpy as np
import pytest
import torch

from compared_workers import name, problems, worlds_of
from metaddp.testing import scenarios as S

# Float64. Between world sizes only the order of floating-point sums changes; against the
# reference the arithmetic is grouped differently too (metaddp's own attention, the hand-
# written layer norms). Observed: at most 6e-16 relative. 1e-12 leaves three orders of margin
# for rounding that second derivatives through softmax and layer norm amplify; a wrong mask
# (another seed, or dropout off) moves the meta-gradient by more than 1e-2 relative, one mask
# entry flipped (of the ~2000 a forward draws) by about 1e-3.
RTOL = 1e-12

P = 0.1  # TinyTransformer's dropout everywhere
HEADS = 2
EPS = 1e-5  # nn.LayerNorm's and nn.TransformerEncoderLayer's
SEED = 0  # Algorithm.draw_seed
STEP = 0  # the meta-step: Problem.meta_step, told by at_step(0)


@pytest.fixture(scope="module")
def results(worlds) -> dict[int, list[list[dict]]]:
    # Run in the shared process groups of tests/conftest.py (world sizes 1 to 4).
    return {w: [rank["compared"] for rank in worlds[w]] for w in (1, 2, 3, 4)}


INDICES = [i for i, p in enumerate(problems()) if p.model == "transformer"]


# ---------------------------------------------------------------- the keyed masks, again

M32 = np.uint64(0xFFFFFFFF)


def mix(*parts: int) -> tuple[int, int]:
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}q", *parts), digest_size=8).digest()
    k0, k1 = struct.unpack("<II", digest)
    return k0, k1


def lowbias32(x: np.ndarray) -> np.ndarray:
    """On uint64 arrays holding 32-bit values: every product of two 32-bit values fits."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & M32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & M32
    return x ^ (x >> np.uint64(16))


def keep(seed: int, task: int, forward: int, call: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The multiplier of dropout call ``call`` (1-based) of forward ``forward`` of global task
    ``task`` on a whole batch of ``shape``: rows are the samples' global indices, entries
    their flat C-order positions within a sample (for attention probabilities [N, heads, L,
    S] that is (h * L + i) * S + j)."""
    k0, k1 = mix(seed, STEP, task, forward, call)
    rows = np.arange(shape[0], dtype=np.uint64).reshape(-1, *[1] * (len(shape) - 1))
    entries = np.arange(math.prod(shape[1:]), dtype=np.uint64).reshape(shape[1:])
    bits = lowbias32(lowbias32(lowbias32((rows + np.uint64(k0)) & M32) ^ entries) ^ np.uint64(k1))
    kept = bits >= np.uint64(round(P * 2**32))
    return torch.from_numpy(np.where(kept, 1.0 / (1.0 - P), 0.0))


# ---------------------------------------------------------------- TinyTransformer by hand


def linear(w: dict, prefix: str, x: torch.Tensor, sep: str = ".") -> torch.Tensor:
    return x @ w[f"{prefix}{sep}weight"].T + w[f"{prefix}{sep}bias"]


def layer_norm(w: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + EPS) * w[f"{prefix}.weight"] + w[f"{prefix}.bias"]


def attend(q, k, v, drop, call: int, causal: bool) -> torch.Tensor:
    """[N, heads, L, hd] each: softmax(q k^T / sqrt(hd)), dropout on the probabilities, @ v."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:  # top-left aligned: query i sees keys j <= i
        length = q.shape[-2]
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    return drop(torch.softmax(scores, dim=-1), call) @ v


def forward(w: dict, x: torch.Tensor, drop) -> torch.Tensor:
    """TinyTransformer's training-mode forward; ``drop(t, call)`` is the ``call``-th dropout."""
    h = linear(w, "embed", x)
    n, length, width = h.shape

    def heads(t):  # [N, L, D] -> [N, heads, L, hd]
        return t.reshape(n, length, HEADS, -1).transpose(1, 2)

    def merge(t):  # [N, heads, L, hd] -> [N, L, D]
        return t.transpose(1, 2).reshape(n, length, width)

    # nn.TransformerEncoderLayer, post-norm: the packed in-projection split into q, k, v.
    q, k, v = linear(w, "encoder.self_attn.in_proj", h, sep="_").chunk(3, dim=-1)
    a = linear(w, "encoder.self_attn.out_proj", merge(attend(heads(q), heads(k), heads(v), drop, 1, False)))
    h = layer_norm(w, "encoder.norm1", h + drop(a, 2))
    f = linear(w, "encoder.linear2", drop(torch.relu(linear(w, "encoder.linear1", h)), 3))
    h = layer_norm(w, "encoder.norm2", h + drop(f, 4))
    # The causal SelfAttention block, then self.drop, the residual and the norm.
    q, k, v = linear(w, "attention.qkv", h).reshape(n, length, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
    a = linear(w, "attention.out", merge(attend(q, k, v, drop, 5, True)))
    h = layer_norm(w, "norm", h + drop(a, 6))
    return linear(w, "head", h.mean(dim=1)).squeeze(-1)


def dropout(seed: int | None, task: int, number: int):
    """The dropout of forward ``number`` of ``task`` (``seed`` None: dropout off)."""

    def drop(t: torch.Tensor, call: int) -> torch.Tensor:
        return t if seed is None else t * keep(seed, task, number, call, tuple(t.shape))

    return drop


def meta_loss(p: S.Problem, theta: dict, seed: int | None = SEED) -> torch.Tensor:
    """MAML: mean over tasks of the query mean squared error after ``p.steps`` SGD steps on the
    support's; forwards numbered 0.. K-1 on the support, K on the query."""
    total = 0.0
    for t in range(p.n_tasks):
        task = p.task(t)
        fast = theta
        for step in range(p.steps):
            pred = forward(fast, task.support.x, dropout(seed, t, step))
            loss = ((pred - task.support.y) ** 2).mean()
            g = torch.autograd.grad(loss, list(fast.values()), create_graph=not p.first_order)
            fast = {k: f - p.inner_lr * gi for (k, f), gi in zip(fast.items(), g)}
        pred = forward(fast, task.query.x, dropout(seed, t, p.steps))
        total = total + ((pred - task.query.y) ** 2).mean()
    return total / p.n_tasks


@functools.cache
def reference(p: S.Problem, seed: int | None = SEED) -> tuple[float, dict[str, torch.Tensor]]:
    """The meta-loss and its gradient by parameter name, in one float64 process."""
    assert p.dtype == torch.float64 and p.algorithm == "maml" and p.optimizer == "sgd"
    state = p.build_model().state_dict()
    assert state["encoder.self_attn.in_proj_weight"].shape == (24, 8)  # width 8, 2 heads
    theta = {k: v.detach().clone().requires_grad_() for k, v in state.items()}
    loss = meta_loss(p, theta, seed)
    grads = torch.autograd.grad(loss, list(theta.values()))
    return float(loss.detach()), dict(zip(theta, grads))


def flat(d: dict, keys: list[str]) -> torch.Tensor:
    return torch.cat([d[k].flatten() for k in keys])


def relative(got: dict, want: dict) -> float:
    keys = sorted(want)
    assert sorted(got) == keys
    w = flat(want, keys)
    return float((flat(got, keys) - w).abs().max() / w.abs().max())


# ---------------------------------------------------------------- the checks


def test_the_transformer_problems_are_compared():
    kinds = {(problems()[i].layout, problems()[i].first_order, problems()[i].batched) for i in INDICES}
    want = {(layout, False, None) for layout in S.LAYOUTS} | {("hybrid", True, None), ("sample", False, True)}
    assert kinds == want


@pytest.mark.parametrize("index", INDICES, ids=[name(problems()[i]) for i in INDICES])
def test_meta_gradient_and_loss_match_single_process(results, index):
    p = problems()[index]
    want_loss, want = reference(p)
    assert float(flat(want, sorted(want)).abs().max()) > 1e-3  # a meaningful gradient
    for world in worlds_of(p, results):
        for rank, everything in enumerate(results[world]):
            r = everything[index]
            err = relative(r["grads"], want)
            assert err < RTOL, f"{name(p)} world {world} rank {rank}: rel err {err:.3g}"
            err = abs(r["loss"] - want_loss) / abs(want_loss)
            assert err < RTOL, f"{name(p)} world {world} rank {rank}: loss rel err {err:.3g}"


@pytest.mark.parametrize(
    "index", INDICES[:1] + INDICES[-1:], ids=[name(problems()[i]) for i in INDICES[:1] + INDICES[-1:]]
)
def test_other_masks_would_differ(results, index):
    """The comparison can fail: the masks of another seed, or dropout off, give another
    meta-gradient, by far more than the tolerance."""
    p = problems()[index]
    got = results[1][0][index]["grads"]
    for seed in (1, None):
        loss, grads = reference(p, seed)
        err = relative(got, grads)
        assert err > 1e-2, f"seed {seed}: rel err only {err:.3g}"
        assert abs(results[1][0][index]["loss"] - loss) > 1e6 * RTOL * abs(loss)
