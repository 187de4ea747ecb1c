"""A small causal byte-level transformer whose last MLP block is its own module (the head).

Pre-norm blocks (LayerNorm, causal self-attention; LayerNorm, a 4x MLP with GELU), learned
positions, a final LayerNorm and an unembedding to the 256 bytes, not tied to the embedding.
Dropout after the embedding and on each block's output (the attention probabilities are not
dropped: their masks, one entry per pair of positions, cost more to key than the rest).
:meth:`ByteTransformer.split_head` returns (body, head): the body is everything up to the
residual stream after the last attention block; the head is the last MLP block, the final
norm and the unembedding, the fast weights of test-time training (Tandon et al. 2025,
"End-to-End Test-Time Training for Long Context", arXiv:2512.23675, adapt the last MLP
blocks). The samples are the first dimension everywhere, so metaddp keys the dropout masks
by them (:mod:`metaddp.forward`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 256  # bytes


class CausalAttention(nn.Module):
    """``h + dropout(out(attention(qkv(norm(h)))))``, causal (``F.scaled_dot_product_attention``,
    which metaddp routes to an attention with derivatives of every order)."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)
        self.heads = heads

    def forward(self, h: Tensor) -> Tensor:
        n, length, width = h.shape
        qkv = self.qkv(self.norm(h)).reshape(n, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return h + self.drop(self.out(y.transpose(1, 2).reshape(n, length, width)))


class FeedForward(nn.Module):
    """``h + dropout(down(gelu(up(norm(h)))))``: an MLP block, four times as wide inside."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.drop(self.down(F.gelu(self.up(self.norm(h)))))


class Body(nn.Module):
    """Bytes ``[n, length]`` to the residual stream ``[n, length, width]`` after the last
    attention block: embedding and positions, then every block but the last one's MLP."""

    def __init__(self, context: int, width: int, heads: int, layers: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)
        self.drop = nn.Dropout(dropout)
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks.append(CausalAttention(width, heads, dropout))
            if i < layers - 1:
                blocks.append(FeedForward(width, dropout))
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop(self.embed(x) + self.position[: x.shape[1]])
        return self.blocks(h)


class Head(nn.Module):
    """The residual stream to next-byte logits ``[n, length, 256]``: the last MLP block, the
    final LayerNorm and the unembedding."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.mlp = FeedForward(width, dropout)
        self.norm = nn.LayerNorm(width)
        self.unembed = nn.Linear(width, VOCAB)

    def forward(self, h: Tensor) -> Tensor:
        return self.unembed(self.norm(self.mlp(h)))


class ByteTransformer(nn.Module):
    """Next-byte logits for every position of each sample's bytes (module docstring).

    Args:
        context: the longest input (positions learned).
        width: the residual stream's width (a multiple of ``heads``).
        heads: attention heads.
        layers: transformer blocks (attention and MLP), at least 1.
        dropout: the probability of every dropout.
    """

    def __init__(
        self,
        context: int,
        width: int = 64,
        heads: int = 4,
        layers: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if width < heads or width % heads:
            raise ValueError(f"width must be a positive multiple of {heads} (heads), got {width}")
        if layers < 1:
            raise ValueError(f"a transformer needs at least one block, got layers={layers}")
        self.body = Body(context, width, heads, layers, dropout)
        self.head = Head(width, dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def split_head(self) -> tuple[nn.Module, nn.Module]:
        """The split ANIL adapts: (body, head), the head the fast weights of test-time
        training (the last MLP block, the final norm and the unembedding)."""
        return self.body, self.head
