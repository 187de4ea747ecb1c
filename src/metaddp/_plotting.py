"""matplotlib, when it is installed (the ``train`` extra), drawing to files only."""

from __future__ import annotations

from typing import Any


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
