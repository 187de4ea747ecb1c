"""``metaddp train`` checks every setting before it creates anything: a bad value, file, dataset,
layout or backend is one line on stderr and status 2, and the output folder is left as it was,
so that the corrected command runs in it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metaddp.cli import main
from metaddp.train import TrainConfig, read_toml

SMALL = ["--steps", "2", "--meta-batch", "2", "--shots", "3", "--query", "2", "--hidden", "8",
         "--eval-every", "0", "--eval-tasks", "4", "--no-progress"]


def one_character_omniglot(root: Path) -> Path:
    """An Omniglot-layout folder with one character per split: 4 classes with rotations."""
    from test_tasks import omniglot_folder

    return omniglot_folder(root, alphabets=(("Latin", 1),), evaluation=(("Runic", 1),))


# (flags, TOML file text or None, what the error says)
BAD = {
    "toml-string-for-int": ([], 'steps = "10"\n', "config file {toml}: steps must be an integer, got '10' (str)"),
    "toml-float-for-int": ([], "steps = 10.5\n", "steps must be an integer, got 10.5 (float)"),
    "toml-bool-for-int": ([], "[train]\nhidden = true\n", "hidden must be an integer, got True (bool)"),
    "toml-string-for-float": ([], 'inner_lr = "fast"\n', "inner_lr must be a number, got 'fast' (str)"),
    "toml-infinite-rate": ([], "outer_lr = inf\n", "outer_lr must be a positive finite number, got inf"),
    # Top-level keys beside [train] used to be ignored: 1000 steps ran instead of 7.
    "toml-keys-beside-train": ([], "steps = 7\n[train]\nseed = 1\n", "has steps outside its [train] table"),
    "toml-unknown-table": ([], "[model]\nhidden = 8\n", "config file {toml}: hidden is in table [model], "
                           "which metaddp train does not read: put it at top level (or every setting under [train])"),
    "toml-unknown-nested-table": ([], "[train]\nseed = 1\n[train.model]\nhidden = 8\n",
                                  "hidden is in table [train.model], which metaddp train does not read: put it "
                                  "under [train]"),
    "toml-table-beside-train": ([], "[train]\nseed = 1\n[other]\nsteps = 5\nseed = 2\n",
                                "steps, seed are in table [other], which metaddp train does not read: put "
                                "settings under [train]"),
    "toml-a-flag": ([], "nproc = 2\n", "config file {toml}: nproc is a flag of the command line (--nproc), "
                    "not a setting a config file holds: give it on the command line"),
    "negative-width": (["--hidden", "-3"], None, "hidden must be a positive integer, got -3"),
    "zero-width": (["--hidden", "0"], None, "hidden must be a positive integer, got 0"),
    "no-processes": (["--nproc", "0"], None, "--nproc must be at least 1, got 0"),
    "hybrid-on-3": (["--nproc", "3", "--layout", "hybrid"], None, "--layout hybrid makes two task groups"),
    "digits-ways-50": (["--task", "digits", "--ways", "50"], None,
                       "the train split has 20 classes, fewer than ways=50"),
    # Digits' meta-test split has only 5 classes: 6 ways fit training, not meta-testing.
    "digits-ways-6": (["--task", "digits", "--ways", "6"], None, "the test split has 5 classes, fewer than ways=6"),
    "omniglot-one-character": (["--task", "omniglot", "--data", "{omni}"], None,
                               "the train split has 4 classes, fewer than ways=5"),
    "omniglot-no-layout": (["--task", "omniglot", "--data", "{tmp}"], None, "images_background is missing"),
}


def command(flags: list[str], **paths: Path) -> list[str]:
    """``train TASK ...`` from a case's flags ("--task NAME" picks the task, sinusoid if absent)."""
    flags = [f.format(**paths) for f in flags]
    task = "sinusoid"
    if "--task" in flags:
        i = flags.index("--task")
        task = flags[i + 1]
        del flags[i:i + 2]
    return ["train", task, *SMALL, *flags]


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_setting_is_one_line_and_creates_nothing(case, tmp_path, capsys):
    flags, toml, expected = BAD[case]
    if "digits" in flags:
        pytest.importorskip("sklearn")
    paths = {"tmp": tmp_path, "toml": tmp_path / "run.toml"}
    if "{omni}" in flags:
        paths["omni"] = one_character_omniglot(tmp_path / "omni")
    args = command(flags, **paths)
    if toml is not None:
        paths["toml"].write_text(toml)
        args += ["--config", str(paths["toml"])]
    out = tmp_path / "run"
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("metaddp train: error: ") and err.count("\n") == 1, err
    assert expected.format(**paths) in err
    assert not out.exists()


# What --show-settings once accepted and a run refused (flags, what both say).
REFUSED_BY_BOTH = {
    "lam-for-maml": (["--lam", "3"], "lam is iMAML's proximal strength: maml does not take it"),
    "chunks-alone": (["--chunks", "4"], "chunks cuts batches in deterministic runs only: add --deterministic"),
    "noise-for-sinusoid": (["--noise", "0.2"], "noise is a setting of noisy-digits and noisy-run, not of sinusoid"),
    "shard-task-layout": (["--shard", "--layout", "task", "--nproc", "2"],
                          "--layout task on 2 processes gives every task to one process"),
    # A batch of noisy-digits may lack a class: the run failed at the first such step.
    "protonet-noisy-digits": (["--task", "noisy-digits", "--algorithm", "protonet"],
                              "protonet scores classes against their prototypes, made from every class's "
                              "support samples: it trains on N-way K-shot tasks, not noisy-digits"),
    **{case: (flags, expected) for case, (flags, toml, expected) in BAD.items() if toml is None},
}


@pytest.mark.parametrize("case", list(REFUSED_BY_BOTH))
def test_show_settings_refuses_what_a_run_refuses_in_the_same_words(case, tmp_path, capsys):
    flags, expected = REFUSED_BY_BOTH[case]
    if "digits" in flags:
        pytest.importorskip("sklearn")
    paths = {"tmp": tmp_path}
    if "{omni}" in flags:
        paths["omni"] = one_character_omniglot(tmp_path / "omni")
    args = [*command(flags, **paths), "--out", str(tmp_path / "run")]
    assert main(args) == 2
    refused = capsys.readouterr().err
    assert expected.format(**paths) in refused and refused.count("\n") == 1, refused
    assert main([*args, "--show-settings"]) == 2
    assert capsys.readouterr().err == refused
    assert not (tmp_path / "run").exists()


def test_show_settings_refuses_a_resume_whose_settings_do_not_match(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*command([]), "--out", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, "seed": 7}))  # not what the run ran
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 2
    refused = capsys.readouterr().err
    assert "comes from another configuration (seed: checkpoint 0, now 7)" in refused
    assert main(["train", "--resume", str(out), "--steps", "3", "--show-settings"]) == 2
    assert capsys.readouterr().err == refused


def test_cuda_graphs_on_gloo_processes_are_refused_before_they_start(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # gloo's processes: the CPU
    args = [*command(["--cuda-graphs", "--backend", "gloo", "--nproc", "2"]), "--out", str(tmp_path / "run")]
    assert main(args) == 2
    refused = capsys.readouterr().err
    assert "cuda_graphs records CUDA graphs, and --backend gloo runs the processes on the CPU" in refused
    assert main([*args, "--show-settings"]) == 2 and capsys.readouterr().err == refused
    assert not (tmp_path / "run").exists()


def test_show_settings_checks_every_process_count_of_nnodes(capsys):
    args = ["train", "sinusoid", "--layout", "hybrid", "--rdzv-endpoint", "localhost:1", "--show-settings"]
    assert main([*args, "--nnodes", "1:2"]) == 0
    assert main([*args, "--nnodes", "1:3"]) == 2
    assert "which 3 processes cannot form" in capsys.readouterr().err


def test_show_settings_prints_every_setting(tmp_path, capsys):
    flags = ["--algorithm", "imaml", "--lam", "3", "--deterministic", "--chunks", "4", "--outer-schedule",
             "cosine", "--inner-clip", "0.5"]
    assert main(["train", "sinusoid", *flags, "--out", str(tmp_path / "run"), "--show-settings"]) == 0
    said = capsys.readouterr().out.splitlines()
    table = said[said.index("every setting:") + 1:]
    shown = dict(line.split(maxsplit=1) for line in table)
    assert list(shown) == TrainConfig.names()
    assert shown["lam"] == "3.0" and shown["chunks"] == "4" and shown["deterministic"] == "True"
    assert shown["outer_schedule"] == "cosine" and shown["inner_clip"] == "0.5"
    assert shown["shard"] == "False" and shown["autocast"] == "(not set)" and shown["ways"] == "(not set)"
    assert shown["memory"] == "default" and shown["eval_steps"] == "10" and shown["inner_lr"] == "0.01"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nccl can work")
def test_nccl_without_cuda_is_refused(tmp_path, capsys):
    assert main([*command([]), "--backend", "nccl", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--backend nccl needs CUDA GPUs" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_the_corrected_command_runs_in_the_same_folder(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*command(["--hidden", "0"]), "--out", str(out)]) == 2
    assert main([*command(["--nproc", "3", "--layout", "hybrid"]), "--out", str(out)]) == 2
    assert not out.exists()
    assert main([*command([]), "--out", str(out)]) == 0
    assert (out / "summary.json").exists()


def test_types_are_checked_wherever_settings_come_from(tmp_path):
    with pytest.raises(ValueError, match=r"^steps must be an integer, got '10' \(str\)$"):
        TrainConfig(steps="10")
    with pytest.raises(ValueError, match=r"^meta_batch must be an integer, got True \(bool\)$"):
        TrainConfig(meta_batch=True)
    # A float setting takes an integer; an optional one takes None (the family's default).
    assert TrainConfig(lam=2, inner_lr=None).lam == 2
    path = tmp_path / "ok.toml"
    path.write_text('[train]\ntask = "sinusoid"\nsteps = 7\nlam = 1\n')
    assert read_toml(path) == {"task": "sinusoid", "steps": 7, "lam": 1}


def test_the_real_command_prints_one_line_or_with_debug_the_traceback(tmp_path):
    base = [sys.executable, "-m", "metaddp", "train", "sinusoid", "--hidden", "0",
            "--out", str(tmp_path / "run")]
    r = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (2, "metaddp train: error: hidden must be a positive integer, got 0\n")
    r = subprocess.run([*base, "--debug"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr
    assert r.stderr.rstrip().endswith("ValueError: hidden must be a positive integer, got 0")
    assert not (tmp_path / "run").exists()
