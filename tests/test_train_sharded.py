"""``metaddp train --shard``: sharded runs follow the replicated trajectory, and their sharded
checkpoints (torch.distributed.checkpoint) resume at another number of processes, replicated,
or from a replicated run's checkpoint; the settings that cannot shard are refused.

The runs are tiny (float64 sinusoid MAML, 16 units, six steps) and share two spawned process
groups, of 2 and 3 processes; a third resume runs here, on one plain process.
"""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from metaddp.distributed.launch import run_local
from metaddp.train import TrainConfig, _checkpoint
from workers import train as run  # a run in a folder rank 0 prepares

CFG = TrainConfig(task="sinusoid", algorithm="maml", steps=6, meta_batch=3, inner_steps=2,
                  inner_lr=0.05, outer_lr=0.01, shots=7, query=5, hidden=16, dtype="float64",
                  eval_every=0, eval_tasks=3, eval_steps=2, checkpoint_every=3,
                  shard=True).resolved()
HALF = dataclasses.replace(CFG, steps=3)


def flip_a_bit_in_a_shard(folder: Path, rows: torch.Tensor) -> str:
    """Flip a bit of ``rows`` in the shard file of the newest checkpoint in ``folder`` that
    holds them (found by their bytes); its name."""
    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    shards = folder / state["sharded"]["folder"]
    held = rows.numpy().tobytes()
    (path,) = [p for p in shards.iterdir() if p.suffix == ".distcp" and held in p.read_bytes()]
    raw = bytearray(path.read_bytes())
    # A middle element's top mantissa bit (float64, little-endian): a finite number still.
    raw[raw.find(held) + 8 * (rows.numel() // 2) + 6] ^= 0x08
    path.write_bytes(bytes(raw))
    return path.name


def saved_on_two(root: str) -> dict:
    """On 2 processes: the whole sharded run; its first half (step-3 checkpoint); a
    replicated first half. Rank 0 copies each half's folder to hand it to other counts. Last,
    the whole run's folder with a bit flipped in a shard of its newest checkpoint (step 6),
    resumed."""
    out = {"full": run(CFG, f"{root}/full", False)}
    run(HALF, f"{root}/half", False)
    run(dataclasses.replace(HALF, shard=False), f"{root}/half-replicated", False)
    if dist.get_rank() == 0:
        shutil.copytree(f"{root}/half", f"{root}/on-three")
        shutil.copytree(f"{root}/half", f"{root}/on-one")
        shutil.copytree(f"{root}/half-replicated", f"{root}/replicated-on-three")
        shutil.copytree(f"{root}/full", f"{root}/flipped")
        # Rank 0's rows of a weight (torch.chunk's first 8 of 16): in the file rank 1 checks.
        rows = out["full"]["weights"]["model.2.weight"][:8]
        out["flipped_file"] = flip_a_bit_in_a_shard(Path(f"{root}/flipped"), rows)
    dist.barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out["flipped"] = run(CFG, f"{root}/flipped", True)
    out["said"] = [str(w.message) for w in seen if "checkpoint" in str(w.message)]
    return out


def resumed_on_three(root: str) -> dict:
    """On 3 processes (each task's samples over all three): the sharded checkpoint of 2
    processes, and the replicated one, each resumed sharded."""
    return {"sharded": run(CFG, f"{root}/on-three", True),
            "replicated": run(CFG, f"{root}/replicated-on-three", True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    two = run_local(saved_on_two, 2, str(root))
    three = run_local(resumed_on_three, 3, str(root))
    # One plain process, without shard: the sharded state read whole.
    one = run(dataclasses.replace(CFG, shard=False), str(root / "on-one"), True)
    plain = run(dataclasses.replace(CFG, shard=False), str(root / "plain"), False)
    return {"root": root, "two": two, "three": three, "one": one, "plain": plain}


def rel(a: dict, b: dict) -> float:
    scale = max(float(v.abs().max()) for v in a.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


# Float64. A resumed run takes the same steps as the uninterrupted one, with each task's
# samples cut over another number of processes: its gathers and reduce-scatters add the same
# numbers in another order, an ulp or so (1e-16 relative) per sum, which Adam's division by
# small second moments may amplify over the steps (measured here: 3e-17 to 2e-16). 1e-12
# leaves room for that and for other machines' kernels, while a wrong row, a lost optimizer
# state (measured: 4e-2) or a missed step shows at 1e-4 or more.
TOL = 1e-12


def test_a_sharded_run_resumes_on_three_processes_as_if_uninterrupted(runs):
    full = runs["two"][0]["full"]
    for rank_result in runs["three"]:
        got = rank_result["sharded"]
        assert got["start"] == 3 and len(got["losses"]) == 3
        assert rel(full["weights"], got["weights"]) < TOL
        assert max(abs(a - b) / abs(a) for a, b in zip(full["losses"][3:], got["losses"])) < TOL


def test_a_sharded_checkpoint_resumes_replicated_and_a_replicated_one_sharded(runs):
    full = runs["two"][0]["full"]
    assert runs["one"]["start"] == 3 and rel(full["weights"], runs["one"]["weights"]) < TOL
    for rank_result in runs["three"]:
        assert rank_result["replicated"]["start"] == 3
        assert rel(full["weights"], rank_result["replicated"]["weights"]) < TOL


def test_sharded_runs_follow_the_replicated_trajectory(runs):
    full, plain = runs["two"][0]["full"], runs["plain"]
    assert full["weights"].keys() == plain["weights"].keys()
    for k, v in plain["weights"].items():
        assert full["weights"][k].shape == v.shape  # gathered whole at the end
    assert rel(plain["weights"], full["weights"]) < TOL
    # Both ranks return the same whole weights.
    for k, v in full["weights"].items():
        assert torch.equal(v, runs["two"][1]["full"]["weights"][k])


def test_a_sharded_checkpoint_is_a_small_file_and_a_folder_per_kept_step(runs):
    folder = runs["root"] / "on-three"
    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    assert "model" not in state and state["step"] == 6 and state["world"] == 3
    named = {torch.load(p, weights_only=True)["sharded"]["folder"]
             for p in _checkpoint.history(folder / "checkpoint.pt") if p.is_file()}
    # The step-3 state written on 2 processes (two files), the step-6 one on 3 (three).
    assert {p.relative_to(folder).as_posix() for p in (folder / "shards").iterdir()} == named
    files = sorted(len([f for f in (folder / n).iterdir() if f.suffix == ".distcp"]) for n in named)
    assert files == [2, 3]


def test_a_missing_sharded_state_falls_back_to_the_checkpoint_before(runs, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(runs["root"] / "full", folder)
    newest = torch.load(folder / "checkpoint.pt", weights_only=True)["sharded"]["folder"]
    (folder / newest / ".metadata").unlink()  # as a save cut short leaves it
    with pytest.warns(RuntimeWarning, match="names its sharded state .* missing or incomplete"):
        state = _checkpoint.load_latest(folder / "checkpoint.pt", CFG.identity())
    assert state["step"] == 3


def test_a_flipped_bit_in_a_shard_falls_back_on_every_process_as_if_uninterrupted(runs):
    first, second = runs["two"]
    assert first["flipped_file"] == "__0_0.distcp"  # read back by process 1 alone
    folder = runs["root"] / "flipped"
    for rank_result in runs["two"]:
        said = rank_result["said"]
        assert len(said) == 1, said
        assert said[0].startswith(f"checkpoint {folder / 'checkpoint.pt'} names its sharded state "), said
        assert said[0].endswith(", in which __0_0.distcp fails its checksum: its bytes changed after they were "
                                "written; resuming from checkpoint.1.pt (step 3)"), said
        assert rank_result["flipped"]["start"] == 3
        # Steps 4-6 again on the same 2 processes, from step 3's rows and Adam state: the
        # same bits as the run that never stopped.
        weights = rank_result["flipped"]["weights"]
        assert all(torch.equal(first["full"]["weights"][k], weights[k]) for k in weights)


@pytest.mark.parametrize("option, message", [
    (dict(deterministic=True), "deterministic runs hold every weight whole"),
    (dict(inner_clip=1.0), "drop inner_clip or shard"),
    (dict(autocast="fp16"), "use autocast bf16"),
    (dict(cuda_graphs=True), "not recorded in CUDA graphs: drop cuda_graphs"),
])
def test_settings_that_cannot_shard_are_refused(option, message):
    base = dict(task="sinusoid", steps=3, shard=True)
    with pytest.raises(ValueError, match=message):
        TrainConfig(**base, **option).resolved()


def test_reweight_shards_its_unrolled_lookahead_only():
    TrainConfig(task="noisy-digits", algorithm="reweight", shard=True).resolved()
    with pytest.raises(ValueError, match="neumann takes norms .* shard takes method unrolled"):
        TrainConfig(task="noisy-digits", algorithm="reweight", method="neumann", shard=True).resolved()


@pytest.mark.parametrize("layout, world, refused", [
    ("sample", 1, False), ("task", 1, False), ("sample", 2, False), ("task", 2, True),
    ("hybrid", 2, True), ("hybrid", 4, False),
])
def test_shard_needs_more_than_one_process_per_task(layout, world, refused):
    cfg = dataclasses.replace(CFG, layout=layout)
    if not refused:
        cfg.check_for(set(), world)
        return
    with pytest.raises(ValueError, match="gives every task to one process: use --layout sample"):
        cfg.check_for(set(), world)


def test_shard_is_not_part_of_the_identity():
    # The same steps either way: a run may resume sharded or not.
    assert "shard" not in TrainConfig.IDENTITY


def test_the_command_line_refuses_a_layout_without_a_sample_axis(tmp_path, capsys):
    from metaddp.cli import main

    out = tmp_path / "run"
    assert main(["train", "sinusoid", "--shard", "--nproc", "2", "--layout", "task", "--steps", "2",
                 "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drop shard (--no-shard)" in err[0], err
    assert not out.exists()


def test_on_one_process_shard_cuts_nothing_and_checkpoints_sharded(tmp_path):
    from metaddp.cli import main

    out = tmp_path / "run"
    args = ["sinusoid", "--shard", "--steps", "2", "--meta-batch", "2", "--hidden", "8",
            "--eval-every", "0", "--eval-tasks", "2", "--checkpoint-every", "1", "--no-progress"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["train", *args, "--out", str(out)]) == 0
    assert not [w for w in seen if "single process" in str(w.message)]  # DCP's, not shown
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["step"] == 2 and (out / state["sharded"]["folder"] / ".metadata").is_file()
    first = set((out / "shards").iterdir())
    assert len(first) == 2  # one per kept checkpoint
    assert main(["train", *args, "--out", str(out), "--force"]) == 0  # --force clears them
    assert len(set((out / "shards").iterdir()) - first) == 2 == len(list((out / "shards").iterdir()))
    assert main(["train", "--resume", str(out), "--steps", "3", "--no-shard", "--no-progress"]) == 0
    assert "model" in torch.load(out / "checkpoint.pt", weights_only=True)
