"""Every algorithm x mode x layout cell that the algorithms offer, generated from their
declarations (tests/matrix_workers.py), at 1, 2 and 3 processes (a third of them at 3 in
make test, all in make verify; modes: tasks one by one, stacked, low memory, deterministic,
sharded, dropout in the model, check mode, a hand loop over ``clone()``): each gives the
one-process meta-gradient (bit for bit in deterministic mode) or is refused when the learner
is built, as declared, with a reason, never later and never by a different number."""

from __future__ import annotations

import pytest
import torch

import matrix_workers as M
from conftest import SLOW
from metaddp.distributed.launch import run_local

# Float64 meta-gradients whose sums are split differently at another world size: a few ulps
# per operation, observed below 1e-15 relative; 1e-12 leaves margin, while a missing reduction
# or a different draw is 1e-3 or more.
RTOL = 1e-12


# At 3 processes make test runs a third of the cells (every third of the generated order, and
# every deterministic one), which still holds every algorithm, mode and layout: two ranks
# waiting on a third that shares their two cores make 3 processes the matrix's slowest world
# (more than half its time). make verify (METADDP_SLOW=1) runs every cell at 3.
EVERY_AT_THREE = 1 if SLOW else 3


@pytest.fixture(scope="module")
def worlds() -> dict[int, list[dict]]:
    # One process group per world size runs the cells (one thread each: deterministic mode's
    # bits must not depend on a thread count that changes with the world size).
    return {w: run_local(M.every_cell, w, EVERY_AT_THREE if w == 3 else 1, threads=1) for w in (1, 2, 3)}


def test_every_offered_cell_is_exact_or_refused_when_built(worlds):
    one = worlds[1][0]
    assert len(one) == 172  # 86 algorithm x mode cells the algorithms take, in 2 layouts
    at_three = set(worlds[3][0])
    assert at_three == set(M.sample(EVERY_AT_THREE))
    for i, axis in enumerate((M.ALGORITHMS, M.MODES, M.LAYOUTS)):  # the sample holds each of each
        assert {key[i] for key in at_three} == set(axis), axis
    for world, ranks in worlds.items():
        for rank, cells in enumerate(ranks):
            assert cells.keys() == (one.keys() if world < 3 else at_three)
            for key, got in cells.items():
                where = f"{key} at world {world}, rank {rank}"
                assert got.get("refused") != "step", f"{where} refused only at the step: {got['why']}"
                assert ("refused" in got) == (not M.declared(key[0], key[1])), f"{where}: {got}"
                if "refused" in got:
                    assert got["why"] == one[key]["why"] and len(got["why"]) > 60, where  # a reason
                    continue
                want = one[key]["grads"]
                assert got["grads"].keys() == want.keys(), where
                for k, g in got["grads"].items():
                    if key[1] == "deterministic":
                        assert torch.equal(g, want[k]), f"{where}: {k} not bit for bit"
                        # and the same problem's meta-gradient: its tasks one by one, at 1
                        # process (BOIL's head, CAVIA's network and ANIL's body are read, not adapted;
                        # Reptile's displacement is summed over the task axis, ProtoNet's
                        # and ProtoMAML's class sums over the chunks)
                        loop = one[(key[0], "loop", key[2])]["grads"][k]
                        top = float(loop.abs().max())
                        assert float((g - loop).abs().max()) <= RTOL * max(top, 1.0), where
                    else:
                        top = float(want[k].abs().max())
                        assert float((g - want[k]).abs().max()) <= RTOL * max(top, 1.0), f"{where}: {k}"


def test_dropout_cells_draw(worlds):
    # The dropout cells' masks are keyed, not absent: each meta-gradient differs from its
    # algorithm's without dropout (a mask of p = 0.25 moves it by far more than 1e-6).
    one = worlds[1][0]
    for (algorithm, mode, layout), got in one.items():
        if mode == "dropout":
            # The same parameters in the same order (a Sequential's dropout shifts the names).
            plain = one[(algorithm, "loop", layout)]["grads"].values()
            moved = max(float((g - h).abs().max()) for g, h in zip(got["grads"].values(), plain, strict=True))
            assert moved > 1e-6, (algorithm, layout)


def test_a_hand_loop_over_clone_gives_meta_loss_s_meta_gradient(worlds):
    # Where the meta-gradient is the query loss's after the inner steps (not iMAML's implicit
    # one, Reptile's displacement or MAML++'s multi-step loss), the hand loop's is meta_loss's:
    # the same operations, summed in another order (float64 rounding, as RTOL says).
    one = worlds[1][0]
    for algorithm in ("maml", "fomaml", "metasgd", "anil", "boil", "cavia"):
        for layout in M.LAYOUTS:
            got, want = one[(algorithm, "clone", layout)]["grads"], one[(algorithm, "loop", layout)]["grads"]
            assert got.keys() == want.keys()
            for k, g in got.items():
                top = float(want[k].abs().max())
                assert float((g - want[k]).abs().max()) <= RTOL * max(top, 1.0), (algorithm, layout, k)


# The cells refused when the algorithm is built, each with the limit its reason names
# (docs/algorithms.md lists them): stacked tasks are MAML's own loss, and two rebuilt loops
# that the low memory mode lacks.
REFUSED = {
    ("anil", "stacked"): "ANIL's (the body once per task",
    ("reptile", "stacked"): "Reptile's displacement is a loss of its own",
    ("imaml", "stacked"): "iMAML's (a proximal loop",
    ("protonet", "stacked"): "class means, no inner step",
    ("protomaml", "stacked"): "a head started at each task's prototypes",
    ("mamlpp", "low"): "multi-step loss scores the query at every inner step",
    ("protomaml", "low"): "starts its head at the support's prototypes",
}


def test_the_refused_cells_are_the_declared_ones_with_their_reasons(worlds):
    one = worlds[1][0]
    refused = {(a, m) for (a, m, _), got in one.items() if "refused" in got}
    assert refused == set(REFUSED), sorted(refused)
    # At most 10 cells of the 88 do not run: these 7, and clone() for the 2 prototypical
    # networks, which have no inner step to take (their clone() says so).
    assert len(refused) + sum(not M.offered(a, "clone") for a in M.ALGORITHMS) <= 10
    for (a, m, layout), got in one.items():
        if (a, m) in REFUSED:
            assert got["refused"] == "built" and got["why"].startswith("ValueError: "), (a, m, layout)
            assert REFUSED[(a, m)] in got["why"], got["why"]
