"""``memory="low"``: each inner step's graph rebuilt one at a time gives the default
meta-gradient, on one process and across ranks, with 3K collectives sample-parallel."""

from __future__ import annotations

import dataclasses
import functools
import weakref

import pytest
import torch

import metaddp as md
import reference
from metaddp import _host
from metaddp.algorithms.registry import split_head
from metaddp.distributed.launch import run_local
from metaddp.testing import scenarios as S

# Float64. The low-memory mode runs the same operations as the default, in the same execution
# (stacked or one task at a time), differentiated by autograd one step at a time: only the
# order of a few sums differs (observed <= 7.9e-15 relative, Adam and Meta-SGD with Adam
# included). 1e-12 is the target; a dropped Hessian-vector product or a missed adjoint of the
# optimizer state moves the meta-gradient by 1e-3 or more. (Stacked against one task at a
# time, the default mode differs from itself by 1.5e-12 with Adam: Adam divides by
# sqrt(v_hat), which amplifies reassociated sums where a gradient entry is tiny. Each mode is
# compared here with the other in the same execution.)
RTOL = 1e-12

MLP = S.Problem("mlp", steps=3)
BN = S.Problem("conv", batchnorm=True, steps=2, n_tasks=3, inner_lr=0.3)


def meta_grads(alg: md.MAML, p: S.Problem) -> dict[str, torch.Tensor]:
    alg.zero_grad(set_to_none=True)
    alg.meta_loss(p.tasks(), p.loss_fn).backward()
    return {k: q.grad.clone() for k, q in alg.named_parameters() if q.grad is not None}


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a) / max(
        float(v.abs().max()) for v in b.values())


CASES = {
    "sgd": (MLP, lambda m: md.MAML(MLP.build_model(), inner_lr=0.1, steps=3, memory=m)),
    "momentum": (MLP, lambda m: md.MAML(MLP.build_model(), steps=3,
                                        optimizer=md.sgd(0.1, momentum=0.9), memory=m)),
    "adam": (MLP, lambda m: md.MAML(MLP.build_model(), steps=3, optimizer=md.adam(0.01),
                                    memory=m)),
    # One step: the state's leaves are the function's own (no first-order sweep before).
    "adam-one-step": (MLP, lambda m: md.MAML(MLP.build_model(), steps=1,
                                             optimizer=md.adam(0.01), memory=m)),
    "metasgd-adam": (MLP, lambda m: md.MetaSGD(
        MLP.build_model(), inner_lr=0.05, steps=3,
        optimizer=functools.partial(md.adam, b1=0.5), memory=m)),
    "batchnorm": (BN, lambda m: md.MAML(BN.build_model(), inner_lr=0.3, steps=2, memory=m)),
    "anil-batchnorm": (BN, lambda m: md.ANIL(*split_head(BN.build_model()), inner_lr=0.3,
                                             steps=2, memory=m)),
}


@pytest.mark.parametrize("memory", ["low", md.Replay(k=2)], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_low_memory_gives_the_default_meta_gradient(case, memory):
    problem, make = CASES[case]
    default, low = make("default"), make(memory)
    want, got = meta_grads(default, problem), meta_grads(low, problem)
    assert rel(got, want) < RTOL
    for (k, a), (_, b) in zip(default.named_buffers(), low.named_buffers(), strict=True):
        # Running statistics move once per inner step in both modes: the same numbers.
        torch.testing.assert_close(b, a, rtol=RTOL, atol=0, msg=k)


def test_low_memory_matches_the_float64_reference():
    p = dataclasses.replace(MLP, memory="low")
    _, want = reference.maml_meta_grad(p.build_model(), p.tasks(), steps=p.steps,
                                       inner_lr=p.inner_lr, first_order=False,
                                       classification=False)
    got = S.meta_gradient(_with_grads(p))
    assert rel(got, want) < RTOL


def _with_grads(p: S.Problem) -> md.MAML:
    alg = p.build_algorithm()
    alg.meta_loss(p.tasks(), p.loss_fn).backward()
    return alg


# The first meta-step's agreement checks (docs/guarantees.md): task counts, sizes, fingerprints
# of the tasks and of the weights, and at the sum the loss function's print: 8, and before 6
# of them a MAX of where each rank is (their sizes depend on the call site).
FIRST_STEP_CHECKS = 8 + 6


def worker(problems: list[S.Problem]) -> list[dict]:
    out = []
    for p in problems:
        with md.counting() as stats:
            r = S.run(p)
        out.append({"grads": r["grads"], "calls": stats.calls})
    return out


# 13/11 samples: uneven shards at 3 ranks; hybrid at 4 ranks (2 x 2).
DIST = [dataclasses.replace(MLP, layout=layout, memory="low") for layout in S.LAYOUTS]

# Beyond SGD on an MLP, each against the default mode's meta-gradient on one process (itself
# checked against the float64 reference in test_exact.py): learned rates with Adam inner steps
# (13/11 samples: uneven shards), synchronized BatchNorm in the sample and hybrid layouts, ANIL
# on BatchNorm features, and 2 + 3 samples per task, so that at 3 and 4 ranks some hold none.
MIXED = [
    dataclasses.replace(MLP, algorithm="metasgd", optimizer="adam", inner_lr=0.01, n_tasks=3,
                        memory="low"),
    dataclasses.replace(BN, memory="low"),
    dataclasses.replace(BN, layout="hybrid", memory="low"),
    dataclasses.replace(BN, algorithm="anil", memory="low", n_tasks=2),
    dataclasses.replace(MLP, n_support=2, n_query=3, n_tasks=3, memory="low"),
]


# Nine inner steps through a replay tree of two parts per level: the function holds the
# first eight, which the backward replays in halves, quarters and pairs.
REPLAY = [dataclasses.replace(MLP, layout=layout, memory=md.Replay(k=2), steps=9, inner_lr=0.02)
          for layout in S.LAYOUTS]


@pytest.fixture(scope="module", params=[3, 4], ids=lambda w: f"world{w}")
def across_ranks(request):
    # One group of processes per world size runs every problem.
    return request.param, run_local(worker, request.param, DIST + MIXED + REPLAY)


def _exact_with_collectives(across_ranks, problems: list[S.Problem], first: int, more: int) -> None:
    """Problems ``first``, ... of every rank's results give the float64 reference's
    meta-gradient, and in the sample layout make 3K + 2 + the first step's checks + ``more``
    collectives."""
    world, results = across_ranks
    for i, p in enumerate(problems, start=first):
        _, want = reference.maml_meta_grad(p.build_model(), p.tasks(), steps=p.steps,
                                           inner_lr=p.inner_lr, first_order=False,
                                           classification=False)
        for rank, r in enumerate(results):
            got = r[i]
            assert rel(got["grads"], want) < RTOL, f"{p.layout} world {world} rank {rank}"
            if p.layout == "sample":
                assert got["calls"] == 3 * p.steps + 2 + FIRST_STEP_CHECKS + more, got["calls"]


def test_low_memory_across_ranks_is_exact_with_3k_collectives(across_ranks):
    # The MLP's tasks are stacked (all at once): K forward SUMs, K adjoint SUMs and K - 1
    # rebuilt steps' SUMs (the last step is built once, with its graph); besides, the weights'
    # broadcast when MetaDDP is built, the meta-gradient SUM and the SUM of the loss's value.
    # The first step is checked: six small collectives compare the meta-batch across the ranks
    # (kind and task count, task counts, batch sizes (2), make_task's tasks (2)), one more
    # the loss function's print before the sum.
    _exact_with_collectives(across_ranks, DIST, 0, more=0)


def test_low_memory_across_ranks_with_adam_learned_rates_batchnorm_and_empty_shards(across_ranks):
    world, results = across_ranks
    for i, p in enumerate(MIXED, start=len(DIST)):
        default = dataclasses.replace(p, memory="default", layout="sample")
        want = S.meta_gradient(_with_grads(default))
        for rank, r in enumerate(results):
            assert rel(r[i]["grads"], want) < RTOL, f"{p} world {world} rank {rank}"


def test_a_replay_tree_across_ranks_is_exact_with_its_replayed_steps_collectives(across_ranks):
    # memory="low"'s collectives, and one SUM per replayed step. The forward keeps the states
    # before steps 0 and 4 of the eight inside the function; the backward replays each half
    # from its start, running 2 steps to reach its second quarter and 1 to reach each
    # quarter's second step: 2 * (2 + 1 + 1) = 8, (n / 2)(log2 n - 1) for n = 8.
    _exact_with_collectives(across_ranks, REPLAY, len(DIST) + len(MIXED), more=8)


def test_replay_chooses_the_fastest_tree_within_its_budget_and_refuses_nonsense():
    from metaddp._remat import alive

    # alive(k, n): the start and k - 1 states per level, ceil(log_k n) levels.
    assert [alive(2, n) for n in (1, 2, 8, 9, 10_000)] == [1, 2, 4, 5, 15]
    assert alive(7, 10_000) == 31 and alive(8, 10_000) == 36
    # The largest k that keeps at most `states` alive: everything kept when it fits.
    assert md.Replay(states=32).parts(20) == 20
    assert md.Replay(states=32).parts(10_000) == 7
    assert md.Replay(states=16).parts(10_000) == 2
    assert md.Replay(k=3).parts(10_000) == 3
    for bad in (dict(k=1), dict(k=2.5), dict(states=1), dict(k=True)):
        with pytest.raises(ValueError, match="Replay"):
            md.Replay(**bad)
    with pytest.raises(ValueError, match="memory must be one of"):
        md.MAML(MLP.build_model(), memory="tree")
    with pytest.raises(ValueError, match="rebuilds unrolled steps"):
        md.Bilevel(MLP.build_model(), start="current", memory="replay", method=md.bilevel.Neumann())


def test_the_training_command_trains_alike_in_either_mode(tmp_path):
    from metaddp import train as _train
    from metaddp.train import TrainConfig

    losses = {}
    for memory in ("default", "low"):
        cfg = TrainConfig(task="sinusoid", steps=4, meta_batch=3, shots=5, query=5, hidden=8,
                          inner_steps=2, dtype="float64", eval_every=0, eval_tasks=3,
                          memory=memory).resolved()
        out = tmp_path / memory
        _train.prepare_folder(out, cfg, False, force=False)
        losses[memory] = _train.train(cfg, out, progress=False)["losses"]
    # Float64, four outer steps of the same meta-gradient (see RTOL): the same trajectory.
    assert losses["low"] == pytest.approx(losses["default"], rel=RTOL)



@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("algorithm", ["maml", "anil", "metasgd"])
def test_low_memory_through_adapt_gives_the_default_meta_gradient(algorithm, steps):
    # adapt() with a hand-written query loss: the rematerialized inner loop alone (the query
    # pass is the caller's). ANIL's support features need their own gradient through it, and
    # Meta-SGD's rates theirs. With one step, all of it is the caller's graph.
    grads = {}
    for memory in ("default", "low"):
        p = dataclasses.replace(BN, algorithm=algorithm, memory=memory, steps=steps)
        alg = p.build_algorithm()
        for task in p.tasks():
            fast = alg.adapt(task.support, p.loss_fn)
            md.share(p.loss_fn(alg(task.query.x, fast=fast), task.query.y), task.query).backward()
        grads[memory] = S.meta_gradient(alg)
    assert rel(grads["low"], grads["default"]) < RTOL


def test_the_query_loss_and_the_last_step_run_once_and_the_backward_scales():
    # rematerialized_loss computes its gradient in the forward: K - 1 first-order steps, the
    # last step with its graph under the one query pass, then K - 1 rebuilt steps. Counted
    # here through the losses it is given, on a small float64 least-squares problem, with
    # momentum, whose state's adjoint must pass from the last step to the rebuilt ones.
    from metaddp._remat import rematerialized_loop, rematerialized_loss

    torch.manual_seed(0)
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    xq, yq = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    calls = {"support": 0, "query": 0}

    def support(fast, buffers, step):
        calls["support"] += 1
        return ((x @ fast["w"] - y) ** 2).mean()

    def query(fast, buffers):
        calls["query"] += 1
        return ((xq @ fast["w"] - yq) ** 2).mean()

    steps = 4
    fast, v = {"w": w}, None
    for _ in range(steps):  # the default: every step's graph kept
        (g,) = torch.autograd.grad(support(fast, None, 0), [fast["w"]], create_graph=True)
        v = g if v is None else 0.9 * v + g
        fast = {"w": fast["w"] - 0.1 * v}
    (want,) = torch.autograd.grad(2.5 * query(fast, None), [w])

    def low():
        return rematerialized_loss(support, query, {"w": w}, steps=steps,
                                   optimizer=md.sgd(0.1, momentum=0.9), reduce=lambda g: g)

    calls.update(support=0, query=0)
    loss = low()
    assert calls == {"support": 2 * steps - 1, "query": 1}
    (got,) = torch.autograd.grad(2.5 * loss, [w])  # the upstream gradient scales it
    assert calls == {"support": 2 * steps - 1, "query": 1}  # the backward ran nothing more
    # Float64, the same operations in another order (see RTOL).
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    assert float(loss.detach()) == pytest.approx(float(query(fast, None).detach()), rel=RTOL)

    calls.update(support=0, query=0)
    with torch.no_grad():  # no gradient wanted: the steps and the query loss, nothing more
        low()
    assert calls == {"support": steps, "query": 1}

    # The inner loop alone (adapt's): K - 1 first-order steps, the last with its graph; the
    # backward rebuilds the K - 1.
    calls.update(support=0, query=0)
    adapted = rematerialized_loop(support, {"w": w}, steps=steps,
                                  optimizer=md.sgd(0.1, momentum=0.9), reduce=lambda g: g)
    assert calls["support"] == steps
    (got,) = torch.autograd.grad(2.5 * query(adapted, None), [w])
    assert calls == {"support": 2 * steps - 1, "query": 1}
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)  # as above


class _Live:
    """Bytes of the storages autograd holds for backward passes, now and at most."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        size = t.untyped_storage().nbytes()
        self.now += size
        self.peak = max(self.peak, self.now)
        holder = torch.empty(0)  # its life is the saved tensor's: freed with the graph
        weakref.finalize(holder, self._free, size)
        return (t, holder)

    def _free(self, size: int) -> None:
        self.now -= size

    @staticmethod
    def unpack(packed):
        return packed[0]


@pytest.mark.parametrize("batched", [True, False], ids=["stacked", "one-by-one"])
def test_after_meta_loss_the_low_mode_holds_no_graph(batched):
    # Until the backward, memory="low" keeps no saved tensor at all, also while the step's
    # finiteness checks wait to be read (as on a GPU, where they are read at its end); the
    # default holds every step's graph. The peak is one task's (or one stacked) step and query
    # pass, whatever K. (From K = 2: the first step, on the meta-parameters themselves, saves
    # less than the others, whose weights are the tasks' own.)
    peaks = {}
    for steps in (2, 5):
        for memory in ("default", "low"):
            p = dataclasses.replace(MLP, steps=steps, memory=memory)
            alg = md.MAML(p.build_model(), inner_lr=0.1, steps=steps, memory=memory,
                          batched=batched)
            live = _Live()
            with _host.as_on_a_device(), torch.autograd.graph.saved_tensors_hooks(
                    live.pack, live.unpack):
                loss = alg.meta_loss(p.tasks(), p.loss_fn)
                held = live.now
                loss.backward()
            peaks[steps, memory] = live.peak
            assert (held == 0) == (memory == "low"), (steps, memory, held)
    assert peaks[5, "low"] == peaks[2, "low"]  # exact byte counts: nothing grows with K
    assert peaks[5, "default"] > 2 * peaks[2, "default"]


def _one_more_step_on_rank_one() -> str:
    # The first two meta-steps are checked (their settings compared before any work); rank 1
    # takes one more inner step from the third on, which no check compares first.
    p = dataclasses.replace(MLP, steps=2, layout="sample", memory="low")
    learner = md.MetaDDP(p.build_algorithm(), S.mesh_for(p.layout))
    try:
        for step in range(3):
            if step == 2:
                learner.module.steps += md.rank()
            learner.zero_grad(set_to_none=True)
            learner.meta_loss(learner.shard(p.n_tasks, p.task), p.loss_fn).backward()
            learner.sync_grads()
    except md.CollectiveError as e:
        return str(e)
    return "no error"


def test_ranks_out_of_step_fail_with_a_message_not_a_hang():
    # Rank 1 runs one more inner step: the rebuilt steps' SUMs carry the same sequence tags
    # as every other collective, so both ranks stop at the first one that disagrees.
    for rank, msg in enumerate(run_local(_one_more_step_on_rank_one, 2, timeout_s=60)):
        assert "ranks are out of step" in msg and "inner-step counts" in msg, (rank, msg)


@pytest.mark.parametrize("through", ["meta_loss", "adapt"])
def test_differentiating_the_meta_gradient_again_is_a_clear_error(through):
    # The rebuilt steps give first derivatives only. A create_graph backward (a penalty on
    # the meta-gradient, say) would silently drop this mode's terms from the second ones,
    # even when another term of the loss keeps its graph: it is refused instead.
    p = dataclasses.replace(MLP, steps=2, memory="low")
    alg = p.build_algorithm()
    params = [q for q in alg.parameters() if q.requires_grad]
    if through == "meta_loss":
        loss = alg.meta_loss(p.tasks(), p.loss_fn)
    else:
        task = p.tasks()[0]
        fast = alg.adapt(task.support, p.loss_fn)
        loss = md.share(p.loss_fn(alg(task.query.x, fast=fast), task.query.y), task.query)
    loss = loss + sum((q ** 2).sum() for q in params)
    with pytest.raises(RuntimeError, match="memory='default' to differentiate"):
        torch.autograd.grad(loss, params, create_graph=True)
    (first,) = torch.autograd.grad(loss, params[:1])  # a plain gradient still works
    assert torch.isfinite(first).all()


@pytest.mark.parametrize("batched", [True, False], ids=["stacked", "one-by-one"])
@pytest.mark.parametrize("make", [md.sgd, md.adam], ids=["sgd", "adam"])
def test_a_rate_given_to_the_optimizer_as_a_tensor_gets_its_meta_gradient(make, batched):
    # A tensor rate that requires grad is trained by the outer loop in either mode: the low
    # mode's function takes it as an input. (Without that it got no gradient at all.)
    grads = {}
    for memory in ("default", "low"):
        rate = torch.tensor(0.02, dtype=torch.float64, requires_grad=True)
        alg = md.MAML(MLP.build_model(), steps=3, optimizer=make(rate), memory=memory,
                      batched=batched)
        grads[memory] = meta_grads(alg, MLP)
        grads[memory]["rate"] = rate.grad.clone()
    assert float(grads["default"]["rate"].abs()) > 0
    assert rel(grads["low"], grads["default"]) < RTOL


def _log_rates(memory: object, kind: str) -> dict[str, torch.Tensor]:
    """The meta-gradient with per-tensor rates computed from log-rates by an optimizer
    factory, each time it is called: Bilevel's ``optimizer=lambda: ...`` (docs/bilevel.md) or
    MAML's ``learn_lr`` with a factory of the rates."""
    torch.manual_seed(0)
    model = MLP.build_model()
    names = [k for k, _ in model.named_parameters()]
    if kind == "bilevel":
        hp = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(torch.tensor(-2.3 + 0.1 * i))
             for i, k in enumerate(names)})
        alg: md.Algorithm = md.Bilevel(
            model, outer=hp, start="outer", steps=3, memory=memory,
            optimizer=lambda: md.sgd({k: hp[k.replace(".", "_")].exp() for k in names}))
    else:
        alg = md.MAML(model, inner_lr=0.1, steps=3, learn_lr="tensor", memory=memory,
                      optimizer=lambda lr: md.sgd({k: v.exp() * 0.5 for k, v in lr.items()}),
                      batched=kind == "maml-stacked")
    if kind != "maml-adapt":
        return meta_grads(alg, MLP)
    for task in MLP.tasks():  # the rematerialized inner loop alone: the query pass is ours
        fast = alg.adapt(task.support, MLP.loss_fn)
        md.share(MLP.loss_fn(alg(task.query.x, fast=fast), task.query.y), task.query).backward()
    return {k: q.grad.clone() for k, q in alg.named_parameters() if q.grad is not None}


@pytest.mark.parametrize("memory", ["low", md.Replay(k=2)], ids=str)
@pytest.mark.parametrize("kind", ["bilevel", "maml-stacked", "maml-one-by-one", "maml-adapt"])
def test_rates_a_factory_computes_from_parameters_get_the_default_meta_gradient(kind, memory):
    # The factory's rates (exp of a log-rate) are built anew for every step: one graph of
    # them, walked back through by every rebuilt step, was freed by the first ("Trying to
    # backward through the graph a second time").
    want, got = _log_rates("default", kind), _log_rates(memory, kind)
    assert all(float(g.abs().max()) > 0 for g in want.values())  # the log-rates' included
    # Float64: the same operations, but the rates' gradients go through exp's backward step
    # by step instead of once for their sum, and the steps' in another order: a few roundings
    # apart (observed <= 8.6e-16 of the largest entry; eps = 2.2e-16), where a missed or
    # doubled path through the rates moves the meta-gradient by 1e-2 or more.
    assert rel(got, want) < 5e-15


@pytest.mark.parametrize("memory", ["low", md.Replay(k=2)], ids=str)
def test_distilled_images_get_the_default_meta_gradient_once(memory):
    # The images are both an outer parameter and the inner batch's inputs: the function took
    # them as two inputs and counted their gradient more than once.
    grads = {}
    for mode in ("default", memory):
        real = MLP.tasks()[0].query
        torch.manual_seed(0)
        images = torch.nn.Parameter(torch.randn(6, *real.x.shape[1:], dtype=real.x.dtype))
        alg = md.Bilevel(MLP.build_model(), outer=torch.nn.ParameterDict({"images": images}),
                         start="outer", steps=3, inner_lr=0.1, memory=mode)
        alg.meta_loss([md.Task(md.Batch(images, real.y[:6], 6), real)], MLP.loss_fn).backward()
        grads[str(mode)] = {k: q.grad.clone() for k, q in alg.named_parameters()}
    # Float64, the same operations a few sums apart (observed 8.6e-18; eps = 2.2e-16), where
    # a gradient counted twice is off by its own size (0.63 here).
    assert rel(grads[str(memory)], grads["default"]) < 5e-15


@pytest.mark.parametrize("through,steps", [("meta_loss", 1), ("meta_loss", 3), ("adapt", 3)])
def test_a_tensor_from_outside_that_needs_a_gradient_is_refused(through, steps):
    # A weight the loss function captures is no input of the low mode's function, whose
    # backward would leave it without a gradient: refused, naming the way out.
    scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    loss_fn = lambda pred, y: scale * MLP.loss_fn(pred, y)  # noqa: E731
    alg = md.MAML(MLP.build_model(), inner_lr=0.1, steps=steps, memory="low")
    with pytest.raises(ValueError, match=r"cannot give a gradient to 1 tensor\(s\) of shape \(\)"):
        if through == "meta_loss":
            alg.meta_loss(MLP.tasks(), loss_fn)
        else:
            alg.adapt(MLP.tasks()[0].support, loss_fn)
    # The default mode differentiates it as any other tensor.
    md.MAML(MLP.build_model(), inner_lr=0.1, steps=steps).meta_loss(MLP.tasks(), loss_fn).backward()
    assert scale.grad is not None and float(scale.grad.abs()) > 0
