"""metaddp train's inner optimizer and forward precision: each in effect, each refused when
unknown, each part of the run's identity."""

from __future__ import annotations

import math

import pytest
import torch

from metaddp import train as _train
from metaddp.train import TrainConfig

BASE = dict(task="sinusoid", steps=3, meta_batch=3, shots=5, query=5, hidden=8, inner_steps=2,
            eval_every=0, eval_tasks=3)


def losses(tmp_path, **options):
    cfg = TrainConfig(**BASE, **options).resolved()
    out = tmp_path / "-".join(f"{k}{v}" for k, v in options.items())
    _train.prepare_folder(out, cfg, False, force=False)
    return _train.train(cfg, out, progress=False)["losses"]


def test_the_inner_optimizer_and_autocast_are_in_effect(tmp_path):
    sgd = losses(tmp_path, inner_optimizer="sgd")
    adam = losses(tmp_path, inner_optimizer="adam")
    bf16 = losses(tmp_path, autocast="bf16")
    assert all(math.isfinite(v) for v in sgd + adam + bf16)
    # The first loss is after the first inner loop: Adam's steps differ from SGD's at once.
    assert adam[0] != sgd[0]
    # bfloat16 forward passes round at about 4e-3: visibly, but not wildly, off float32.
    assert bf16[0] != sgd[0] and bf16[0] == pytest.approx(sgd[0], rel=5e-2)


@pytest.mark.parametrize("option", [dict(inner_optimizer="lbfgs"), dict(autocast="fp8"),
                                    dict(outer_schedule="linear")])
def test_unknown_values_are_one_line_errors(option):
    with pytest.raises(ValueError, match="unknown"):
        TrainConfig(**BASE, **option).resolved()


def test_both_are_part_of_the_identity_a_resume_checks():
    a = TrainConfig(**BASE).resolved().identity()
    b = TrainConfig(**BASE, inner_optimizer="adam", autocast="bf16").resolved().identity()
    assert {k for k in a if a[k] != b[k]} == {"inner_optimizer", "autocast"}


def test_a_run_from_before_these_settings_resumes_as_it_ran(tmp_path):
    from metaddp.train import _checkpoint

    # Written before norm, inner_optimizer and autocast existed: an image run's network had no
    # BatchNorm, inner steps were SGD, and forward passes ran in the run's dtype.
    old_image = {"task": "digits", "ways": 5}
    # (and runs were not deterministic, and the outer rate was constant).
    assert _checkpoint.settings_before(old_image) == {
        "norm": "none", "inner_optimizer": "sgd", "autocast": None, "deterministic": False,
        "chunks": 8, "outer_schedule": "constant"}
    assert _checkpoint.settings_before({"task": "sinusoid", "ways": None})["norm"] is None


@pytest.mark.parametrize("option, message", [
    (dict(task="noisy-digits", algorithm="reweight"),
     "deterministic runs train maml, fomaml, metasgd, anil, reptile, imaml, mamlpp, protonet, protomaml, boil, "
     "not reweight"),
    (dict(memory="low"), "drop memory/autocast"),
    (dict(chunks=0), "chunks must be a positive integer"),
])
def test_deterministic_runs_refuse_what_they_cannot_do(option, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**BASE, **option}, deterministic=True).resolved()


def test_deterministic_and_chunks_are_part_of_the_identity():
    a = TrainConfig(**BASE).resolved().identity()
    b = TrainConfig(**BASE, deterministic=True, chunks=4).resolved().identity()
    assert {k for k in a if a[k] != b[k]} == {"deterministic", "chunks"}


@pytest.mark.parametrize("option, message", [
    (dict(algorithm="imaml"),
     "cuda_graphs records maml, fomaml, metasgd, anil, reptile, protonet, protomaml, boil, "
     "reweight, erm steps, not imaml"),
    (dict(algorithm="mamlpp"), "steps, not mamlpp"),
    (dict(deterministic=True), "drop cuda_graphs"),
    (dict(algorithm="reweight", method="implicit-cg"), "reads its residual on the host"),
])
def test_cuda_graph_runs_refuse_what_they_cannot_record(option, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**BASE, cuda_graphs=True, **option).resolved()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_cuda_graphs_without_cuda_is_one_line_and_creates_nothing(tmp_path, capsys):
    from metaddp.cli import main

    out = tmp_path / "run"
    assert main(["train", "sinusoid", "--steps", "2", "--cuda-graphs", "--no-progress",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["metaddp train: error: cuda_graphs records CUDA graphs: no CUDA device is "
                   "available (leave it out, or resume such a run with --no-cuda-graphs)"]
    assert not out.exists()


@pytest.mark.parametrize("option, records", [
    (dict(), True),
    (dict(cuda_graphs=False), False),
    (dict(algorithm="imaml"), False),
    (dict(deterministic=True), False),
    (dict(algorithm="reweight", method="implicit-cg"), False),
    (dict(algorithm="reweight"), True),
])
def test_cuda_graphs_are_on_by_default_wherever_a_run_can_record_them(option, records, monkeypatch):
    monkeypatch.delenv("METADDP_CHECK", raising=False)
    cfg = TrainConfig(**{**BASE, **option})
    if option.get("algorithm") == "reweight":
        cfg = TrainConfig(**{**BASE, "task": "noisy-digits", **option})
    cfg = cfg.resolved()
    assert cfg.cuda_graphs is option.get("cuda_graphs")  # None: decided by the device
    assert cfg.records_graphs(torch.device("cuda")) is records
    assert cfg.records_graphs(torch.device("cpu")) is False  # never off CUDA
    monkeypatch.setenv("METADDP_CHECK", "1")  # check mode's hooks read the host
    assert cfg.records_graphs(torch.device("cuda")) is False


def test_cuda_graphs_is_not_part_of_the_identity():
    # A replayed step gives the same numbers: a run may resume with or without it.
    a = TrainConfig(**BASE).to_dict()
    b = dict(a, cuda_graphs=True)
    ident = TrainConfig.IDENTITY
    assert "cuda_graphs" not in ident and {k: a[k] for k in ident} == {k: b[k] for k in ident}


@pytest.mark.parametrize("option, message", [
    (dict(algorithm="mamlpp", memory="low"), r"memory='low' is not a setting of mamlpp \(its multi-step loss"),
    (dict(algorithm="imaml", autocast="bf16"), "autocast is a setting of .* not of imaml"),
    (dict(algorithm="mamlpp", memory="replay"), "not a setting of mamlpp .*one of maml, fomaml, metasgd, anil, rept"),
    (dict(ways=5), "ways is a setting of classification tasks, not of sinusoid"),
    (dict(data="/nowhere"), "the sinusoid task reads no dataset"),
])
def test_settings_a_run_would_not_read_are_refused(option, message):
    # Accepted, they were written to the run's settings as if used, and changed nothing.
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**BASE, **option}).resolved()


@pytest.mark.parametrize("algorithm", ["reptile", "imaml"])
def test_memory_low_is_taken_where_the_class_declares_it(algorithm):
    # First-order steps: the default loop, flat in memory, in every mode (was refused).
    cfg = TrainConfig(**{**BASE, "algorithm": algorithm, "memory": "low"}).resolved()
    assert cfg.memory == "low"


def test_memory_low_with_fp16_is_what_the_built_algorithm_says():
    # The command line refused it for every algorithm; the library runs first-order steps,
    # which keep no graph to rebuild, with their loss scaling, and refuses second order's
    # (computed inside meta_loss, where no scale reaches it).
    fomaml = TrainConfig(**{**BASE, "algorithm": "fomaml", "memory": "low", "autocast": "fp16"}).resolved()
    assert fomaml.build(fomaml.family().model()).loss_scale is not None
    maml = TrainConfig(**{**BASE, "algorithm": "maml", "memory": "low", "autocast": "fp16"}).resolved()
    with pytest.raises(ValueError, match="memory='low' computes the meta-gradient inside meta_loss"):
        maml.build(maml.family().model())


def test_first_order_maml_takes_the_inner_optimizer():
    # fomaml used to build plain SGD whatever the setting: Adam's meta-gradient differs.
    from metaddp.algorithms.registry import Settings, build
    from metaddp.testing import scenarios as S

    problem = S.Problem("mlp", steps=2)
    grads = {}
    for name in ("sgd", "adam"):
        alg = build("fomaml", problem.build_model(), Settings(inner_lr=0.05, steps=2, optimizer=name))
        assert alg.first_order
        alg.meta_loss(problem.tasks(), problem.loss_fn).backward()
        grads[name] = S.meta_gradient(alg)
    assert max(float((grads["sgd"][k] - grads["adam"][k]).abs().max()) for k in grads["sgd"]) > 1e-3


@pytest.mark.parametrize("flag", [["--lam", "2"], ["--chunks", "4"]])
def test_flags_for_other_runs_are_one_line(tmp_path, capsys, flag):
    from metaddp.cli import main

    out = tmp_path / "run"
    assert main(["train", "sinusoid", "--steps", "2", "--no-progress", "--out", str(out), *flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("iMAML's proximal strength" in err[0] or "deterministic runs only" in err[0])
    assert not out.exists()
