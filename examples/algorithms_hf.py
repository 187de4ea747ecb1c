"""docs/algorithms.md's Hugging Face recipe as a complete program: a tiny GPT-2 built from a
config (random weights, nothing downloaded), meta-trained second order with its dropout on, on
tasks of token sequences that each repeat their own short pattern. Runs on any number of
processes (the same meta-losses; needs ``pip install ".[hf]"``):

    python examples/algorithms_hf.py
    torchrun --nproc-per-node 2 examples/algorithms_hf.py
"""

import torch, torch.nn.functional as F, metaddp as md  # noqa: E401, I001
from transformers import GPT2Config, GPT2LMHeadModel

steps, n_tasks, shots, length = 3, 2, 4, 12


class LM(torch.nn.Module):                     # model(x): x = input_ids [N, T], samples first
    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, x):
        return self.hf(input_ids=x, use_cache=False).logits     # [N, T, vocab]


def per_sample_loss(logits, y):                # y = x: mean next-token cross-entropy per sample
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), y[:, 1:], reduction="none").mean(1)


def task(i: int) -> md.Task:
    """Task i: sequences that repeat a pattern of 3 tokens of its own, from random offsets."""
    g = md.generator_for(0, i)
    pattern = torch.randint(0, 32, (3,), generator=g)
    offsets = torch.randint(0, 3, (2 * shots,), generator=g)
    ids = pattern[(offsets[:, None] + torch.arange(length)) % 3]
    support, query = ids[:shots], ids[shots:]
    return md.Task(md.Batch(support, support, shots), md.Batch(query, query, shots))


def main() -> None:
    md.init()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=32, n_positions=16)  # noqa: E501
    net = LM(GPT2LMHeadModel(config)).train()      # dropout left on
    learner = md.MetaDDP(md.MAML(net, inner_lr=0.5), md.Mesh.create())  # second order
    opt = torch.optim.Adam(learner.parameters(), 1e-3)
    for step in range(steps):                      # task(i): md.Task(md.Batch(ids, ids, n), ...)
        opt.zero_grad()
        loss = learner.meta_loss(learner.shard(n_tasks, task), per_sample_loss)
        loss.backward()
        learner.sync_grads()
        opt.step()
        value = float(learner.global_value(loss))
        if md.rank() == 0:
            print(f"step {step}: meta-loss {value:.6f}")
    md.shutdown()


if __name__ == "__main__":
    main()
