"""Output files: written whole or not at all, and figures through matplotlib when it is
installed (the ``train`` extra), drawing to files only."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def quoted(path: object) -> str:
    """A path as a shell reads it back (``shlex.quote``): printed commands run as printed."""
    import shlex

    return shlex.quote(str(path))


def umask() -> int:
    """The process's umask (read by setting it, and at once setting it back)."""
    old = os.umask(0)
    os.umask(old)
    return old


def atomic_write(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, then rename it over ``path``.

    ``os.replace`` is atomic on POSIX and Windows: a reader (or a crash) sees the old file or
    the new one, never half of one. The file gets the permissions of any new file
    (``0o666`` less the umask), not the private ``0o600`` of a temporary one.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.chmod(tmp, 0o666 & ~umask())
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def available() -> bool:
    """Whether matplotlib can be imported (figures are skipped without it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("figures need matplotlib: pip install 'metaddp[train]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
