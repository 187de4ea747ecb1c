"""``metaddp data``: the counts of a dataset folder, a PNG of its tasks, one-line errors."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")
pytest.importorskip("matplotlib")

from metaddp.cli import main  # noqa: E402
from test_image_data import official_omniglot  # noqa: E402


def test_data_shows_alphabets_classes_and_draws_tasks(tmp_path, capsys):
    root = official_omniglot(tmp_path / "omniglot")
    png = tmp_path / "tasks.png"
    code = main(
        ["data", "omniglot", "--data", str(root), "--ways", "2", "--shots", "2", "--query", "3",
         "--tasks", "2", "--out", str(png)]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines() == [
        "omniglot: 1x28x28 images",
        "  train: 12 classes, 20 examples per class; 2 alphabets, 3 characters",
        "    Alphabet_of_the_Magi: 2",
        "    Korean: 1",
        "  test: 8 classes, 20 examples per class; 1 alphabets, 2 characters",
        "    Angelic: 2",
        f"  tasks drawn: {png}",
    ]
    from PIL import Image

    with Image.open(png) as im:
        # Two tasks of 2 + 3 images a row, two rows: wider than tall.
        assert im.format == "PNG" and im.size[0] > 2 * im.size[1]


def test_data_errors_are_one_line(tmp_path, capsys):
    assert main(["data", "omniglot", "--data", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("metaddp data: error: dataset folder") and err.count("\n") == 1
    assert main(["data", "miniimagenet"]) == 2
    assert "needs --data FOLDER" in capsys.readouterr().err
    root = official_omniglot(tmp_path / "omniglot")
    assert main(["data", "omniglot", "--data", str(root), "--ways", "9", "--tasks", "1"]) == 2
    assert "has 8 classes, fewer than ways=9" in capsys.readouterr().err


def test_data_out_names_the_file_it_writes(tmp_path, capsys):
    root = official_omniglot(tmp_path / "omniglot")
    small = ["data", "omniglot", "--data", str(root), "--ways", "2", "--shots", "1", "--query",
             "1", "--tasks", "1"]
    folder = tmp_path / "pictures"
    folder.mkdir()
    assert main([*small, "--out", str(folder)]) == 0  # a folder: its grid.png
    assert capsys.readouterr().out.splitlines()[-1] == f"  tasks drawn: {folder / 'grid.png'}"
    assert (folder / "grid.png").stat().st_size > 1000
    for bad in ("noext", "grid.txt"):
        assert main([*small, "--out", str(tmp_path / bad)]) == 2
        assert "--out must name a .png file" in capsys.readouterr().err
        assert not list(tmp_path.glob(bad.split(".")[0] + "*"))


def test_data_refuses_a_folder_for_a_task_that_reads_none(tmp_path, capsys):
    pytest.importorskip("sklearn")
    assert main(["data", "digits", "--data", str(tmp_path)]) == 2
    assert "the digits task reads no dataset: drop --data" in capsys.readouterr().err


def test_data_draws_at_most_a_picture_of_tasks(capsys):
    assert main(["data", "digits", "--tasks", "100000"]) == 2
    assert "--tasks must be between 1 and 20" in capsys.readouterr().err
