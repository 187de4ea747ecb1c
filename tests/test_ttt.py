"""The ttt task family: windows of the standard library's source, a pure function of (seed,
split, index), held-out files never trained on, and its meta-gradient the same on 1 to 4
processes (the shared process groups of tests/conftest.py run ``workers.TTT_PROBLEM``)."""

from __future__ import annotations

import pytest
import torch

from metaddp.tasks import _stdlib
from metaddp.tasks.ttt import TTT

# Float64. Between world sizes only the order of floating-point sums changes (the dropout
# masks are the one-process masks); `metaddp verify --scenario ttt` measures at most 8e-16
# relative. 1e-12 leaves three orders of margin for what second derivatives through softmax
# and layer norm amplify; a mask keyed by a rank's own samples, or a shard weighed by its own
# count, moves the meta-gradient by more than 1e-3.
RTOL = 1e-12


def test_windows_are_pure_functions_of_seed_split_and_index_and_splits_are_disjoint():
    family = TTT(shots=3, query=2, hidden=16, chunk=16)
    a, b = family.task(1, 17), family.task(1, 17)
    assert torch.equal(a.support.x, b.support.x) and torch.equal(a.query.y, b.query.y)
    assert (a.support.x.shape, a.query.x.shape) == ((3, 16), (2, 16))
    for other in (family.task(2, 17), family.task(1, 18), family.task(1, 17, "test")):
        assert not torch.equal(a.support.x, other.support.x)
    # One window of 5 chunks: every target is the next input byte, across chunk boundaries,
    # and the 81 bytes are a passage of one training document.
    x, y = torch.cat([a.support.x, a.query.x]).flatten(), torch.cat([a.support.y, a.query.y]).flatten()
    assert torch.equal(x[1:], y[:-1])
    window = bytes(torch.cat([x[:1], y]).tolist())
    assert any(window in text for _, text in _stdlib.documents("train"))
    assert not any(window in text for _, text in _stdlib.documents("test"))
    train = {name for name, _ in _stdlib.documents("train")}
    test = {name for name, _ in _stdlib.documents("test")}
    assert not train & test and len(test) >= 10 and len(train) >= 4 * len(test) - 20
    assert train | test == {p.name for p in _stdlib.root().glob("*.py")}
    with pytest.raises(ValueError, match="lower shots, query or the chunk"):
        TTT(shots=10**6, query=1, hidden=16, chunk=16)


@pytest.mark.parametrize("world", (2, 3, 4))
def test_ttt_meta_gradient_is_the_one_process_one(worlds, world):
    one = worlds[1][0]["ttt"]
    for rank in worlds[world]:  # every rank holds the global meta-gradient
        got = rank["ttt"]
        scale = max(float(g.abs().max()) for g in one["grads"].values())
        assert set(got["grads"]) == set(one["grads"])
        diff = max(float((got["grads"][k] - one["grads"][k]).abs().max()) for k in one["grads"])
        assert diff / scale < RTOL
        assert got["loss"] == pytest.approx(one["loss"], rel=RTOL)
    # The meta-gradient reaches the body (through the features) as well as the adapted head.
    assert {k.split(".")[0] for k in one["grads"]} == {"body", "head"}
    assert 3 < one["loss"] < 12  # bits per byte of an untrained byte model: near log2(256) = 8
