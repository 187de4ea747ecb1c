"""An Omniglot-like few-shot benchmark drawn from the font files on this machine (no download).

As in Omniglot (Lake et al. 2015), characters are grouped in alphabets, every character is a
class with 20 drawings by 20 "drawers", and the alphabets are split into a background set
(meta-training) and an evaluation set (meta-testing) that share no alphabet. Here an alphabet is
a Unicode script (Greek, Armenian, Canadian Aboriginal syllabics ...) or, for characters shared
by many scripts, a Unicode block (Arrows, Braille patterns ...); a drawer is a rendering with its
own font, stroke weight, affine jitter and elastic distortion (after OmniPrint, Sun et al. 2021,
and Synbols, Lacoste et al. 2020, which draw few-shot benchmarks from fonts).

What is kept: characters of their own (letters, digits, symbols; no accented or styled variant of
another one) that at least 3 font files draw; one of each group of characters that look alike in
a font (Latin "A", Greek "Α" and Cyrillic "А" are one class, the lowest code point's); at most 55
characters an alphabet (chosen by the seed) and at least 14, Omniglot's range. 40% of the
alphabets (chosen by the seed) are held out for evaluation. Images are 28x28, ink 1 and paper 0.

The glyph set is a function of (seed, font set) alone. It is drawn once (a minute or two, with a
progress bar) into a cache folder (``--data``, else ``$METADDP_CACHE/glyphs``, else
``~/.cache/metaddp/glyphs``) and loaded from there in about a second. Needs Pillow and matplotlib
(the ``images`` and ``train`` extras).
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from . import _fonts, _render
from ._fewshot import FewShotImages, rotations

VERSION = 1  # of the drawing procedure; a change makes a new cache file
SEED = 0  # the glyph set's seed (alphabet split, characters kept, drawers)
SIZE = 28
DRAWERS = 20
MIN_FONTS = 3
MIN_CHARS = 14
MAX_CHARS = 55
EVAL_SHARE = 0.4
# Two characters whose clean drawings in one font have a cosine similarity above this are one
# class: identical outlines (Latin/Greek/Cyrillic capitals) reach 0.99-1.0, while distinct
# characters of one font that differ in a stroke ("O"/"Q", "E"/"F") stay below 0.95.
ALIKE = 0.95
T = TypeVar("T")


def cache_folder(data: str | Path | None = None) -> Path:
    """Where glyph sets are cached: ``data``, else ``$METADDP_CACHE/glyphs``, else
    ``$XDG_CACHE_HOME/metaddp/glyphs`` (``~/.cache/metaddp/glyphs``)."""
    if data is not None:
        return Path(data)
    if os.environ.get("METADDP_CACHE"):
        return Path(os.environ["METADDP_CACHE"]) / "glyphs"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "metaddp" / "glyphs"


def cache_name(fonts: str, seed: int) -> str:
    key = f"{VERSION}|{seed}|{SIZE}|{DRAWERS}|{fonts}"
    return f"glyphs-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def rank_of(seed: int, text: str) -> str:
    """A seeded, machine-independent sort key (for choosing characters and alphabets)."""
    return hashlib.sha256(f"{seed}|{text}".encode()).hexdigest()


def progress(items: Iterable[T], total: int, desc: str, enabled: bool) -> Iterable[T]:
    """``items``, counted by a tqdm bar on stderr when tqdm is installed and ``enabled``."""
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"{desc} ...", file=sys.stderr)
        return items
    return tqdm(items, total=total, desc=desc, unit="item", dynamic_ncols=True, leave=False)


def distinct(renders: dict[int, dict[int, torch.Tensor]], fonts: int) -> set[int]:
    """The code points kept from ``renders`` (code point -> font index -> ``[SIZE, SIZE]``
    uint8 drawing): in every group of characters that look alike in some font (cosine
    similarity above ``ALIKE``), the lowest code point."""
    parent = {cp: cp for cp in renders}

    def root(cp: int) -> int:
        while parent[cp] != cp:
            parent[cp] = parent[parent[cp]]
            cp = parent[cp]
        return cp

    for f in range(fonts):
        cps = sorted(cp for cp, by in renders.items() if f in by)
        if len(cps) < 2:
            continue
        x = torch.stack([renders[cp][f].flatten().float() for cp in cps])
        x = x / x.norm(dim=1, keepdim=True)
        sim = torch.triu(x @ x.T, diagonal=1)
        for i, j in (sim > ALIKE).nonzero().tolist():
            a, b = root(cps[i]), root(cps[j])
            if a != b:
                parent[max(a, b)] = min(a, b)
    return {cp for cp in renders if root(cp) == cp}


def covering(paths: list[str]) -> dict[int, list[int]]:
    """Per code point, the indices of the fonts of ``paths`` that map it to a glyph."""
    covered: dict[int, list[int]] = {}
    for i, p in enumerate(paths):
        try:
            cps = _render.coverage(p)
        except Exception:  # a font fontTools cannot read is no font of this set
            continue
        for cp in cps:
            covered.setdefault(cp, []).append(i)
    return covered


def clean_drawings(
    fonts: dict[int, Any], candidates: dict[int, list[int]], show: bool
) -> dict[int, dict[int, torch.Tensor]]:
    """Per candidate code point, its clean ``[SIZE, SIZE]`` uint8 drawing in each font that
    draws it with some ink; code points drawn by fewer than ``MIN_FONTS`` fonts are left out."""
    renders: dict[int, dict[int, torch.Tensor]] = {cp: {} for cp in candidates}
    for i, font in progress(fonts.items(), len(fonts), "glyphs: reading fonts", show):
        cps = sorted(cp for cp, fs in candidates.items() if i in fs)
        drawn = [(cp, _render.clean(font, chr(cp))) for cp in cps]
        inked = [(cp, d) for cp, d in drawn if d is not None]
        if inked:
            small = _render.shrink(torch.stack([d for _, d in inked]).unsqueeze(1), SIZE)
            for (cp, _), s in zip(inked, small, strict=True):
                if int(s.max()) > 127:  # some ink, not a blank or hairline glyph
                    renders[cp][i] = s[0]
    return {cp: by for cp, by in renders.items() if len(by) >= MIN_FONTS}


def choose(kept: set[int], seed: int) -> dict[str, list[int]]:
    """The alphabets of the ``kept`` code points with at least ``MIN_CHARS`` characters, each
    cut to ``MAX_CHARS`` characters chosen by ``seed``."""
    by_alphabet: dict[str, list[int]] = {}
    for cp in sorted(kept):
        by_alphabet.setdefault(_render.alphabet(cp), []).append(cp)
    chosen: dict[str, list[int]] = {}
    for name, members in by_alphabet.items():
        if len(members) >= MIN_CHARS:
            pick = sorted(members, key=lambda cp: rank_of(seed, f"char {cp}"))[:MAX_CHARS]
            chosen[name] = sorted(pick)
    return chosen


def draw(
    cp: int, usable: list[int], fonts: dict[int, Any], seed: int
) -> tuple[torch.Tensor, list[int]]:
    """The ``DRAWERS`` drawings of code point ``cp`` (``uint8 [DRAWERS, 1, SIZE, SIZE]``) and
    the font of each: drawer ``d`` uses the ``d``-th font of a seeded order of ``usable`` (round
    robin), with its own stroke, jitter and distortion."""
    g = torch.Generator().manual_seed(int(rank_of(seed, f"drawers {cp}")[:15], 16))
    order = torch.randperm(len(usable), generator=g).tolist()
    picks = [usable[order[d % len(usable)]] for d in range(DRAWERS)]
    base = []
    for f in picks:
        d = _render.clean(fonts[f], chr(cp))
        assert d is not None  # drawn with ink by clean_drawings
        base.append(d)
    return _render.shrink(_render.distort(torch.stack(base).unsqueeze(1), g), SIZE), picks


def build(fonts: list[_fonts.FontFile], seed: int = SEED, show: bool = True) -> dict[str, Any]:
    """Draw the glyph set of ``fonts`` for ``seed`` (see the module's description).

    Returns:
        ``images`` (``uint8 [characters, DRAWERS, 1, SIZE, SIZE]``), ``chars`` (code points),
        ``alphabet`` (per character, an index into ``alphabets``), ``alphabets`` (names),
        ``evaluation`` (the held-out alphabets' names), ``drawer_font`` (per character and
        drawer, an index into ``font_keys``), ``font_keys`` and ``fonts`` (the identity).
    """
    paths = [f.path for f in fonts]
    candidates = {
        cp: fs
        for cp, fs in covering(paths).items()
        if len(fs) >= MIN_FONTS and _render.eligible(cp)
    }
    loaded = {i: _render.load_font(p) for i, p in enumerate(paths)}
    renders = clean_drawings(loaded, candidates, show)
    chosen = choose(distinct(renders, len(paths)), seed)
    alphabets = sorted(chosen)
    if len(alphabets) < 2:
        raise _fonts.FontSetError(
            f"the fonts found draw {len(alphabets)} alphabet(s) of at least {MIN_CHARS} "
            "characters; at least two are needed (one to train on, one to test)"
        )
    order = sorted(alphabets, key=lambda a: rank_of(seed, f"alphabet {a}"))
    evaluation = sorted(order[: max(1, round(EVAL_SHARE * len(order)))])
    chars = [cp for a in alphabets for cp in chosen[a]]
    images = torch.empty(len(chars), DRAWERS, 1, SIZE, SIZE, dtype=torch.uint8)
    drawer_font = torch.empty(len(chars), DRAWERS, dtype=torch.long)
    for c, cp in progress(enumerate(chars), len(chars), "glyphs: drawing characters", show):
        images[c], picks = draw(cp, sorted(renders[cp]), loaded, seed)
        drawer_font[c] = torch.tensor(picks)
    index = {a: i for i, a in enumerate(alphabets)}
    return {
        "version": VERSION,
        "seed": seed,
        "images": images,
        "chars": chars,
        "alphabet": [index[_render.alphabet(cp)] for cp in chars],
        "alphabets": alphabets,
        "evaluation": evaluation,
        "drawer_font": drawer_font,
        "font_keys": [f.key for f in fonts],
        "fonts": _fonts.identity(fonts),
    }


def load(
    fonts: list[_fonts.FontFile],
    data: str | Path | None = None,
    seed: int = SEED,
    show: bool = True,
) -> dict[str, Any]:
    """The glyph set of ``fonts`` and ``seed``: read from the cache folder, or drawn and
    written there first (atomically: a reader never sees half a file)."""
    from .._output import atomic_write

    identity = _fonts.identity(fonts)
    path = cache_folder(data) / cache_name(identity, seed)
    if path.is_file():
        try:
            glyphs = torch.load(path, weights_only=True)
            if glyphs.get("fonts") == identity and glyphs.get("version") == VERSION:
                return glyphs
            warnings.warn(f"{path} holds another glyph set; drawing it again", stacklevel=2)
        except Exception as e:  # a damaged cache file is drawn again
            warnings.warn(
                f"cannot read the glyph cache {path} ({e}); drawing it again", stacklevel=2
            )
    glyphs = build(fonts, seed, show)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save(glyphs, f))
    except OSError as e:
        warnings.warn(
            f"cannot write the glyph cache {path} ({e}); it is drawn again next time", stacklevel=2
        )
    return glyphs


def pools(glyphs: dict[str, Any], rotate: bool) -> dict[str, list[torch.Tensor]]:
    """Per split, the classes of a glyph set: background alphabets for "train" (with their
    rotations by 90, 180 and 270 degrees as more classes, when ``rotate``), evaluation alphabets
    for "test" (upright)."""
    held = {glyphs["alphabets"].index(a) for a in glyphs["evaluation"]}
    images = glyphs["images"]
    out: dict[str, list[torch.Tensor]] = {"train": [], "test": []}
    for c, a in enumerate(glyphs["alphabet"]):
        if a in held:
            out["test"].append(images[c])
        else:
            out["train"] += rotations(images[c], rotate)
    return out


def alphabet_sizes(glyphs: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per split ("train": background, "test": evaluation), alphabet -> characters."""
    out: dict[str, dict[str, int]] = {"train": {}, "test": {}}
    for a in glyphs["alphabet"]:
        name = glyphs["alphabets"][a]
        split = "test" if name in glyphs["evaluation"] else "train"
        out[split][name] = out[split].get(name, 0) + 1
    return out


class Glyphs(FewShotImages):
    """N-way K-shot classification of characters drawn from fonts; alphabets split as above.

    Args:
        root: the cache folder (``None``: the default, see :func:`cache_folder`).
        fonts: "all" (``None``), "matplotlib", or a font set's identity (as a run records it).
        rotate: add the rotations of every background character as classes.
        seed: the glyph set's seed (not the run's: the benchmark stays the same across runs).
        progress: show a progress bar while drawing.
    """

    name: ClassVar[str] = "glyphs"
    data_option: ClassVar[bool] = True
    defaults: ClassVar[dict[str, Any]] = dict(FewShotImages.defaults, hidden=64, query=5)

    @classmethod
    def font_set(cls, spec: str | None) -> str | None:
        return _fonts.identity(_fonts.select(spec))

    def __init__(
        self,
        root: str | Path | None = None,
        ways: int = 5,
        shots: int = 1,
        query: int = 5,
        hidden: int = 64,
        norm: str = "batch",
        fonts: str | None = None,
        rotate: bool = True,
        seed: int = SEED,
        progress: bool = True,
    ) -> None:
        self.root, self.rotate, self.seed = root, bool(rotate), int(seed)
        self.glyphs = load(_fonts.select(fonts), root, self.seed, progress)
        self.fonts = self.glyphs["fonts"]
        self.alphabets = alphabet_sizes(self.glyphs)
        super().__init__(
            pools(self.glyphs, self.rotate),
            ways=ways,
            shots=shots,
            query=query,
            hidden=hidden,
            norm=norm,
        )

    def describe(self) -> dict[str, Any]:
        return dict(super().describe(), rotate=self.rotate, glyph_seed=self.seed, fonts=self.fonts)
