"""metaddp.forward.attention against torch's math path: values and derivatives of first,
second and third order, every mask and option, chunk sizes that do and do not divide the rows,
and the memory its second-order graph saves (linear in T, the math path's quadratic)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from metaddp.forward import attention

# float64 throughout: the math path and ours are the same formula in another order (the max
# subtracted, the scale applied once, rows in chunks), so they agree to rounding: a few eps
# (2.2e-16) times the number of terms summed (S, E <= 8) and the entries' size (O(1) to O(10)).
# Errors seen: ~1e-15 for values and first derivatives, ~1e-14 for second and third. The
# tolerances leave 100-1000x room for other BLAS orders, and are still a million times below any
# mistake in a formula (a missing term, a wrong mask row) that changes a derivative.
TOL = {1: 1e-12, 2: 1e-11, 3: 1e-10}  # order of derivative (values count as order 1) -> atol=rtol
CHUNKS = (1, 2, 3, None)


def math_sdpa(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def rand(*shape, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)


def close(a, b, order, what):
    torch.testing.assert_close(a, b, atol=TOL[order], rtol=TOL[order], msg=lambda m: f"{what}: {m}")


def derivatives(f, inputs, orders=2):
    """The value of ``f(*inputs)`` and derivatives of orders 1..``orders`` of nonlinear scalars
    of the previous order's gradients (each a function of every input), with graphs."""
    out = f(*inputs)
    results = [out]
    scalar = (out * rand(*out.shape, seed=99, grad=False)).sum()
    for order in range(1, orders + 1):
        gs = torch.autograd.grad(scalar, inputs, create_graph=True, allow_unused=True, materialize_grads=True)
        results.append(gs)
        scalar = sum((g.square() * (i + 1) + g.sin()).sum() for i, g in enumerate(gs)) / (order + 1)
    return results


def compare(ours, theirs, inputs, orders=2):
    got, want = derivatives(ours, inputs, orders), derivatives(theirs, inputs, orders)
    close(got[0], want[0], 1, "values")
    for order in range(1, orders + 1):
        for i, (a, b) in enumerate(zip(got[order], want[order])):
            close(a, b, order, f"order {order} derivative of input {i}")


B, H, L, S, E = 2, 2, 7, 6, 3


def case(name):
    """(inputs, kwargs for both paths besides the mask, index of a mask in inputs or None)."""
    q, k, v = rand(B, H, L, E, seed=1), rand(B, H, S, E, seed=2), rand(B, H, S, 4, seed=3)
    if name == "plain":
        return [q, k, v], {}
    if name == "scale":
        return [q, k, v], {"scale": 0.7}
    if name == "causal":
        return [q, k, v], {"is_causal": True}
    if name == "causal-more-keys":  # top-left aligned: row i sees keys 0..i of 9
        return [q, rand(B, H, 9, E, seed=8), rand(B, H, 9, 4, seed=9)], {"is_causal": True}
    if name == "gqa":
        return [rand(B, 4, L, E, seed=4), k, v], {"enable_gqa": True}
    if name == "bool-mask":  # every row keeps at least one key (rows masked entirely: their own test)
        m = rand(B, 1, L, S, seed=5, grad=False) > 0
        m[..., 0] = True
        return [q, k, v, m], {}
    if name == "float-mask":  # differentiated too, as the math path differentiates it
        return [q, k, v, rand(B, H, L, S, seed=6)], {}
    if name == "float-mask-row":  # broadcast over the rows: passed whole, gradients summed
        return [q, k, v, rand(1, S, seed=7)], {}
    if name == "bool-mask-1d":
        return [q, k, v, torch.tensor([True, False, True, True, False, True])], {}
    raise ValueError(name)


NAMES = (
    "plain",
    "scale",
    "causal",
    "causal-more-keys",
    "gqa",
    "bool-mask",
    "float-mask",
    "float-mask-row",
    "bool-mask-1d",
)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", NAMES)
def test_matches_math_path_to_second_order(name, chunk):
    inputs, kw = case(name)
    diff = [x for x in inputs if x.requires_grad]
    mask = inputs[3] if len(inputs) > 3 else None

    def call(fn):
        def f(*xs):
            it = iter(xs)
            q, k, v = (next(it) if x.requires_grad else x for x in inputs[:3])
            m = None if mask is None else (next(it) if mask.requires_grad else mask)
            return fn(q, k, v, attn_mask=m, **kw) if fn is math_sdpa else fn(q, k, v, attn_mask=m, chunk=chunk, **kw)

        return f

    compare(call(attention), call(math_sdpa), diff)


def test_third_order_and_shared_input():
    # Self-attention: one tensor as query, key and value (each level must still make one leaf per
    # input), rows 9 in chunks of 2 (the last chunk short), third order.
    x = rand(B, H, 9, 4, seed=10)
    compare(lambda x: attention(x, x, x, chunk=2), lambda x: math_sdpa(x, x, x), [x], orders=3)


def test_gradcheck_and_gradgradcheck():
    # Finite differences on small inputs (numbers of entries drive the cost), a float mask
    # differentiated too, chunks of 2 over 5 rows.
    q, k, v = rand(1, 2, 5, 3, seed=11), rand(1, 2, 4, 3, seed=12), rand(1, 2, 4, 2, seed=13)
    m = rand(1, 1, 5, 4, seed=14)

    def f(q, k, v, m):
        return attention(q, k, v, attn_mask=m, chunk=2)

    assert torch.autograd.gradcheck(f, (q, k, v, m))
    assert torch.autograd.gradgradcheck(f, (q, k, v, m))


def test_dropout_keep_against_hand_reference():
    p = 0.3
    q, k, v = rand(B, H, L, E, seed=20), rand(B, H, S, E, seed=21), rand(B, H, S, 4, seed=22)
    # The caller's deterministic mask (in practice from counter-based hashes of the positions).
    keep_all = (torch.rand(B, H, L, S, generator=torch.Generator().manual_seed(23)) > p).double() / (1 - p)
    asked = []

    def keep(rows):
        asked.append((rows.start, rows.stop))
        return keep_all[..., rows, :]

    def reference(q, k, v):  # softmax(q k^T / sqrt(E)) * mask @ v
        return (torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(E), -1) * keep_all) @ v

    compare(lambda q, k, v: attention(q, k, v, dropout_p=p, dropout_keep=keep, chunk=3), reference, [q, k, v])
    assert set(asked) == {(0, 3), (3, 6), (6, 7)}  # every level asks for the chunks' rows again
    with pytest.raises(ValueError, match="dropout_keep"):
        attention(q, k, v, dropout_p=p)
    # dropout_p = 0: no dropout, the mask is not used.
    close(attention(q, k, v, dropout_keep=keep), math_sdpa(q, k, v), 1, "dropout_p=0")


@pytest.mark.parametrize("chunk", CHUNKS)
def test_rows_masked_entirely_give_zeros_as_torch(chunk):
    # torch's math path (its _safe_softmax) gives zeros, not NaN, for a row with no key, and
    # zero gradients through it; so does attention.
    q, k, v = rand(1, 2, 5, 3, seed=30), rand(1, 2, 4, 3, seed=31), rand(1, 2, 4, 2, seed=32)
    m = torch.ones(5, 4, dtype=torch.bool)
    m[1] = False
    compare(lambda q, k, v: attention(q, k, v, m, chunk=chunk), lambda q, k, v: math_sdpa(q, k, v, m), [q, k, v])
    out = attention(q, k, v, m, chunk=chunk)
    assert (out[..., 1, :] == 0).all()


def test_refusals():
    q = rand(1, 3, 2, seed=40)
    with pytest.raises(ValueError, match="is_causal"):
        attention(q, q, q, torch.ones(3, 3, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="dropout_p"):
        attention(q, q, q, dropout_p=1.0, dropout_keep=lambda rows: torch.ones(()))
    with pytest.raises(ValueError, match="chunk"):
        attention(q, q, q, chunk=0)


class _Held:
    """One tensor autograd saved, counted while the graph keeps it."""

    __slots__ = ("tensor", "owner", "key", "__weakref__")

    def __init__(self, tensor, owner):
        self.tensor, self.owner, self.key = tensor, owner, tensor.untyped_storage().data_ptr()
        owner.hold(self.key, tensor.untyped_storage().nbytes(), +1)

    def __del__(self):
        self.owner.hold(self.key, 0, -1)


class SavedBytes:
    """Bytes of the distinct storages autograd holds for backward passes: ``now`` and ``peak``."""

    def __init__(self):
        self.refs, self.now, self.peak = {}, 0, 0

    def hold(self, key, nbytes, step):
        refs, size = self.refs.get(key, (0, nbytes))
        self.now += size * ((refs + step > 0) - (refs > 0))
        self.peak = max(self.peak, self.now)
        self.refs[key] = (refs + step, size)
        if refs + step == 0:
            del self.refs[key]


def saved_bytes(fn, T, B=1, H=2, E=8):
    """Bytes held for backward once the second-order graph is built (the forward, then the query
    gradient with ``create_graph=True``), the peak while building it, and one [B, H, T, T]
    float64 matrix."""
    q, k, v = rand(B, H, T, E, seed=50), rand(B, H, T, E, seed=51), rand(B, H, T, E, seed=52)
    counter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(t, counter), lambda h: h.tensor):
        loss = fn(q, k, v).square().sum()
        (g,) = torch.autograd.grad(loss, q, create_graph=True)
    held = counter.now
    g.square().sum().backward()  # the graph is usable to second order
    return held, counter.peak, B * H * T * T * 8


def test_second_order_graph_saves_memory_linear_in_T():
    B, H, E = 1, 2, 8
    ours = {T: saved_bytes(lambda q, k, v: attention(q, k, v, chunk=32), T, B, H, E) for T in (128, 256)}
    theirs = {T: saved_bytes(math_sdpa, T, B, H, E) for T in (128, 256)}
    for T in (128, 256):
        held, peak, matrix = ours[T]
        inputs = B * H * T * E * 8  # bytes of one [B, H, T, E] float64 tensor
        # The built graph holds q, k, v, the output (the loss's square keeps it) and the output's
        # gradient (the backward node keeps it): five input-sized tensors and a scalar, nothing
        # [T, T]; six allows the scalar. One matrix is T / E = 16 (T = 128) or 32 (T = 256) of them.
        assert held <= 6 * inputs, (T, held, inputs)
        # The math path holds at least the probabilities, one matrix (3 to 4 at second order).
        assert theirs[T][0] >= matrix, (T, theirs[T], matrix)
    # While the backward rebuilds a chunk, a few [B, H, 32, T] blocks (an eighth of a matrix each
    # at T = 256: scores, exponentials, their products) live besides: below half a matrix.
    assert ours[256][1] <= ours[256][2] // 2, ours[256]
    # Doubling T doubles what ours holds (the scalar aside) and nearly quadruples the math path's.
    assert ours[256][0] <= 2 * ours[128][0]
    assert theirs[256][0] >= 3.5 * theirs[128][0]
