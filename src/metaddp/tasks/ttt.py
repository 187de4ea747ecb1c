"""Test-time training on text, after TTT-E2E (Tandon et al. 2025, "End-to-End Test-Time
Training for Long Context", arXiv:2512.23675), CPU-sized.

A task is one window of a document of the standard library's source (:mod:`._stdlib`):
``shots`` consecutive chunks of ``chunk`` bytes to adapt on (the support set, the context
already read) and the ``query`` chunks that follow (the query set, the text to predict). Each
chunk is one sample whose loss is its mean next-byte cross-entropy in bits, so the family's
metric is bits per byte. The network (:class:`._bytelm.ByteTransformer`) reads one chunk at a
time: its attention sees only the chunk, and what the document said before can reach the
query only through the fast weights. With ANIL (the family's default) those are the head's:
the last MLP block, the final norm and the unembedding, the weights TTT-E2E trains at test
time; the inner loop is gradient descent on the support chunks' next-byte loss, and the
meta-gradient goes through it to second order, to every weight.

Where TTT-E2E takes one inner step per chunk as it reads them, in order, here every inner step
sees all the support chunks at once (the support set is a batch, split over processes like any
other). Task ``i`` of a split is a function of the seed, the split and ``i``: a document drawn
uniformly among the split's documents long enough for a window, then a window start uniformly
within it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._data import Batch, Task
from . import _stdlib
from ._bytelm import ByteTransformer
from ._family import TaskFamily, check_sizes

CHUNK = 64  # bytes a chunk (and the network's context)


def bits_per_byte(logits: Tensor, target: Tensor) -> Tensor:
    """Each chunk's mean next-byte cross-entropy in bits: ``logits [n, length, 256]`` against
    the bytes ``target [n, length]``, one loss per chunk."""
    per_byte = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    return per_byte.mean(dim=1) / math.log(2)


class TTT(TaskFamily):
    """Next-byte prediction on held-out documents after adapting on their preceding text
    (module docstring).

    Args:
        shots: support chunks per task (the text read before the query).
        query: query chunks per task (the text after it).
        hidden: the transformer's width (a multiple of its 4 heads).
        chunk: bytes per chunk, the network's whole attention context.
    """

    name: ClassVar[str] = "ttt"
    classification: ClassVar[bool] = False
    metric: ClassVar[str] = "bits/byte"
    defaults: ClassVar[dict[str, Any]] = dict(
        algorithm="anil",
        shots=4,
        query=4,
        inner_lr=0.3,
        outer_lr=0.003,
        meta_batch=4,
        inner_steps=1,
        eval_steps=1,
        hidden=64,
    )

    def __init__(self, shots: int = 4, query: int = 4, hidden: int = 64, chunk: int = CHUNK):
        check_sizes("ttt", "chunk", shots, query, hidden)
        if chunk < 2:
            raise ValueError(f"a chunk needs at least 2 bytes, got {chunk}")
        self.shots, self.query, self.hidden, self.chunk = int(shots), int(query), hidden, chunk
        self.window = (self.shots + self.query) * chunk + 1  # inputs and their next bytes
        self.documents = {
            split: [text for _, text in _stdlib.documents(split) if len(text) >= self.window]
            for split in ("train", "test")
        }
        for split, docs in self.documents.items():
            if not docs:
                raise ValueError(
                    f"no {split} document of the standard library in {_stdlib.root()} holds a "
                    f"window of {self.window} bytes: lower shots, query or the chunk"
                )

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent to other processes by its sizes: each reads the corpus itself.
        return (type(self), (self.shots, self.query, self.hidden, self.chunk))

    def sample(self, generator: torch.Generator, split: str) -> Task:
        docs = self.documents[split]
        doc = docs[int(torch.randint(len(docs), (), generator=generator))]
        start = int(torch.randint(len(doc) - self.window + 1, (), generator=generator))
        window = torch.frombuffer(bytearray(doc[start : start + self.window]), dtype=torch.uint8)
        window = window.long()
        x = window[:-1].reshape(-1, self.chunk)
        y = window[1:].reshape(-1, self.chunk)
        k = self.shots
        return Task(Batch(x[:k], y[:k], k), Batch(x[k:], y[k:], self.query))

    def model(self) -> nn.Module:
        return ByteTransformer(context=self.chunk, width=self.hidden)

    def loss(self, prediction: Tensor, target: Tensor) -> Tensor:
        return bits_per_byte(prediction, target)

    def describe(self) -> dict[str, Any]:
        return {
            "shots": self.shots,
            "query": self.query,
            "hidden": self.hidden,
            "chunk": self.chunk,
            "corpus": _stdlib.identity(),
        }
