"""Drawing characters from font files: which characters a font has, which alphabet each belongs
to, a clean rendering, and "drawers", each one rendering with its own font, stroke weight,
affine jitter and elastic distortion.

Every random number of a character's drawers comes from a generator seeded by
``(seed, code point)`` alone, so a character's drawings do not depend on which other characters
are drawn, or in which order.
"""

from __future__ import annotations

import math
import unicodedata
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

CANVAS = 64  # side of the canvas a glyph is drawn and distorted on, before the final resize
EM = 44  # font size on that canvas (a capital letter is about 32 pixels tall)
FIT = 0.8  # a glyph larger than this share of the canvas is scaled down to fit
ROTATION = 10.0  # degrees, either way
SCALE = (0.85, 1.1)  # per axis
SHEAR = 0.15
SHIFT = 0.08  # of the half-side, either way
ELASTIC = 0.035  # displacement of the elastic field's control points (half-side units)
ELASTIC_GRID = 5  # control points per side of the elastic field
STROKES = (0, 0, 1)  # 3x3 dilations at the canvas's resolution (about 1 pixel at 28x28)


def coverage(path: str) -> set[int]:
    """The code points a font file maps to a glyph (its best cmap)."""
    from fontTools.ttLib import TTFont  # type: ignore[import-untyped]

    with TTFont(path, lazy=True, fontNumber=0) as font:
        cmap = font.getBestCmap() or {}
    return set(cmap)


def eligible(cp: int) -> bool:
    """Whether code point ``cp`` is a character of its own: a letter, digit or symbol that is
    neither a modifier nor a composition (an accented letter, a ligature, a styled or enclosed
    variant of another character)."""
    ch = chr(cp)
    cat = unicodedata.category(ch)
    return (
        cat[0] in "LNS"
        and cat not in ("Lm", "Sk")
        and unicodedata.normalize("NFKC", ch) == ch
        and unicodedata.normalize("NFD", ch) == ch
    )


def alphabet(cp: int) -> str:
    """The alphabet of ``cp``: its Unicode script ("Greek", "Armenian") or, for characters
    shared by many scripts (symbols, digits), its Unicode block ("Arrows", "Braille Patterns")."""
    from fontTools import unicodedata as fu  # type: ignore[import-untyped]

    ch = chr(cp)
    script = fu.script(ch)
    if script in ("Zyyy", "Zinh", "Zzzz"):
        return str(fu.block(ch))
    return str(fu.script_name(script))


def load_font(path: str) -> Any:
    """A Pillow font at the drawing size, laid out without shaping (one character at a time,
    the same with or without libraqm)."""
    from PIL import ImageFont

    return ImageFont.truetype(path, EM, layout_engine=ImageFont.Layout.BASIC)


def clean(font: Any, ch: str) -> Tensor | None:
    """``ch`` drawn in ``font``, centred on a ``CANVAS`` square: ``[CANVAS, CANVAS]`` floats in
    [0, 1], ink 1. ``None`` if the font draws nothing for it."""
    from PIL import Image, ImageDraw

    left, top, right, bottom = font.getbbox(ch)
    w, h = right - left, bottom - top
    if w <= 0 or h <= 0:
        return None
    im = Image.new("L", (w + 2, h + 2), 0)
    ImageDraw.Draw(im).text((1 - left, 1 - top), ch, font=font, fill=255)
    box = im.getbbox()
    if box is None:
        return None
    im = im.crop(box)
    w, h = im.size
    scale = min(1.0, FIT * CANVAS / max(w, h))
    if scale < 1.0:
        w, h = max(1, round(w * scale)), max(1, round(h * scale))
        im = im.resize((w, h), Image.Resampling.LANCZOS)
    canvas = Image.new("L", (CANVAS, CANVAS), 0)
    canvas.paste(im, ((CANVAS - w) // 2, (CANVAS - h) // 2))
    data = torch.frombuffer(bytearray(canvas.tobytes()), dtype=torch.uint8)
    return data.view(CANVAS, CANVAS).float() / 255.0


def shrink(images: Tensor, size: int) -> Tensor:
    """``[n, 1, CANVAS, CANVAS]`` floats resized to ``size`` (antialiased) as ``uint8``."""
    small = F.interpolate(images, size=(size, size), mode="bilinear", antialias=True)
    return (small.clamp(0, 1) * 255).round().to(torch.uint8)


def uniform(n: int, low: float, high: float, g: torch.Generator) -> Tensor:
    return low + (high - low) * torch.rand(n, generator=g, dtype=torch.float64)


def distort(images: Tensor, g: torch.Generator) -> Tensor:
    """Each of ``images`` ``[n, 1, CANVAS, CANVAS]`` with its own stroke weight, affine jitter
    and elastic distortion, all drawn from ``g``."""
    n = images.shape[0]
    strokes = torch.tensor(STROKES)[torch.randint(len(STROKES), (n,), generator=g)]
    thick = [images]
    for _ in range(max(STROKES)):
        thick.append(F.max_pool2d(thick[-1], 3, stride=1, padding=1))
    images = torch.stack([thick[int(k)][i] for i, k in enumerate(strokes)])
    angle = uniform(n, -ROTATION, ROTATION, g) * math.pi / 180
    sx, sy = uniform(n, *SCALE, g), uniform(n, *SCALE, g)
    shear = uniform(n, -SHEAR, SHEAR, g)
    tx, ty = uniform(n, -SHIFT, SHIFT, g), uniform(n, -SHIFT, SHIFT, g)
    cos, sin = torch.cos(angle), torch.sin(angle)
    # Output point p samples the input at A p + t: A = R(angle) S(shear) diag(1/sx, 1/sy).
    a = torch.stack(
        [
            torch.stack([cos / sx, (cos * shear - sin) / sy, tx], -1),
            torch.stack([sin / sx, (sin * shear + cos) / sy, ty], -1),
        ],
        1,
    ).float()
    grid = F.affine_grid(a, [n, 1, CANVAS, CANVAS], align_corners=False)
    field = torch.randn(n, 2, ELASTIC_GRID, ELASTIC_GRID, generator=g) * ELASTIC
    field = F.interpolate(field, size=(CANVAS, CANVAS), mode="bicubic", align_corners=True)
    grid = grid + field.permute(0, 2, 3, 1)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
