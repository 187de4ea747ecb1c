"""Training faults: a diverging run stops at the failing step, names the likely cause and keeps
the last good checkpoint; a stop signal ends the step on every rank and checkpoints; a
checkpoint whose bytes changed, or that is missing, is passed over for the one before, in one
warning."""

from __future__ import annotations

import dataclasses
import math
import shutil
import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from metaddp import train as _train
from metaddp.train import TrainConfig, _checkpoint
from metaddp.train._folder import RunFolderError, check_folder
from metaddp.train._metrics import read
from metaddp.train._trainer import NonFiniteError
from workers import train as trained  # a run in a folder; its start step and final weights

CFG = TrainConfig(task="sinusoid", steps=6, meta_batch=4, shots=5, query=5, hidden=8,
                  eval_every=0, eval_tasks=4, checkpoint_every=2).resolved()


def run(cfg: TrainConfig, out: Path) -> str:
    _train.prepare_folder(out, cfg, False, force=False)
    try:
        _train.train(cfg, out, progress=False)
    except NonFiniteError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("setting,value,cause", [
    ("outer_lr", 1e30, "lower the outer learning rate (--outer-lr 1e+30)"),
    ("inner_lr", 1e6, "lower the inner learning rate (--inner-lr 1e+06)"),
])
def test_a_diverging_run_stops_at_once_and_names_the_cause(tmp_path, setting, value, cause):
    cfg = dataclasses.replace(CFG, **{setting: value})
    msg = run(cfg, tmp_path)
    assert msg.startswith("training stopped at step "), msg
    assert cause in msg, msg
    step = int(msg.split("step ")[1].split(":")[0])
    rows = read(tmp_path / "metrics.csv")
    # Every row written is a finite step before the failing one; none is a NaN row.
    assert [int(r["step"]) for r in rows] == list(range(1, step))
    assert all(math.isfinite(r["meta_loss"]) for r in rows)
    if step > 2:  # a checkpoint was due at step 2: it holds finite weights
        state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
        assert f"the last checkpoint holds step {state['step']}" in msg
        assert all(bool(torch.isfinite(v).all()) for v in state["model"].values())
    assert not (tmp_path / "summary.json").exists()  # no summary, no plot of a broken run


def test_the_divergence_advice_works_as_printed(tmp_path, capsys):
    """The message says how to try again; doing exactly that (the setting changed, --force,
    the same folder, a path with a space) trains."""
    from metaddp.cli import main

    out = tmp_path / "a run"
    common = ["train", "sinusoid", "--steps", "4", "--meta-batch", "2", "--shots", "4", "--query", "3",
              "--hidden", "8", "--eval-every", "0", "--eval-tasks", "2", "--checkpoint-every", "2",
              "--no-progress", "--out", str(out)]
    assert main([*common, "--outer-lr", "1e30"]) == 3
    err = capsys.readouterr().err
    assert "run the same command with the setting changed and --force" in err, err
    assert f"'{out}'" in err  # quoted: it has a space
    assert main([*common, "--outer-lr", "0.001", "--force"]) == 0


def test_the_divergence_advice_never_deletes_a_checkpoint(tmp_path):
    """With a checkpoint in the folder, the advice keeps it: another --out, or --resume; a new
    run into the folder is refused with the same care."""
    msg = run(dataclasses.replace(CFG, outer_lr=1e30, checkpoint_every=1), tmp_path)
    assert msg.startswith("training stopped at step 2:"), msg
    assert "the last checkpoint holds step 1" in msg, msg
    assert "--force" not in msg, msg
    assert "run the same command with another --out" in msg and f"--resume {tmp_path}" in msg, msg
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 1
    with pytest.raises(RunFolderError) as e:
        check_folder(tmp_path, resume=False, force=False)
    assert f"Continue that run with --resume {tmp_path}" in str(e.value)
    assert "--force would replace it, deleting its checkpoints" in str(e.value)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict]:
    """CFG's six steps, uninterrupted: the folder (checkpoints at steps 6, 4 and 2) and the
    final weights."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    return out, trained(CFG, str(out), False)["weights"]


def flip_a_bit(path: Path, tensor: torch.Tensor) -> None:
    """Flip a bit of ``tensor`` where the file ``path`` stores it. torch.save writes a zip whose
    entries ``archive/data/N`` hold each storage's bytes, uncompressed: found by its bytes."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        (entry,) = [i for i in z.infolist() if z.read(i) == tensor.numpy().tobytes()]
    # The entry's bytes follow its local header (30 bytes, the name, an extra field).
    name, extra = struct.unpack("<HH", raw[entry.header_offset + 26 : entry.header_offset + 30])
    start = entry.header_offset + 30 + name + extra
    assert raw[start : start + entry.file_size] == tensor.numpy().tobytes()
    # The second element's top mantissa bit (float32, little-endian): the value changes by up
    # to half, and stays a finite number that nothing but a checksum would notice.
    raw[start + 4 + 2] ^= 0x40
    path.write_bytes(bytes(raw))


def resumed(out: Path) -> tuple[dict, list[str]]:
    """The run in ``out`` resumed to CFG's last step; the warnings about checkpoints."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = trained(CFG, str(out), True)
    return result, [str(w.message) for w in seen if "checkpoint" in str(w.message)]


def test_a_flipped_bit_in_a_weight_falls_back_and_ends_as_if_uninterrupted(uninterrupted, tmp_path):
    full, weights = uninterrupted
    out = shutil.copytree(full, tmp_path / "run")
    newest = torch.load(out / "checkpoint.pt", weights_only=True)
    flip_a_bit(out / "checkpoint.pt", newest["model"]["model.0.weight"])
    changed = torch.load(out / "checkpoint.pt", weights_only=True)["model"]["model.0.weight"]
    assert torch.isfinite(changed).all() and not torch.equal(changed, newest["model"]["model.0.weight"])
    result, said = resumed(out)
    assert said == [f"checkpoint {out / 'checkpoint.pt'} fails its checksum (model/model.0.weight): its bytes "
                    "changed after it was written; resuming from checkpoint.1.pt (step 4)"], said
    assert result["start"] == 4
    # Steps 5 and 6 again, from step 4's weights and Adam state, on the same process: the
    # same bits as the run that never stopped.
    assert weights.keys() == result["weights"].keys()
    assert all(torch.equal(weights[k], result["weights"][k]) for k in weights)


def test_a_missing_checkpoint_is_said_with_the_one_resumed_from(uninterrupted, tmp_path):
    full, weights = uninterrupted
    out = shutil.copytree(full, tmp_path / "run")
    (out / "checkpoint.pt").unlink()  # as a crash between the renames of a save leaves it
    result, said = resumed(out)
    assert said == [f"{out / 'checkpoint.pt'} is missing; resuming from checkpoint.1.pt (step 4)"], said
    assert result["start"] == 4 and all(torch.equal(weights[k], result["weights"][k]) for k in weights)


def test_a_checkpoint_proves_everything_it_holds_and_old_ones_still_load(tmp_path):
    path = tmp_path / "checkpoint.pt"
    _checkpoint.save(path, step=2, config={"seed": 1}, model={"w": torch.ones(3)},
                     optimizer={"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": []},
                     metrics=torch.zeros(2, 3))
    state = torch.load(path, weights_only=True)
    assert state["format"] == "metaddp-checkpoint-2"
    assert set(state["checksums"]) == {"(structure)", "model/w", "optimizer/state/0/step", "metrics"}
    # Every part is covered: a tensor of the optimizer's, the metrics, a number outside tensors.
    for key, change, failed in [
        ("optimizer", {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}, "optimizer/state/0/step"),
        ("metrics", torch.ones(2, 3), "metrics"),
        ("step", 3, "everything but the tensors"),
    ]:
        torch.save({**state, key: change}, path)
        with pytest.raises(_checkpoint.CorruptCheckpoint, match=rf"fails its checksum \({failed}\)"):
            _checkpoint.load(path, {"seed": 1})
    without = {k: v for k, v in state.items() if k != "checksums"}
    torch.save({**without, "format": "metaddp-checkpoint-1"}, path)  # written before checksums
    assert _checkpoint.load(path, {"seed": 1})["step"] == 2
    torch.save(without, path)
    with pytest.raises(_checkpoint.CorruptCheckpoint, match="has lost its checksums"):
        _checkpoint.load(path, {"seed": 1})
    # A flipped bit that changes what the file reads back as, not only its values (here a
    # checksum recorded under a key of another type, as a flipped storage type reads back):
    # corrupt, as any other, so load_latest falls back on it (it raised a TypeError).
    torch.save({**state, "checksums": {**state["checksums"], 1: 0}}, path)
    with pytest.raises(_checkpoint.CorruptCheckpoint, match="no longer reads as it was written"):
        _checkpoint.load(path, {"seed": 1})
