"""TTT-E2E meta-steps from 125M to 3B parameters on H200s: counted on the CPU, predicted on
the GPU. Predictions, not measurements.

The step (Tandon et al., "End-to-End Test-Time Training for Long Context", arXiv 2512.23675,
as its paper and public code describe it; the sizes are stated assumptions below): a
transformer with sliding-window attention whose last quarter of blocks carry a second,
*dynamic* MLP beside the static one. A sequence of ``T`` tokens is read in chunks of ``b``;
chunk ``k`` is predicted with the dynamic MLPs after ``k`` inner SGD steps, each on the
next-token loss of the chunk before it, and the outer loss (every chunk's next-token loss) is
differentiated to second order through those steps, into every weight.

1. **Counted** (this CPU, float32, tiny instances of the same architecture, one process):
   the step is written with torch autograd, and ``benchmarks/sharded.py``'s dispatch probe
   counts its matrix-multiply FLOPs and the peak bytes of live tensors, beside a plain
   training step (forward and backward) on the same tokens. Fitted over the instances, the
   counts give the E2E step's FLOPs as multiples of a forward's, for the prefix (blocks
   without a dynamic MLP) and the suffix (those with one), and its activation bytes per token
   per block.
2. **Predicted** (``predict``): for each configuration, FLOPs and activation bytes from
   those counts at full size; weights, gradients and Adam held in float32 (16 bytes per
   parameter), replicated or sharded over the 8 GPUs of a node (FSDP2 ``fully_shard``, as
   metaddp adopts it); time = FLOPs / (bfloat16 tensor-core peak x efficiency) + the
   collectives of a sharded step by the alpha-beta model of ``benchmarks/sharded.py``
   (every weight all-gathered for each forward and each backward that reads it,
   reduce-scattered once per backward, in bfloat16), nothing overlapped.

    python benchmarks/ttt_scale.py [--json benchmarks/results/ttt_scale.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import run_record, save_json  # noqa: E402
from sharded import Hardware, Probe  # noqa: E402

# --- the architecture, at any size -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Size:
    """A TTT-E2E configuration: GPT-3's shapes at each size (an assumption: the paper's own
    tables were not read here), Llama 3's vocabulary (the paper's tokenizer)."""

    name: str
    layers: int
    width: int
    heads: int
    vocab: int = 128_256

    @property
    def dynamic(self) -> int:
        """Blocks with a dynamic MLP: the last quarter."""
        return self.layers // 4

    def params(self) -> dict[str, float]:
        d = self.width
        block = 12 * d * d  # attention 4 d^2, MLP 8 d^2 (4d hidden)
        return {
            "embeddings": 2.0 * self.vocab * d,  # input and output, untied
            "prefix": float(block * (self.layers - self.dynamic)),
            "suffix": float((block + 8 * d * d) * self.dynamic),  # + the dynamic MLP
            "dynamic": float(8 * d * d * self.dynamic),
        }

    def total(self) -> float:
        p = self.params()
        return p["embeddings"] + p["prefix"] + p["suffix"]


SIZES = (
    Size("125M", 12, 768, 12),
    Size("350M", 24, 1024, 16),
    Size("760M", 24, 1536, 16),
    Size("1.3B", 24, 2048, 32),
    Size("2.7B", 32, 2560, 32),
)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one meta-step reads (stated, not measured): the paper's training context and
    inner mini-batch, its sliding window; sequences per GPU per step."""

    context: int = 8192  # T, tokens per sequence
    chunk: int = 1024  # b, tokens per inner step: K = T / b steps
    window: int = 8192  # sliding-window attention
    sequences_per_gpu: int = 1


class Block(nn.Module):
    """Pre-norm block: causal attention over the tokens it is given, a static MLP and, in the
    last quarter, a dynamic one beside it (read from ``fast``)."""

    def __init__(self, d: int, heads: int, dynamic: bool) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.dynamic = dynamic

    def forward(self, x: Tensor, fast: dict[str, Tensor] | None = None) -> Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, t, 3, self.heads, d // self.heads).unbind(2)
        # The math path: a second derivative flows through the suffix's attention.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        a = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, d))
        h = self.ln2(x)
        out = self.down(F.gelu(self.up(h)))
        if fast is not None:
            out = out + F.linear(F.gelu(F.linear(h, fast["up"])), fast["down"])
        return x + out


class Tiny(nn.Module):
    def __init__(self, s: Size) -> None:
        super().__init__()
        d = s.width
        self.embed, self.unembed = nn.Embedding(s.vocab, d), nn.Linear(d, s.vocab, bias=False)
        self.blocks = nn.ModuleList(
            Block(d, s.heads, i >= s.layers - s.dynamic) for i in range(s.layers)
        )
        self.norm = nn.LayerNorm(d)
        self.fast0 = nn.ParameterList()  # the dynamic MLPs' meta-learned start
        for _ in range(s.dynamic):
            self.fast0.append(nn.Parameter(torch.randn(4 * d, d) * d**-0.5))
            self.fast0.append(nn.Parameter(torch.randn(d, 4 * d) * (4 * d) ** -0.5))

    def prefix(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            if block.dynamic:
                break
            x = block(x)
        return x

    def suffix(self, x: Tensor, fast: list[Tensor]) -> Tensor:
        i = 0
        for block in self.blocks:
            if block.dynamic:
                x = block(x, {"up": fast[2 * i], "down": fast[2 * i + 1]})
                i += 1
        return self.unembed(self.norm(x))


def e2e_step(model: Tiny, tokens: Tensor, chunk: int, lr: float = 0.1) -> None:
    """One meta-step: chunk k predicted after k inner steps; the outer loss's backward."""
    x, fast = model.prefix(tokens[:, :-1]), list(model.fast0)
    outer, chunks = 0.0, (tokens.shape[1] - 1) // chunk
    for k in range(chunks):
        part = slice(k * chunk, (k + 1) * chunk)
        logits = model.suffix(x[:, part], fast)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:][:, part].flatten())
        outer = outer + loss / chunks
        if k + 1 < chunks:  # the step that the next chunk reads
            grads = torch.autograd.grad(loss, fast, create_graph=True)
            fast = [w - lr * g for w, g in zip(fast, grads, strict=True)]
    outer.backward()


def plain_step(model: Tiny, tokens: Tensor, chunk: int) -> None:
    """A training step on the same tokens, the dynamic MLPs at their start: the unit."""
    x = model.prefix(tokens[:, :-1])
    logits = model.suffix(x, list(model.fast0))
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def count(s: Size, chunks: int, chunk: int) -> dict[str, float]:
    """FLOPs and peak live bytes of both steps on one sequence of ``chunks * chunk`` tokens."""
    torch.manual_seed(0)
    model = Tiny(s)
    tokens = torch.randint(0, s.vocab, (1, chunks * chunk + 1))
    out: dict[str, float] = {}
    for name, step in (("e2e", e2e_step), ("plain", plain_step)):
        model.zero_grad(set_to_none=True)
        with Probe() as probe:
            step(model, tokens, chunk)
        out[f"{name}_flops"], out[f"{name}_peak"] = float(probe.flops), float(probe.peak)
    return out


# --- counted: tiny instances ------------------------------------------------------------------

TINY = (  # layers, width, heads, vocab: small enough for the CPU, four blocks or more
    Size("tiny-a", 4, 64, 4, 256),
    Size("tiny-b", 8, 64, 4, 256),
    Size("tiny-c", 8, 128, 4, 256),
)


def forward_flops(s: Size, tokens: int, window: int, suffix_window: int) -> dict[str, float]:
    """Matrix-multiply FLOPs of one forward over ``tokens`` causal tokens, the prefix's
    attention within ``window``, the suffix's within ``suffix_window``: 2 per weight per
    token, and 2 x 2 x (keys seen) x width per block per token for the scores and the
    weighted sum (about half the window, as counted: a causal mask computes the whole square
    on the math path, so the counted steps pay the full window)."""
    p = s.params()

    def attention(w: int) -> float:
        return 4 * min(w, tokens) * s.width * tokens

    return {
        "prefix": 2 * p["prefix"] * tokens + attention(window) * (s.layers - s.dynamic),
        "suffix": 2 * p["suffix"] * tokens + attention(suffix_window) * s.dynamic,
        "unembed": 2 * s.vocab * s.width * tokens,
    }


def calibrate(chunks: int, chunk: int) -> dict:
    """The E2E step's FLOPs per forward FLOP of its prefix and suffix (least squares over
    the tiny instances: e2e = a * prefix + c * (suffix + unembed)), and its activation bytes
    per token per block, from the counts."""
    rows = []
    for s in TINY:
        got = count(s, chunks, chunk)
        # As counted: the prefix attends over the whole sequence, the suffix within a chunk.
        f = forward_flops(s, chunks * chunk, chunks * chunk, chunk)
        rows.append((s, got, f))
    # Two unknowns, the prefix's and the suffix's multiple; the tiny instances differ in their
    # share of each. Solve the normal equations.
    a11 = sum(f["prefix"] ** 2 for _, _, f in rows)
    a12 = sum(f["prefix"] * (f["suffix"] + f["unembed"]) for _, _, f in rows)
    a22 = sum((f["suffix"] + f["unembed"]) ** 2 for _, _, f in rows)
    b1 = sum(f["prefix"] * g["e2e_flops"] for _, g, f in rows)
    b2 = sum((f["suffix"] + f["unembed"]) * g["e2e_flops"] for _, g, f in rows)
    det = a11 * a22 - a12 * a12
    prefix_x, suffix_x = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    plain_x = [g["plain_flops"] / sum(f.values()) for _, g, f in rows]
    # Peak bytes beyond the weights and their gradients, per token per block (float32).
    per_block = []
    for s, g, _ in rows:
        held = 2 * 4 * s.total()
        per_block.append(
            ((g["e2e_peak"] - held) / (chunks * chunk * s.layers * s.width),
             (g["plain_peak"] - held) / (chunks * chunk * s.layers * s.width))
        )
    fit_error = max(
        abs(prefix_x * f["prefix"] + suffix_x * (f["suffix"] + f["unembed"]) - g["e2e_flops"])
        / g["e2e_flops"]
        for _, g, f in rows
    )
    return {
        "prefix_multiple": prefix_x,
        "suffix_multiple": suffix_x,
        "plain_multiple": sum(plain_x) / len(plain_x),
        "fit_error": fit_error,
        "e2e_bytes_per_token_block_width": max(e for e, _ in per_block),
        "plain_bytes_per_token_block_width": max(p for _, p in per_block),
        "rows": [
            {"size": s.name, "params": s.total(), **g, **{f"forward_{k}": v for k, v in f.items()}}
            for s, g, f in rows
        ],
    }


# --- predicted: H200 nodes --------------------------------------------------------------------

BF16_PEAK = 989e12  # H200 dense bfloat16 tensor-core FLOP/s (H100 SXM's compute)


def predict(cal: dict, s: Size, work: Workload, hw: Hardware, shard: int) -> dict:
    """One meta-step on one GPU's sequences, weights replicated (``shard=1``) or sharded over
    ``shard`` GPUs of a node: a prediction, not a measurement."""
    tokens = work.context * work.sequences_per_gpu
    f = forward_flops(s, work.context, work.window, work.window)
    f = {k: v * work.sequences_per_gpu for k, v in f.items()}
    flops = cal["prefix_multiple"] * f["prefix"] + cal["suffix_multiple"] * (
        f["suffix"] + f["unembed"]
    )
    training = cal["plain_multiple"] * sum(f.values())  # a training step on the same tokens
    compute = flops / (BF16_PEAK * hw.efficiency)
    params = s.total()
    held = 16 * params / shard  # float32 weights, gradients, Adam's two moments
    # Activations: bfloat16 (half the counted float32 bytes), per token per block per width.
    activations = cal["e2e_bytes_per_token_block_width"] / 2 * tokens * s.layers * s.width
    comm = 0.0
    if shard > 1:
        steps = work.context // work.chunk
        p = s.params()
        # Prefix and embeddings: gathered for the forward and again for the backward,
        # reduce-scattered once. Suffix: read by every chunk's forward, its inner backward
        # and the outer backward of both (4 gathers per chunk), reduce-scattered per chunk.
        gathered = 2 * (p["prefix"] + p["embeddings"]) + 4 * steps * p["suffix"]
        scattered = (p["prefix"] + p["embeddings"]) + steps * p["suffix"]
        calls = 3 * (s.layers - s.dynamic + 1) + 5 * steps * s.dynamic
        beta, alpha = hw.nvlink, hw.alpha_nvlink
        wire = (shard - 1) / shard * 2 * (gathered + scattered)  # bfloat16 bytes
        comm = calls * (shard - 1) * alpha + wire / beta
    memory = held + activations
    return {
        "size": s.name,
        "params": params,
        "tokens": tokens,
        "flops": flops,
        "training_flops": training,
        "shard": shard,
        "compute_s": compute,
        "comm_s": comm,
        "seconds": compute + comm,
        "held_gb": held / 1e9,
        "activations_gb": activations / 1e9,
        "memory_gb": memory / 1e9,
        "fits": memory <= hw.usable * hw.memory,
        "tokens_per_s": tokens / (compute + comm),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=4, help="inner steps of the counted steps")
    ap.add_argument("--chunk", type=int, default=32, help="tokens per chunk when counting")
    ap.add_argument("--json", default=None, help="write the counts and predictions here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cal = calibrate(a.chunks, a.chunk)
    print("## Counted on this CPU (float32, tiny instances, one sequence)\n")
    print("| instance | parameters | E2E step FLOPs | training step FLOPs | E2E peak | training peak |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in cal["rows"]:
        print(f"| {r['size']} | {r['params'] / 1e6:.2f} M | {r['e2e_flops'] / 1e6:.1f} M | "
              f"{r['plain_flops'] / 1e6:.1f} M | {r['e2e_peak'] / 2**20:.1f} MiB | "
              f"{r['plain_peak'] / 2**20:.1f} MiB |")
    print(f"\nE2E FLOPs = {cal['prefix_multiple']:.2f} x prefix forward + "
          f"{cal['suffix_multiple']:.2f} x (suffix + unembedding) forward "
          f"(fit within {100 * cal['fit_error']:.1f}%); a training step is "
          f"{cal['plain_multiple']:.2f} x its forward.")
    print(f"Activation bytes per token per block per width unit: E2E "
          f"{cal['e2e_bytes_per_token_block_width']:.1f}, training "
          f"{cal['plain_bytes_per_token_block_width']:.1f} (float32, peak beyond weights and grads).")
    hw, work = Hardware(), Workload()
    print("\n## Predicted on H200s: not measured\n")
    print(f"One sequence of {work.context} tokens per GPU, chunks of {work.chunk} "
          f"({work.context // work.chunk} inner steps), window {work.window}; bfloat16 compute at "
          f"{hw.efficiency:.0%} of {BF16_PEAK / 1e12:.0f} TFLOP/s; float32 weights, gradients and "
          "Adam (16 bytes per parameter); NVLink "
          f"{hw.nvlink / 1e9:.0f} GB/s per direction, alpha {hw.alpha_nvlink * 1e6:.0f} us.\n")
    print("| size | parameters | TFLOPs per step (x training's) | replicated: s, GB per GPU | "
          "sharded over 8: s (compute + collectives), GB per GPU | tokens/s per GPU, sharded |")
    print("|---|---:|---:|---|---|---:|")
    predictions = []
    for s in SIZES:
        r, n = predict(cal, s, work, hw, 1), predict(cal, s, work, hw, 8)
        predictions += [r, n]
        mark = lambda x: "" if x["fits"] else " *"  # noqa: E731
        print(f"| {s.name} | {s.total() / 1e9:.2f} B | {r['flops'] / 1e12:.1f} "
              f"({r['flops'] / r['training_flops']:.2f}) | "
              f"{r['seconds']:.2f}, {r['memory_gb']:.0f}{mark(r)} | "
              f"{n['seconds']:.2f} ({n['compute_s']:.2f} + {n['comm_s']:.2f}), {n['memory_gb']:.0f}{mark(n)} | "
              f"{n['tokens_per_s']:,.0f} |")
    print(f"\n* over {hw.usable:.0%} of {hw.memory / 1e9:.0f} GB")
    save_json(Path(a.json) if a.json else None,
              run_record(settings=vars(a), calibration=cal, predictions=predictions,
                         workload=dataclasses.asdict(work), hardware=dataclasses.asdict(hw)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
