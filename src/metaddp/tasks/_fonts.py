"""The font files a glyph benchmark is drawn from, and the identity of a set of them.

Two sources: the fonts matplotlib installs with itself (DejaVu, STIX, the Computer Modern
``cm*`` fonts), found wherever matplotlib is, and the system's fonts as
``matplotlib.font_manager.findSystemFonts`` lists them (for example Debian's fonts-noto-core;
never required). Files with the same content are one font. A font set's identity is the sorted
list ``file name:hash`` (the first 12 hex digits of the file's SHA-256): two machines with the
same identity draw the same glyphs.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

SOURCES = ("all", "matplotlib")
"""Which fonts a new glyph set uses: "all" (matplotlib's and the system's) or "matplotlib"."""

SUFFIXES = (".ttf", ".otf")
# Fonts that draw the same placeholder box for every code point of a block: never a glyph.
PLACEHOLDER_FONTS = ("LastResort",)


class FontSetError(ValueError):
    """The fonts a run recorded are not (all) on this machine, or a font set is unusable."""


@dataclasses.dataclass(frozen=True)
class FontFile:
    """One font file: its name, where it is and the start of its SHA-256."""

    name: str
    path: str
    digest: str

    @property
    def key(self) -> str:
        return f"{self.name}:{self.digest}"


def bundled_paths() -> list[Path]:
    """The font files matplotlib installs (its ``mpl-data/fonts``)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "the glyphs task draws its characters from matplotlib's fonts: "
            "pip install 'metaddp[train,images]'"
        ) from e
    root = Path(matplotlib.get_data_path()) / "fonts"
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in SUFFIXES)


def system_paths() -> list[Path]:
    """The system's TrueType and OpenType files (font collections ``.ttc`` are left out)."""
    from matplotlib import font_manager

    return sorted(
        Path(p) for p in font_manager.findSystemFonts() if Path(p).suffix.lower() in SUFFIXES
    )


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


def find(source: str = "all") -> list[FontFile]:
    """The fonts of ``source`` ("all" or "matplotlib"), one per content, sorted by key."""
    if source not in SOURCES:
        raise FontSetError(f"unknown font source {source!r}; choose from {', '.join(SOURCES)}")
    paths = bundled_paths() + (system_paths() if source == "all" else [])
    seen: dict[str, FontFile] = {}
    for p in paths:
        if any(p.name.startswith(bad) for bad in PLACEHOLDER_FONTS):
            continue
        try:
            d = digest(p)
        except OSError:  # a broken link or an unreadable file in a system folder
            continue
        seen.setdefault(d, FontFile(p.name, str(p), d))
    return sorted(seen.values(), key=lambda f: (f.key, f.path))


def identity(fonts: list[FontFile]) -> str:
    """The identity of a font set: ``name:hash`` of each font, sorted, comma-separated."""
    return ",".join(sorted(f.key for f in fonts))


def select(spec: str | None) -> list[FontFile]:
    """The fonts named by ``spec``: ``None`` or "all" (every font found), "matplotlib", or an
    identity a run recorded (exactly those fonts, each found by name and content).

    Raises:
        FontSetError: a recorded font is missing here or has other content.
    """
    if spec is None or spec in SOURCES:
        return find(spec or "all")
    wanted = [k for k in spec.split(",") if k]
    if not wanted or any(k.count(":") != 1 for k in wanted):
        raise FontSetError(
            f"fonts must be 'all', 'matplotlib' or a list of name:hash entries, got {spec[:60]!r}"
        )
    have = {f.key: f for f in find("all")}
    missing = [k for k in wanted if k not in have]
    if missing:
        names = {f.name for f in have.values()}
        changed = [k for k in missing if k.split(":")[0] in names]
        gone = [k for k in missing if k.split(":")[0] not in names]
        parts = []
        if gone:
            parts.append(
                f"{len(gone)} not found ({', '.join(gone[:3])}{'...' if len(gone) > 3 else ''})"
            )
        if changed:
            parts.append(
                f"{len(changed)} with other content here ({', '.join(changed[:3])}"
                f"{'...' if len(changed) > 3 else ''})"
            )
        raise FontSetError(
            f"the glyphs were drawn from {len(wanted)} font files of which {' and '.join(parts)} "
            "on this machine: install those fonts (the same versions), or start a new run, "
            "whose glyphs come from the fonts here"
        )
    return sorted((have[k] for k in wanted), key=lambda f: f.key)
