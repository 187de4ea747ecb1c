"""``metaddp train noisy-digits``: data reweighting under label noise from the command line,
on two processes, resumed; its settings' refusals; the learned weights' figure."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from metaddp.cli import main

pytest.importorskip("sklearn")  # the digits (the digits extra)

SHORT = ["noisy-digits", "--steps", "40", "--eval-every", "20", "--checkpoint-every", "20",
         "--eval-tasks", "4", "--no-progress"]


def rows(folder: Path) -> list[dict]:
    with open(folder / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_reweighting_on_two_processes_resumes_and_matches_one(tmp_path, capsys):
    """Half the run on two processes, the rest resumed; the same run on one process: every
    step once, and the same test accuracy (the two differ only in the order of sums)."""
    two, one = tmp_path / "two", tmp_path / "one"
    half = [a if a != "40" else "20" for a in SHORT]
    assert main(["train", *half, "--algorithm", "reweight", "--nproc", "2", "--out", str(two)]) == 0
    assert main(["train", "--resume", str(two), "--steps", "40", "--nproc", "2", "--no-progress"]) == 0
    assert main(["train", *SHORT, "--algorithm", "reweight", "--out", str(one)]) == 0
    out = capsys.readouterr().out
    assert "test on 4 held-out batches" in out and "accuracy" in out
    assert [int(r["step"]) for r in rows(two)] == list(range(1, 41))
    a, b = (json.loads((f / "summary.json").read_text()) for f in (two, one))
    # 200 test images: one image is 0.005; rounding cannot move 40 float32 steps that far.
    assert abs(a["test_acc_after"] - b["test_acc_after"]) < 0.005
    assert a["test_acc_after"] > 0.3  # 40 steps from 0.1 (chance) on ten classes
    if (one / "plots").is_dir() and (one / "plots" / "training.png").exists():
        assert (one / "plots" / "weights.png").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["sinusoid", "--noise", "0.2"], "noise is a setting of noisy-digits"),
        (["noisy-digits", "--noise", "0.95"], "fraction of flipped labels"),
        (["noisy-digits", "--eval-steps", "1"], "eval_steps must be 0"),
        (["noisy-digits", "--ways", "5"], "all ten digits"),
        (["noisy-digits", "--method", "neumann"], "method is the hypergradient of reweight"),
        (["noisy-digits", "--algorithm", "reweight", "--method", "neumann", "--memory", "low"],
         "memory='low'"),
        (["noisy-digits", "--eval-tasks", "13"], "12 test batches of held-out data"),
        (["noisy-run", "--method", "neumann"], "choose --method unrolled or truncated"),
        (["noisy-run", "--algorithm", "maml"], "noisy-run takes reweight"),
        (["noisy-run", "--eval-steps", "0"], "eval_steps must be >= 1"),
    ],
)
def test_settings_that_cannot_work_are_one_line(tmp_path, capsys, args, message):
    code = main(["train", *args, "--steps", "1", "--out", str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_weighting_learned_through_a_whole_run_matches_a_plain_torch_loop(tmp_path, capsys):
    """``metaddp train noisy-run`` against the same run written with ``torch.optim`` and
    autograd through every step: the outer loss of each meta-step (the first with the initial
    weighting, the second after one Adam step on the hypergradient through all 12 minibatch
    steps, here rebuilt from a tree of states) and the plain run's test loss."""
    import torch
    import torch.nn.functional as F

    from metaddp.bilevel import Minibatches, WeightNet
    from metaddp.tasks import make

    out = tmp_path / "run"
    steps, batch = 12, 32
    args = ["train", "noisy-run", "--steps", "2", "--inner-steps", str(steps), "--eval-every",
            "0", "--eval-tasks", "3", "--dtype", "float64", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    assert "plain training" in capsys.readouterr().out
    logged = [float(r["meta_loss"]) for r in rows(out)]
    summary = json.loads((out / "summary.json").read_text())

    family = make("noisy-run", shots=batch, query=100)
    torch.manual_seed(0)  # the run's seed: the network first, then the weighting
    net = family.model().double()
    weighting = WeightNet().double()
    (xs, ys), (xq, yq) = ((b.x.double(), b.y) for b in family.task(0, 0))
    theta = dict(net.named_parameters())

    def run(weighted: bool) -> dict[str, torch.Tensor]:
        """SGD with momentum 0.9 at 0.1, torch.optim.SGD's rule, with its graph."""
        fast, buf = dict(theta), {}
        for t in range(steps):
            rows_t = Minibatches(batch, 0).indices(len(ys), t)
            pred = torch.func.functional_call(net, fast, (xs[rows_t],))
            losses = F.cross_entropy(pred, ys[rows_t], reduction="none")
            if weighted:
                losses = weighting(losses.detach()) * losses
            grads = torch.autograd.grad(losses.mean(), list(fast.values()), create_graph=True)
            for (k, p), g in zip(list(fast.items()), grads):
                buf[k] = g if t == 0 else 0.9 * buf[k] + g
                fast[k] = p - 0.1 * buf[k]
        return fast

    def outer() -> torch.Tensor:
        pred = torch.func.functional_call(net, run(True), (xq,))
        return F.cross_entropy(pred, yq)

    expected = [outer()]
    opt = torch.optim.Adam(weighting.parameters(), lr=0.01)
    expected[0].backward()
    opt.step()
    expected.append(outer())
    # float64 through 12 steps, summed in another order: rounding is ~1e-15; an error in a
    # minibatch, a momentum term or the weighting's gradient moves these by 1e-3 or more.
    assert logged == pytest.approx([e.item() for e in expected], abs=1e-10)
    plain = {k: v.detach() for k, v in run(False).items()}
    test = [family.task(0, i, "test").query for i in range(3)]
    losses = [F.cross_entropy(torch.func.functional_call(net, plain, (q.x.double(),)), q.y)
              for q in test]
    assert summary["test_before"] == pytest.approx(float(sum(losses)) / 3, abs=1e-10)
