"""Tiny Hugging Face transformers meta-trained under metaddp (tests/test_hf.py): the problems,
run by every rank of the shared process groups (``workers.everything``, the session fixture
``worlds``) at world sizes 1 and 2, and by the test process alone for the one-process values.

transformers is imported inside the functions, once per process that runs them: importing
this module costs nothing, and without transformers ``run_all`` returns ``None``.

The models are built from a config with random weights (nothing downloaded), in float64, in
training mode with their default dropout (0.1 everywhere) and attention (``sdpa``, which
metaddp routes to its own attention inside its loops).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

import metaddp as md

VOCAB, LENGTH, CLASSES = 32, 8, 3
INNER_LR = 0.5
# Uneven shards for the classifier: 5 support and 3 query samples are cut 3 + 2 and 2 + 1
# over two processes, so a sample's global index is not its index on the process.
N_SUPPORT_LM, N_QUERY_LM = 4, 4
N_SUPPORT_CLS, N_QUERY_CLS = 5, 3
N_TASKS = 2
LAYOUTS = ("sample", "task")


class LM(nn.Module):
    """A causal language model whose ``model(x)`` is the logits of the token sequences ``x``
    (input_ids, ``[N, T]``): one prediction per sample, samples first."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x, use_cache=False).logits


class Classifier(nn.Module):
    """A sequence classifier whose ``model(x)`` is the class logits of ``x`` (input_ids)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x).logits


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per sample: the mean cross-entropy of predicting each next token."""
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), y[:, 1:], reduction="none")
    return ce.mean(1)


def cls_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="none")


def attention(attn: str | None) -> dict:
    return {} if attn is None else {"attn_implementation": attn}


def gpt2(attn: str | None = None, dropout: float | None = None) -> LM:
    """A 2-layer GPT-2 (2 heads, width 16, 32 tokens), the same weights in every process;
    ``attn`` and ``dropout`` ``None``: the defaults (sdpa, 0.1)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    drops = {} if dropout is None else dict(attn_pdrop=dropout, resid_pdrop=dropout,
                                            embd_pdrop=dropout)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16,
                        bos_token_id=0, eos_token_id=0, **drops, **attention(attn))
    torch.manual_seed(0)
    return LM(GPT2LMHeadModel(config)).double().train()


def bert(attn: str | None = None) -> Classifier:
    """A 2-layer BERT classifier (2 heads, width 16, 32 tokens, 3 classes)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                        intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=16,
                        num_labels=CLASSES, **attention(attn))
    torch.manual_seed(1)
    return Classifier(BertForSequenceClassification(config)).double().train()


def lm_task(i: int) -> md.Task:
    """Task i: random token sequences; the targets are the sequences themselves."""
    g = md.generator_for(10, i)
    s = torch.randint(0, VOCAB, (N_SUPPORT_LM, LENGTH), generator=g)
    q = torch.randint(0, VOCAB, (N_QUERY_LM, LENGTH), generator=g)
    return md.Task(md.Batch(s, s, N_SUPPORT_LM), md.Batch(q, q, N_QUERY_LM))


def cls_task(i: int) -> md.Task:
    """Task i: random token sequences with random labels."""
    g = md.generator_for(20, i)

    def batch(n: int) -> md.Batch:
        x = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
        return md.Batch(x, torch.randint(0, CLASSES, (n,), generator=g), n)

    return md.Task(batch(N_SUPPORT_CLS), batch(N_QUERY_CLS))


MODELS = {"gpt2": (gpt2, lm_task, lm_loss), "bert": (bert, cls_task, cls_loss)}


def grads_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in module.named_parameters()
            if p.grad is not None}


def maml(name: str, layout: str | None = None, **model_kw) -> dict:
    """One second-order MAML meta-step of model ``name``: the global loss and the
    meta-gradient. ``layout`` ``None``: the algorithm alone, without MetaDDP (one process)."""
    build, task, loss_fn = MODELS[name]
    net = build(**model_kw)
    alg = md.MAML(net, inner_lr=INNER_LR)
    if layout is None:
        loss = alg.meta_loss([task(i) for i in range(N_TASKS)], loss_fn)
        loss.backward()
        return {"loss": float(loss.detach()), "grads": grads_of(net)}
    learner = md.MetaDDP(alg, md.Mesh.for_layout(layout))
    loss = learner.meta_loss(learner.shard(N_TASKS, task), loss_fn)
    loss.backward()
    learner.sync_grads()
    out = {"loss": float(learner.global_value(loss)), "grads": grads_of(net)}
    learner.release()
    return out


def noisy_task(i: int) -> md.Task:
    """Per-sample weighting (docs/bilevel.md): a noisy inner batch of 5, a clean outer of 3."""
    return cls_task(100 + i)


def bilevel(layout: str | None = None) -> dict:
    """One step of Meta-Weight-Net on the BERT classifier (docs/bilevel.md's screen): the
    weighting network's hypergradient and the model's gradient of the weighted loss."""
    net = bert()
    torch.manual_seed(2)
    weights = md.WeightNet(hidden=8).double()
    problem = md.Bilevel(net, weights=weights, start="current", train_inner=True, steps=1,
                         optimizer=md.sgd(INNER_LR), method=md.Unrolled())
    if layout is None:
        loss = problem.meta_loss([noisy_task(i) for i in range(N_TASKS)], cls_loss)
        loss.backward()
        total = float(loss.detach())
    else:
        learner = md.MetaDDP(problem, md.Mesh.for_layout(layout))
        loss = learner.meta_loss(learner.shard(N_TASKS, noisy_task), cls_loss)
        loss.backward()
        learner.sync_grads()
        total = float(learner.global_value(loss))
        learner.release()
    return {"loss": total, "grads": grads_of(net), "weights": grads_of(weights)}


def run_all() -> dict | None:
    """Every multi-process problem's result on this rank (world sizes 1 and 2 only: the
    larger shared groups skip them); ``None`` without transformers."""
    if md.world_size() > 2 or importlib.util.find_spec("transformers") is None:
        return None
    out = {f"{name}-{layout}": maml(name, layout) for layout in LAYOUTS for name in MODELS}
    out["bilevel-sample"] = bilevel("sample")  # both batches split: the harder layout
    return out
