import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Spawned ranks inherit sys.path: they import tests/workers.py and examples/ from here.
for p in (os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)


import pytest  # noqa: E402 (after the path set-up that spawned ranks inherit)


@pytest.fixture(scope="session")
def worlds(tmp_path_factory):
    """Every rank's results of ``workers.everything`` at world sizes 1-4, one spawned process
    group per size, shared by the test files that check them (spawning costs seconds). One
    thread per process: deterministic mode's bits must not depend on a thread count that
    changes with the world size."""
    import workers
    from metaddp.distributed.launch import run_local

    root = tmp_path_factory.mktemp("worlds")
    out = {"root": root}
    for w in (1, 2, 3, 4):
        out[w] = run_local(workers.everything, w, str(root / f"w{w}"), threads=1)
    return out
