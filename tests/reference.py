"""Single-process float64 references, written without any metaddp code path.

Plain autograd on whole batches with mean losses, one task after another: the textbook
MAML computation that every distributed result must reproduce.
"""

import torch
import torch.nn.functional as F
from torch.func import functional_call


def maml_meta_grad(model, tasks, *, steps, inner_lr, first_order, classification):
    """Meta-gradient of mean_t L_query_t(theta_t'), theta_t' = K SGD steps on L_support_t."""
    loss = F.cross_entropy if classification else F.mse_loss
    params = dict(model.named_parameters())
    total = 0.0
    for (xs, ys, _), (xq, yq, _) in tasks:
        fast = params
        for _ in range(steps):
            ls = loss(functional_call(model, fast, (xs,)), ys)
            grads = torch.autograd.grad(ls, list(fast.values()), create_graph=not first_order)
            fast = {k: p - inner_lr * g for (k, p), g in zip(fast.items(), grads)}
        total = total + loss(functional_call(model, fast, (xq,)), yq)
    meta = total / len(tasks)
    grads = torch.autograd.grad(meta, list(params.values()))
    return float(meta.detach()), dict(zip(params, grads))
