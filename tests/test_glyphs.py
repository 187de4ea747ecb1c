"""The glyphs benchmark: drawn from fonts, deterministic, cached, its font set recorded.

To stay fast the glyph set here is drawn from three of matplotlib's fonts and only from the
capital Latin and Cyrillic letters (about 50 characters, two alphabets).
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("matplotlib")

from metaddp.tasks import FontSetError, _fonts, _render, glyphs  # noqa: E402
from metaddp.train import TrainConfig  # noqa: E402

NAMES = ("DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf")
LETTERS = set(range(0x41, 0x5B)) | set(range(0x410, 0x430))  # Latin A-Z, Cyrillic А-Я


@pytest.fixture(scope="module")
def few(tmp_path_factory):
    """(fonts, glyph set, cache folder) for the three fonts and the letters above."""
    fonts = [f for f in _fonts.find("matplotlib") if f.name in NAMES]
    assert len(fonts) == 3
    mp = pytest.MonkeyPatch()
    real = _render.coverage
    mp.setattr(_render, "coverage", lambda path: real(path) & LETTERS)
    folder = tmp_path_factory.mktemp("glyphs")
    t0 = time.perf_counter()
    data = glyphs.load(fonts, folder, show=False)
    built = time.perf_counter() - t0
    yield fonts, data, folder, built, mp
    mp.undo()


def test_alphabets_characters_and_lookalikes(few):
    fonts, g, _, _, _ = few
    chars = set(g["chars"])
    assert g["alphabets"] == ["Cyrillic", "Latin"]
    # One alphabet of two held out (at least one); the seed chose it.
    assert len(g["evaluation"]) == 1 and g["evaluation"][0] in g["alphabets"]
    # Latin A and the Cyrillic А drawn alike are one class, the lower code point's ...
    assert 0x41 in chars and 0x410 not in chars and 0x421 not in chars  # А, С
    # ... while the Cyrillic letters of their own stay.
    assert {0x416, 0x42F, 0x414} <= chars  # Ж, Я, Д
    sizes = {a: g["alphabet"].count(i) for i, a in enumerate(g["alphabets"])}
    # All 26 Latin capitals: none is drawn like another in these fonts.
    assert sizes["Latin"] == 26
    assert all(glyphs.MIN_CHARS <= n <= glyphs.MAX_CHARS for n in sizes.values())
    assert g["images"].shape == (len(g["chars"]), glyphs.DRAWERS, 1, 28, 28)
    assert g["images"].dtype == torch.uint8
    assert g["fonts"] == _fonts.identity(fonts)


def test_drawers_differ_and_are_a_function_of_seed_and_character(few):
    fonts, g, _, _, _ = few
    loaded = {i: _render.load_font(f.path) for i, f in enumerate(fonts)}
    c = g["chars"].index(0x416)
    images = g["images"][c].float()
    # Every drawing has ink, and no two drawers of a character draw the same image.
    assert (images.flatten(1).amax(1) > 200).all()
    diffs = torch.cdist(images.flatten(1), images.flatten(1))
    assert diffs[~torch.eye(glyphs.DRAWERS, dtype=torch.bool)].min() > 100
    # Each of the three fonts draws some of the 20 drawers (round robin).
    assert set(g["drawer_font"][c].tolist()) == {0, 1, 2}
    # Drawn again alone, out of order: the same bytes (nothing depends on the other characters).
    again, picks = glyphs.draw(0x416, [0, 1, 2], loaded, glyphs.SEED)
    assert torch.equal(again, g["images"][c]) and picks == g["drawer_font"][c].tolist()
    other, _ = glyphs.draw(0x416, [0, 1, 2], loaded, glyphs.SEED + 1)
    assert not torch.equal(other, g["images"][c])


def test_cache_is_read_back_fast_and_the_family_splits_by_alphabet(few):
    fonts, g, folder, built, _ = few
    files = list(folder.glob("glyphs-*.pt"))
    assert len(files) == 1
    t0 = time.perf_counter()
    fam = glyphs.Glyphs(
        folder, fonts=_fonts.identity(fonts), ways=3, shots=1, query=2, hidden=8, progress=False
    )
    loaded = time.perf_counter() - t0
    assert torch.equal(fam.glyphs["images"], g["images"])
    # Reading the cache is at least 5x faster than drawing (measured ~50x; 5x allows a slow,
    # shared machine).
    assert loaded < built / 5, (loaded, built)
    held = g["evaluation"][0]
    n_held = fam.alphabets["test"][held]
    assert fam.alphabets["test"] == {held: n_held}
    assert len(fam.pools["test"]) == n_held
    # Background characters come with their three rotations.
    assert len(fam.pools["train"]) == 4 * (len(g["chars"]) - n_held)
    task = fam.task(0, 0, "test")
    assert task.support.x.shape == (3, 1, 28, 28) and task.support.x.dtype == torch.float32
    assert 0.0 <= float(task.support.x.min()) and float(task.support.x.max()) <= 1.0
    assert fam.describe()["fonts"] == _fonts.identity(fonts)


def test_font_identity_is_recorded_and_checked(few, monkeypatch):
    fonts, _, folder, _, _ = few
    ident = _fonts.identity(fonts)
    assert ident == ",".join(sorted(f"{f.name}:{f.digest}" for f in fonts))
    assert [f.key for f in _fonts.select(ident)] == [f.key for f in fonts]
    # A new run records the identity of the fonts found ...
    cfg = TrainConfig(task="glyphs", fonts="matplotlib", data=str(folder)).resolved()
    assert cfg.fonts == _fonts.identity(_fonts.find("matplotlib"))
    assert cfg.norm == "batch" and cfg.identity()["fonts"] == cfg.fonts
    # ... and a resumed one whose fonts are gone, or changed, says which.
    name = fonts[0].name
    with pytest.raises(FontSetError, match=r"1 with other content here \(DejaVuSans"):
        TrainConfig(task="glyphs", fonts=ident.replace(fonts[0].digest, "0" * 12)).resolved()
    with pytest.raises(FontSetError, match="1 not found .Gone.ttf:"):
        TrainConfig(task="glyphs", fonts=ident + ",Gone.ttf:123456789abc").resolved()
    with pytest.raises(FontSetError, match="name:hash entries"):
        TrainConfig(task="glyphs", fonts="DejaVu").resolved()
    assert name in ident
    with pytest.raises(ValueError, match="fonts is a setting of the glyphs task, not of digits"):
        TrainConfig(task="digits", fonts="all").resolved()
    with pytest.raises(ValueError, match="norm is a setting of the image tasks, not of sinusoid"):
        TrainConfig(task="sinusoid", norm="batch").resolved()
    with pytest.raises(ValueError, match="unknown norm 'layer'; choose from batch, none"):
        TrainConfig(task="digits", norm="layer").resolved()


def test_a_damaged_cache_is_drawn_again(few, tmp_path, monkeypatch):
    fonts, g, folder, _, _ = few
    (path,) = folder.glob("glyphs-*.pt")
    (tmp_path / path.name).write_bytes(b"not a cache")
    drawn = []
    monkeypatch.setattr(glyphs, "build", lambda *a: drawn.append(a) or g)  # drawn above
    with pytest.warns(UserWarning, match="cannot read the glyph cache"):
        again = glyphs.load(fonts, tmp_path, show=False)
    assert len(drawn) == 1 and again is g
    # Written back whole: the next load reads it.
    assert torch.equal(glyphs.load(fonts, tmp_path, show=False)["images"], g["images"])
    assert len(drawn) == 1
