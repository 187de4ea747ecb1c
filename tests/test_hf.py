"""Tiny Hugging Face transformers (GPT-2, BERT) meta-trained under metaddp with their defaults:
``sdpa`` attention and dropout 0.1, in training mode, float64.

Second-order MAML through the ``sdpa`` attention only runs on metaddp's routed attention
(PyTorch's fused CPU kernel has no double backward), and dropout under MetaDDP on several
processes only gives the one-process meta-gradient with metaddp's keyed masks. The problems
are tests/hf_workers.py's; their multi-process runs are part of the shared process groups of
tests/conftest.py (``workers.everything``, world sizes 1 and 2).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the optional extra metaddp[hf] (transformers)")

import torch  # noqa: E402 (after the skip)
from torch.func import functional_call  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import hf_workers as H  # noqa: E402 (tests/, on sys.path via conftest)

# Float64. Against the one-process value only the order of floating-point sums changes (the
# SUM over processes of the shares, of inner gradients and of meta-gradients), and sdpa
# against eager only the grouping of the attention's arithmetic: observed below 1e-15 of the
# meta-gradient's largest entry. Every tensor is compared at that scale, not its own: the key
# projections' biases have a gradient of exactly 0 in exact arithmetic (softmax ignores a
# constant added to a row), 1e-22 in floating point, that rounding changes by 100%. 1e-10
# leaves margin; masks keyed by anything else move the meta-gradient by O(1) (another draw
# seed: 1.5 of its largest entry, dropout off: 0.8).
RTOL = 1e-10


def assert_close(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    scale = max(float(w.abs().max()) for w in want.values())
    for k, w in want.items():
        assert torch.isfinite(got[k]).all(), f"{what}: {k} is not finite"
        d = float((got[k] - w).abs().max())
        assert d <= RTOL * scale, f"{what}: {k} off by {d:.3g} (largest entry {scale:.3g})"


def relative(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b) / max(
        float(b[k].abs().max()) for k in b)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This process's runs on one thread, as the shared groups' ranks: the models are tiny,
    and two threads on a busy machine made a meta-step 10x slower. Put back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The one-process float64 values: each algorithm alone, without MetaDDP or a process
    group, on the whole meta-batch."""
    return {"gpt2": H.maml("gpt2"), "bert": H.maml("bert"), "bilevel": H.bilevel()}


@pytest.fixture(scope="module")
def results(worlds) -> dict[int, list[dict]]:
    # Run in the shared process groups of tests/conftest.py; hf_workers runs at 1 and 2 only.
    return {w: [rank["hf"] for rank in worlds[w]] for w in (1, 2)}


def test_gpt2_second_order_through_sdpa_is_eager_attention_with_the_same_masks(one_process):
    # HF's eager attention is plain autograd (matmul, softmax, then F.dropout on the
    # probabilities [N, heads, T, T]); sdpa passes dropout_p to F.scaled_dot_product_attention,
    # which metaddp routes to its own attention. Both draw the attention mask as the forward's
    # second dropout call on the same entries, so the masks are the same and the meta-gradients
    # must be: an independent check of the routed attention's first and second derivatives
    # with dropout on.
    for build in (H.gpt2, H.bert):  # the default every other test runs on
        assert build().hf.config._attn_implementation == "sdpa"
    sdpa = one_process["gpt2"]
    eager = H.maml("gpt2", attn="eager")
    assert all(torch.isfinite(g).all() for g in sdpa["grads"].values())
    assert sdpa["loss"] == pytest.approx(eager["loss"], rel=1e-12)
    assert_close(sdpa["grads"], eager["grads"], "sdpa against eager")
    # The masks are drawn: without dropout the meta-gradient is another.
    assert relative(H.maml("gpt2", dropout=0.0)["grads"], sdpa["grads"]) > 0.1


def test_gpt2_without_dropout_is_second_order_maml_by_plain_autograd():
    # Independent of metaddp: MAML written out with torch.autograd.grad(create_graph=True)
    # through torch.func.functional_call, attention on PyTorch's math kernel (which has a
    # double backward), dropout 0 (PyTorch's own masks could not be the keyed ones).
    got = H.maml("gpt2", dropout=0.0)["grads"]
    net = H.gpt2(dropout=0.0)
    names = [k for k, _ in net.named_parameters()]  # the tied LM head is wte, once
    theta = [p.detach().clone().requires_grad_() for p in net.parameters()]

    def loss(weights, batch):
        logits = functional_call(net, dict(zip(names, weights)), (batch.x,))
        return H.lm_loss(logits, batch.y).mean()

    total = 0.0
    with sdpa_kernel(SDPBackend.MATH):
        for t in [H.lm_task(i) for i in range(H.N_TASKS)]:
            g = torch.autograd.grad(loss(theta, t.support), theta, create_graph=True)
            fast = [w - H.INNER_LR * gi for w, gi in zip(theta, g)]
            total = total + loss(fast, t.query)
        grads = torch.autograd.grad(total / H.N_TASKS, theta)
    assert_close(got, dict(zip(names, grads)), "metaddp against plain autograd")


@pytest.mark.parametrize("layout", H.LAYOUTS)
@pytest.mark.parametrize("model", sorted(H.MODELS))
def test_meta_gradient_with_dropout_is_one_process_at_1_and_2_processes(
        results, one_process, model, layout):
    want = one_process[model]
    for world, per_rank in results.items():
        for rank, got in enumerate(per_rank):
            r = got[f"{model}-{layout}"]
            assert r["loss"] == pytest.approx(want["loss"], rel=1e-12)
            assert_close(r["grads"], want["grads"], f"world {world} rank {rank}")


def test_bilevel_reweighting_with_dropout_is_one_process_at_1_and_2_processes(
        results, one_process):
    # Meta-Weight-Net on the BERT classifier, both batches split over the processes: the
    # weighting network's hypergradient and the model's gradient of the weighted inner loss.
    want = one_process["bilevel"]
    assert max(float(g.abs().max()) for g in want["weights"].values()) > 0
    for world, per_rank in results.items():
        for rank, got in enumerate(per_rank):
            r = got["bilevel-sample"]
            assert r["loss"] == pytest.approx(want["loss"], rel=1e-12)
            assert_close(r["weights"], want["weights"], f"weights, world {world} rank {rank}")
            assert_close(r["grads"], want["grads"], f"model, world {world} rank {rank}")
