"""Sharded meta-parameters (``MetaDDP(..., shard=True)``) at world sizes 1 to 4 (the shared
process groups of tests/conftest.py; the problems are tests/sharded_workers.py's): the
meta-gradient of an independent float64 reference (plain autograd on whole batches) for
MAML of first and second order, with BatchNorm; the one-process replicated value for Adam
inner steps, ``memory="low"``, the transformer and bilevel problems (those are checked
against independent references by tests/test_transformer.py, test_bilevel.py and
test_algorithms_compared.py); the gather's derivatives to third order in closed form; what
each rank holds and sends; and the refusals."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import reference_bilevel as R
import sharded_workers as W
from metaddp.testing import scenarios as S
from reference import maml_meta_grad
from test_algorithms_compared import reference as compared_reference
from test_algorithms_compared import reference_maml_bn

WORLDS = (1, 2, 3, 4)
CUT = (2, 3, 4)  # world sizes where something is cut (one process is tested on its own)
# Float64, relative to the largest entry. Sharded and replicated differ only in the order
# of floating-point sums (a reduce-scatter adds the ranks' rows in another order than an
# all-reduce). Observed: below 1e-15, except Adam inner steps on split samples (3e-13 for
# the bilevel problem at 3 ranks: g / sqrt(v) amplifies a small gradient entry's rounding by
# 1 / |g|). A missing reduction or a rank's own rows is off by 1e-2 or more.
RTOL = 1e-12


@pytest.fixture(scope="module")
def results(worlds) -> dict[int, list[dict]]:
    return {w: [rank["sharded"] for rank in worlds[w]] for w in WORLDS}


def relative(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    scale = max(float(v.abs().max()) for v in want.values())
    return max(float((got[k] - want[k]).abs().max()) for k in want) / scale


@functools.cache
def replicated(problem: S.Problem) -> dict:
    """One process, replicated (no process group), once per problem."""
    return S.run(problem)


@functools.cache
def replicated_bilevel(problem: S.BilevelProblem) -> dict:
    return S.run_bilevel(problem)


@functools.cache
def reference(problem: S.Problem) -> tuple[float, dict]:
    """Plain autograd, one process, whole batches (tests/reference.py)."""
    model = problem.build_model()
    tasks = [((t.support.x, t.support.y, None), (t.query.x, t.query.y, None))
             for t in problem.tasks()]
    return maml_meta_grad(model, tasks, steps=problem.steps, inner_lr=problem.inner_lr,
                          first_order=problem.first_order, classification=problem.model == "conv")


@pytest.mark.parametrize("world", CUT)
@pytest.mark.parametrize("name", ["maml-2nd-sample", "maml-1st-sample", "maml-2nd-hybrid",
                                  "conv-batchnorm", "default-units"])
def test_sharded_maml_is_the_independent_reference(results, world, name):
    loss, want = reference(W.PROBLEMS[name])
    for rank in results[world]:  # every rank holds the same full meta-gradient once gathered
        got = rank["problems"][name]
        assert relative(got["grads"], want) < RTOL
        assert got["loss"] == pytest.approx(loss, rel=1e-13)


@pytest.mark.parametrize("world", CUT)
def test_sharded_adamw_and_running_statistics_are_the_independent_references(results, world):
    """AdamW inner steps as torch.optim defines them, and BatchNorm moving its running
    statistics task after task: the float64 references of tests/test_algorithms_compared.py,
    written without metaddp."""
    got = results[world][0]["problems"]["maml-adamw-hybrid"]
    assert relative(got["grads"], compared_reference(W.PROBLEMS["maml-adamw-hybrid"])) < RTOL
    grads, buffers = reference_maml_bn(W.PROBLEMS["conv-batchnorm-running"])
    got = results[world][0]["problems"]["conv-batchnorm-running"]
    assert relative(got["grads"], grads) < RTOL
    for k, b in buffers.items():
        if b.is_floating_point():  # synchronized over the shards: the whole batch's statistics
            torch.testing.assert_close(got["buffers"][k], b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_lookahead_is_the_independent_bilevel_reference(results, world):
    """The reweighting lookahead against tests/reference_bilevel.py (plain autograd), its
    learned weight decay off: exp(-inf) = 0 there, frozen here."""
    problem = W.BILEVEL["bilevel-lookahead"]
    algorithm = problem.build_algorithm()
    params = dict(algorithm.named_parameters(remove_duplicate=False))
    layers = ("0.weight", "0.bias", "2.weight", "2.bias")
    pb = R.Problem([params[f"model.{k}"] for k in layers], [params[f"outer.net.{k}"] for k in layers],
                   torch.tensor(-math.inf, dtype=torch.float64, requires_grad=True),
                   lr=problem.inner_lr, optimizer=problem.optimizer, start=problem.start,
                   proximal=S.PROXIMAL)
    tasks = [((t.support.x, t.support.y), (t.query.x, t.query.y))
             for t in map(problem.task, range(problem.n_problems))]
    loss, grads = R.hypergradient(pb, tasks, problem.method, problem.steps, problem.method_options())
    want = dict(zip([f"outer.net.{k}" for k in layers], grads))
    got = results[world][0]["bilevel"]["bilevel-lookahead"]
    assert relative(got["grads"], want) < RTOL
    assert got["loss"] == pytest.approx(loss, rel=1e-12)


@pytest.mark.parametrize(("world", "name"), [
    (w, n) for w in CUT for n in ("maml-adam-hybrid", "maml-low-memory", "conv-batchnorm-running",
                                  "transformer") if w != 3 or n in W.AT_THREE])
def test_sharded_is_the_replicated_one_process_value(results, world, name):
    problem = W.PROBLEMS[name]
    want = replicated(problem)
    tol = RTOL
    got = results[world][0]["problems"][name]
    assert relative(got["grads"], want["grads"]) < tol
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-12)
    for k, b in want["buffers"].items():  # running statistics, synchronized over the shards
        if b.is_floating_point():
            torch.testing.assert_close(got["buffers"][k], b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(W.BILEVEL))
def test_sharded_bilevel_is_the_replicated_one_process_value(results, world, name):
    problem = W.BILEVEL[name]
    want = replicated_bilevel(problem)
    got = results[world][0]["bilevel"][name]
    tol = RTOL
    assert relative(got["grads"], want["grads"]) < tol
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-12)


@pytest.mark.parametrize("world", WORLDS)
def test_gather_composes_to_third_order(results, world):
    """Each level's gradient is the global one's rows: 3C w^2, 6C w, 6C (sharded_workers)."""
    c = sum((r + 1) / 10 for r in range(world))
    rows = []
    for r, rank in enumerate(results[world]):
        full, w, g1, g2, g3 = rank["orders"]
        assert full == [1.0, 2.0, 3.0, 4.0, 5.0]
        per = math.ceil(5 / world)
        assert w == [float(i) for i in range(1 + r * per, min(6, 1 + (r + 1) * per))]
        wt = torch.tensor(w, dtype=torch.float64)
        torch.testing.assert_close(torch.tensor(g1, dtype=torch.float64), 3 * c * wt**2)
        torch.testing.assert_close(torch.tensor(g2, dtype=torch.float64), 6 * c * wt)
        torch.testing.assert_close(torch.tensor(g3, dtype=torch.float64), 6 * c * torch.ones_like(wt))
        rows += w
    assert rows == [1.0, 2.0, 3.0, 4.0, 5.0]  # the shards cover every row once


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_holds_its_rows_of_weights_gradients_and_optimizer_state(results, world):
    """The MLP 1-16-16-1 (321 entries): a rank holds ceil(rows / N)-row pieces of each
    tensor, and the outer Adam state (two slots) follows; replicated, all of it."""
    total = 321
    sizes = []
    for r, rank in enumerate(results[world]):
        replicated, sharded = rank["held"][False], rank["held"][True]
        assert replicated["params"] == replicated["grads"] == total
        assert replicated["state"] == 2 * total
        mine = sum(W.Cut(torch.Size(s), world, r).local_shape.numel()
                   for s in [(16, 1), (16,), (16, 16), (16,), (1, 16), (1,)])
        assert sharded["params"] == sharded["grads"] == mine
        assert sharded["state"] == 2 * mine
        assert sharded["loss"] == pytest.approx(replicated["loss"], rel=1e-13)
        # The whole meta-gradient's norm, clipped (torch's function on replicated weights),
        # and one outer Adam step on the rows each rank holds: the same parameters.
        assert sharded["norm"] == pytest.approx(replicated["norm"], rel=1e-12)
        for k, want in replicated["stepped"].items():
            torch.testing.assert_close(sharded["stepped"][k], want, rtol=1e-12, atol=1e-15)
        sizes.append(mine)
    assert sum(sizes) == total
    assert max(sizes) <= math.ceil(total / world) + 16 * 2  # about 1/N: uneven rows aside


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_step_gathers_and_reduce_scatters_instead_of_all_reducing(results, world):
    """Sharded, the inner loop moves its weights by all-gathers and reduce-scatters; the
    only all-reduces left are the small tail (has-gradient flags, the loss) and, on a checked
    step such as this first one, the guards' block of what each rank computed (a row per
    rank): this model has no BatchNorm, whose statistics would be summed too."""
    from metaddp.distributed._work import SLOT, WIDTH

    rank = results[world][0]["held"]
    replicated, sharded = rank[False]["by_kind"], rank[True]["by_kind"]
    assert set(replicated) == {"all_reduce"}
    assert sharded["all_gather"] > 0 and sharded["reduce_scatter"] > 0
    # Replicated: K inner SUMs forward and backward, plus the meta-gradient SUM, each of the
    # 321 float64 entries (+ a tag); sharded all-reduces only the tail and the block.
    assert replicated["all_reduce"] >= (2 * 2 + 1) * 321 * 8
    block = (world * WIDTH + SLOT) * 8  # float64, one sample group
    assert sharded["all_reduce"] - block < 321 * 8


@pytest.mark.parametrize(("world", "name"), [(w, n) for n, (_, at) in W.STACKED.items() for w in at])
def test_stacked_tasks_on_sharded_weights_are_the_one_process_values(results, world, name):
    """batched=True on shards: every task's gathers under torch.vmap, as one collective. The
    MLP's meta-gradient is the one-process replicated value with the tasks stacked and the
    independent float64 reference (plain autograd, task by task); the transformer's, the
    one-process value as batched=None runs it (one task at a time, its dropout masks keyed
    per task as stacked; test_transformer.py checks its stacked and one-by-one values
    against its own reference). The references are the ones the tests above compute
    (cached)."""
    problem, _ = W.STACKED[name]
    got = results[world][0]["stacked"][name]
    if problem.model == "mlp":
        loss, grads = reference(dataclasses.replace(problem, batched=None, memory="default"))
        wants = [replicated(problem), {"loss": loss, "grads": grads}]
    else:
        wants = [replicated(dataclasses.replace(problem, batched=None))]
    for want in wants:
        # Float64 sums in another order only (vmapped kernels, the reduce-scatter over moved
        # dimensions): observed below 8e-16. Gathering a rank's rows of the stacked
        # [T, rows, ...] tensor as if T were the rows, or a rank's own inner gradient, is
        # off by 1e-2 or more.
        assert relative(got["grads"], want["grads"]) < RTOL, (world, name)
        # The loss: the same float64 sums in another order, one scalar (observed within
        # 2e-16 relative); the bound is RTOL's, far below what a wrong share would move.
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-12)


def test_stacked_sharded_collectives_do_not_grow_with_the_tasks(results):
    """A stacked sharded step (MLP, every layer gathered on its own) makes the same
    collectives for 4 tasks as for 2 (each gather and reduce-scatter carries every task);
    one by one, each task makes its own."""
    calls = results[2][0]["stacked"]["calls"]
    assert calls[4, True] == calls[2, True]
    assert 2 * calls[2, True] < calls[2, False]


def test_a_fully_shard_model_stacks_its_tasks(results):
    """An FSDP2 model (adopted) with batched=True in the sample layout: the float64
    one-process reference, as with the tasks one by one."""
    loss, want = reference(W.FSDP)
    got = results[2][0]["stacked"]["fsdp2"]
    # Float64, sums in another order only (test_a_fully_shard_model_meta_trains_under_
    # metaddp's bound): observed below 1e-15; a rank's own rows are off by 1e-1.
    assert relative(got["grads"], want) < RTOL
    assert got["loss"] == pytest.approx(loss, rel=1e-12)  # the same sums, one scalar


@pytest.mark.parametrize("world", [2, 4])
def test_check_mode_compares_the_gathered_weights(results, world):
    """Check mode's pre-hooks see each layer's full weights (gathered before them), which
    agree across the sample group: no false alarm, the same meta-gradient as unchecked."""
    want = replicated(dataclasses.replace(W.PROBLEMS["transformer"], layout="hybrid"))
    assert relative(results[world][0]["checked"]["grads"], want["grads"]) < RTOL
    assert results[world][0]["checked"]["written"] == []


@pytest.mark.parametrize("world", [2, 4])
def test_graphs_keep_shards_and_gather_again_for_the_backward(results, world):
    ways = results[world][0]["regather"]
    rows, whole, default = ways["rows"], ways["whole"], ways["default"]
    assert rows["packed"] > 0  # saved weights were kept as rows
    assert whole["packed"] == 0 and default["packed"] == 0  # tiny weights are kept whole
    assert rows["gathered"] > whole["gathered"]  # ... and gathered again in the backward
    # Every layer on its own: more, smaller collectives than this tiny model's one unit.
    assert default["calls"] < whole["calls"] <= rows["calls"]
    for k, g in whole["grads"].items():  # the same numbers: the same sums, gathered again
        assert torch.equal(rows["grads"][k], g)
    # One reduce-scatter for all layers instead of one each: gloo adds the ranks' rows in
    # another order (observed: 1 ulp, 3e-17).
    assert relative(default["grads"], rows["grads"]) < 1e-15


def test_anils_whole_head_is_summed_in_hand_loops_on_its_sharded_body(results):
    """clone() and learner.grad by ANIL's head, whose names and shapes are those of the sharded
    body's rows: summed as the whole weights they are, the one-process meta-gradient."""
    for how in ("clone", "grad"):
        assert relative(results[2][0]["anil-head"][how], results[1][0]["anil-head"][how]) < RTOL


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_mistakes_are_errors(results, world):
    out = results[world][0]["refusals"]
    assert out["metasgd"] is None  # its rates are cut with the weights (test_matrix: exact)
    assert "build it with per_step_bn=False" in out["per_step_bn"]
    assert "not entry by entry" in out["clip"]
    assert out["learn_lr"] is None  # one learned rate: its gradient summed over the mesh
    assert "optimizer factory of its own" in out["rates-factory"]
    assert "deterministic=True and shard=True do not combine" in out["deterministic"]
    assert "not one" in out["bare-model"]
    assert "use Unrolled" in out["implicit"]
    assert "penalty" in out["penalty"]
    assert "the model's parameters are shards" in out["model(x)"]
    assert "enter `with learner.gathered():`" in out["local"]
    assert out["batched"] is None  # stacked tasks run on shards (test_stacked_tasks_...)
    assert out["gathered-local"] is None  # inside gathered(), one rank may run it alone
    assert out["adapt-alone"] is None  # ... and adapt, after a sharded step (a backward)
    if world > 1:  # on one rank nothing is cut, and torch's clipping is right
        assert "Use learner.clip_grad_norm_(max_norm)" in out["torch-clip"]
    assert out["released-shape"] == [(16, 1), (16,), (16, 16), (16,), (1, 16), (1,)]


@pytest.mark.parametrize("world", [2])  # at 4: the transformer's test below
def test_a_fully_shard_model_meta_trains_under_metaddp(results, world):
    """A model cut by FSDP2's fully_shard (rank 1's rows of the 1-row head empty), adopted by
    MetaDDP in the sample layout: the second-order MAML meta-gradient lands in its DTensor
    parameters' .grad, placed Shard(0) as they are, and is the float64 one-process reference
    on the unsharded model and whole batches; AdamW built on the DTensors steps them as
    one-process AdamW steps the reference."""
    p = W.FSDP
    loss, want = reference(p)
    model = p.build_model()
    for name, q in model.named_parameters():
        q.grad = want[name].clone()
    torch.optim.AdamW(model.parameters(), lr=W.FSDP_LR).step()
    for rank, got in enumerate(r["fsdp2"] for r in results[world]):
        grads = {k.removeprefix("model."): g for k, g in got["grads"].items()}
        # Float64; the adopted rows and the reference differ only in the order of sums (the
        # reduce-scatter adds the ranks' rows): below 1e-15 relative, where a rank's own
        # gradient (DTensor.full_tensor()'s adjoint) is off by 1e-1.
        assert relative(grads, want) < 1e-12
        assert got["loss"] == pytest.approx(loss, rel=1e-13)  # the same float64 sums
        for k, kinds in got["kinds"].items():
            assert kinds == ("DTensor", "DTensor", (Shard(0),)), (k, kinds)
            rows = want[k.removeprefix("model.")].shape[0]
            per = -(-rows // world)  # torch.chunk's rows, as metaddp's Cut
            assert got["local"][k][0] == max(0, min(per, rows - rank * per))
        assert got["still"]
        # AdamW's first step is lr * g / (|g| + eps) per entry: a 1e-16 difference in a
        # gradient entry near eps = 1e-8 moves it by up to lr * 1e-8; observed below 1e-15.
        stepped = {k.removeprefix("model."): w for k, w in got["stepped"].items()}
        for k, w in model.named_parameters():
            torch.testing.assert_close(stepped[k], w.detach(), rtol=0, atol=1e-12)
        # Each layer gathered as it runs, graphs keeping rows: the same sums, the same bound.
        per_layer = {k.removeprefix("model."): g for k, g in got["per_layer"].items()}
        assert relative(per_layer, want) < 1e-12 and got["packed"] > 0
        # Bilevel(start="outer") with Unrolled is MAML's problem: the same sums, the same bound.
        assert relative(got["bilevel"], want) < 1e-12
        norm = math.sqrt(sum(float((g**2).sum()) for g in want.values()))
        # The learner's norm sums the rows' squares; torch's, on DTensors, reduces them too.
        assert got["norms"] == pytest.approx((norm, norm), rel=1e-12)


def test_fsdp2_settings_metaddp_cannot_adopt_are_refused_with_what_to_do(results):
    got = results[2][0]["fsdp2"]
    assert got["state"] == 6  # sharded_state_dict(): the model's six DTensors, for DCP
    assert "fully_shard" in got["model(x)"] and "learner.meta_loss" in got["model(x)"]
    assert "full_tensor()" in got["gathered"]
    assert math.isfinite(got["released"])  # release() gave FSDP its forward back
    refused = got["refused"]
    assert "mixed precision policy" in refused["mixed precision"]
    assert "CPUOffloadPolicy" in refused["offload"]
    assert "(Shard(dim=1),)" in refused["Shard(1)"] and "Shard(0)" in refused["Shard(1)"]
    assert "MetaDDP's sample group here is ranks [0]" in refused["mesh"]
    assert "mesh.device_mesh['sample']" in refused["mesh"]
    assert refused.pop("Meta-SGD") == "ran"  # its learned rates are cut with the weights
    assert "outside the part of the model that ANIL shards" in refused["ANIL"]
    for message in refused.values():
        assert message.startswith("a model sharded by FSDP2: ")


@pytest.mark.parametrize("world", [2, 4])
def test_a_fully_shard_transformer_with_dropout_in_the_sample_and_hybrid_layouts(results, world):
    """tests/test_transformer.py's problem (dropout 0.1 on, keyed masks) with its model cut by
    fully_shard: over every rank (sample layout) and as HSDP over the task x sample mesh
    (hybrid layout: 2 task groups of 1 rank at 2 processes, of 2 ranks at 4). The second-order
    meta-gradient is test_transformer.py's float64 reference, written out from the weights
    with its masks drawn again by hand; Bilevel(Unrolled) on the HSDP MLP is MAML's."""
    from test_transformer import reference as transformer_reference

    loss, want = transformer_reference(W.FSDP_TRANSFORMER)
    _, mlp = reference(dataclasses.replace(W.FSDP, n_tasks=3))
    for rank in results[world]:
        got = rank["fsdp2-layouts"]
        for layout, placed in (("sample", {(Shard(0),)}), ("hybrid", {(Replicate(), Shard(0))})):
            # Float64 against a reference that groups its sums differently: observed 7.4e-16
            # (test_transformer.py's bound, for the same reasons); a mask drawn by a rank's
            # own generator, or a rank's own rows, is off by more than 1e-2.
            assert relative(got[layout]["grads"], want) < 1e-12, (world, layout)
            assert got[layout]["loss"] == pytest.approx(loss, rel=1e-12)
            assert got[layout]["placements"] == placed
        assert relative(got["bilevel-hybrid"], mlp) < 1e-12  # the same sums and bound


def test_a_dcp_checkpoint_of_a_fully_shard_model_saved_at_2_resumes_at_3(results):
    """get_state_dict(net, opt) saved with torch.distributed.checkpoint at 2 processes and
    loaded with set_state_dict into a fully_shard model over 3: the weights are the saved
    ones, bit for bit, and the next meta-step and AdamW step are the ones taken at 2."""
    saved = results[2][0]["fsdp2-resume"]
    for rank in results[3]:
        got = rank["fsdp2-resume"]
        for k, w in saved["weights"].items():
            assert torch.equal(got["weights"][k], w), k
            # AdamW's moments and step count came back too (a fresh state would take a first
            # step, lr * g / |g|, instead of a second: off by up to lr = 1e-2); the
            # meta-gradients at 2 and 3 differ by the order of sums, which AdamW's
            # normalised step moves by at most lr * 1e-8 where |g| is near eps.
            torch.testing.assert_close(got["next"][k], saved["next"][k], rtol=0, atol=1e-12)


def test_one_process_shard_is_a_no_op():
    """On one process (no group) there is nothing to cut: the same numbers as replicated."""
    p = W.PROBLEMS["maml-2nd-sample"]
    a, b = S.run(p), S.run(dataclasses.replace(p, shard=True))
    for k in a["grads"]:
        assert torch.equal(a["grads"][k], b["grads"][k])


def test_a_sharded_state_saved_on_two_processes_loads_on_three_and_four(results):
    """``learner.sharded_state_dict()`` through torch.distributed.checkpoint: saved at 2
    processes (1 task group x 2 sample ranks), loaded at 3 (1 x 3) and 4 (2 x 2), each rank
    reading the rows it holds now; the gathered weights are the saved ones, bit for bit."""
    saved = results[2][0]["dcp"]
    assert saved["saved"]
    assert results[1][0]["dcp"]["dtensors"] == 0  # one process: nothing cut, plain tensors
    for world in (2, 3, 4):  # the MLP's six sharded tensors, as DTensors of the mesh
        assert results[world][0]["dcp"]["dtensors"] == 6
    fresh = results[1][0]["dcp"]["weights"]  # built, not loaded: the weights before the edit
    for k, w in saved["weights"].items():
        assert torch.equal(w, fresh[k] + 0.5)
    for world in (3, 4):
        for rank in results[world]:
            assert rank["dcp"]["loaded"]
            for k, w in saved["weights"].items():
                assert torch.equal(rank["dcp"]["weights"][k], w)
