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


# The README's glyphs run (45 s on 2 cores) draws the glyph set of this machine's fonts the
# first time (30 s of one core; tests/test_glyphs.py checks the drawing itself on a few fonts).
# Both are slow checks: they run with METADDP_SLOW=1 (make verify). The session then draws the
# set from its start, at the lowest priority, on the core that the one-process tests leave
# idle; tests/test_docs.py waits for it (bounded) and runs the README's commands against it.
SLOW = os.environ.get("METADDP_SLOW") == "1"
GLYPHS: dict = {}


def pytest_sessionstart(session):
    import subprocess
    import tempfile

    if not SLOW or getattr(session.config, "workerinput", None) is not None or session.config.option.collectonly:
        return
    try:
        import PIL  # noqa: F401 (the glyphs need Pillow: without it, test_docs draws nothing)
    except ImportError:
        return
    cache = tempfile.mkdtemp(prefix="metaddp-glyphs-")
    draw = "from metaddp.tasks import _fonts, glyphs; glyphs.load(_fonts.select(None), show=False)"
    env = dict(os.environ, METADDP_CACHE=cache, OMP_NUM_THREADS="1")
    GLYPHS.update(cache=cache, process=subprocess.Popen(
        [sys.executable, "-c", draw], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=lambda: os.nice(19)))


def glyph_cache(timeout: float = 300.0) -> str | None:
    """The session's glyph cache folder once its drawing has ended (None if none was started);
    a drawing that fails or outlasts ``timeout`` seconds is an error naming why."""
    import subprocess

    if not GLYPHS:
        return None
    try:
        GLYPHS["process"].wait(timeout)
    except subprocess.TimeoutExpired:
        GLYPHS["process"].kill()
        raise RuntimeError(f"drawing the glyph set took over {timeout:.0f} s") from None
    if GLYPHS["process"].returncode != 0:
        raise RuntimeError(f"drawing the glyph set failed: {GLYPHS['process'].stderr.read().decode()[-2000:]}")
    return GLYPHS["cache"]


def pytest_sessionfinish(session):
    import shutil

    if GLYPHS:
        GLYPHS["process"].kill()
        GLYPHS["process"].wait()
        GLYPHS["process"].stderr.close()
        shutil.rmtree(GLYPHS["cache"], ignore_errors=True)
