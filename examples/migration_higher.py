"""docs/migration.md's higher loops written with metaddp, as a complete program: MAML with a
differentiable SGD with momentum, then the same inner loop by hand with Adam. Runs on any
number of processes:

    python examples/migration_higher.py
    torchrun --nproc-per-node 2 examples/migration_higher.py
"""

import torch
import torch.nn.functional as F
from migration_learn2learn import classification_task
from torch import nn

import metaddp


def per_sample_ce(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


def main(steps: int = 2, n_tasks: int = 4) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    metaddp.init()
    all_tasks = [classification_task(i) for i in range(n_tasks)]
    alg = metaddp.MetaDDP(metaddp.MAML(model, steps=steps, optimizer=metaddp.inner.sgd(0.1, momentum=0.9)))  # noqa: E501
    meta_opt = torch.optim.Adam(alg.parameters(), 1e-3)
    meta_opt.zero_grad()
    loss = alg.meta_loss(alg.shard(all_tasks), per_sample_ce)
    loss.backward()
    alg.sync_grads()
    meta_opt.step()
    values = [float(alg.global_value(loss))]

    # The inner loop by hand, on the first task's part (model: the meta-trained weights).
    task = alg.shard(all_tasks[:1])[0]
    s, q = task.support, task.query
    opt = metaddp.inner.adam(0.01)                            # or metaddp.inner.sgd(...)
    params = metaddp.functional.params_of(model)
    state = opt.init(params)
    for _ in range(steps):
        loss = metaddp.share(per_sample_ce(metaddp.functional.call(model, params, s.x), s.y), s)
        grads = alg.grad(loss, params)                  # the global gradient, kept for 2nd order
        updates, state = opt.update(grads, state, params)
        params = metaddp.inner.apply_updates(params, updates)
    query = metaddp.share(per_sample_ce(metaddp.functional.call(model, params, q.x), q.y), q)
    meta_opt.zero_grad()
    query.backward()
    alg.sync_grads()
    values.append(float(alg.global_value(query)))
    values.append(float(sum(p.grad.norm() ** 2 for p in alg.parameters()) ** 0.5))
    if metaddp.rank() == 0:
        print("meta-loss, adapted query loss, meta-gradient norm:",
              " ".join(f"{v:.6f}" for v in values))
    return values


if __name__ == "__main__":
    main()
    metaddp.shutdown()
