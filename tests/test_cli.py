"""``metaddp verify`` as a user runs it: a table, a verdict on the last line, an exit status."""

import subprocess
import sys

import pytest


def metaddp(*args):
    return subprocess.run([sys.executable, "-m", "metaddp", *args], capture_output=True, text=True,
                          timeout=300)


def test_verify_seed_agrees_across_world_sizes():
    run = metaddp("verify", "--scenario", "seed", "--world-sizes", "1,3")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    rows = [l for l in lines if l.startswith("seed ")]
    assert len(rows) == 4  # two checks (1st, 2nd order) x two world sizes
    # The grad-norm column: grad2 after 1 step (7.02) and after 5 second-order steps (71.02).
    assert [l.split()[-3] for l in rows] == ["7.02", "7.02", "71.02", "71.02"]
    assert lines[-1].startswith("worst relative difference: ")
    assert lines[-1].endswith("every world size agrees within tolerance")


def test_verify_rejects_bad_world_sizes():
    run = metaddp("verify", "--world-sizes", "1,two")
    assert run.returncode != 0 and "--world-sizes must be integers" in run.stderr
    run = metaddp("verify", "--world-sizes", "2,2")  # the reference compared with itself
    assert run.returncode == 2 and "two different sizes" in run.stderr


def test_unknown_scenario_is_rejected_by_name():
    run = metaddp("verify", "--scenario", "nope")
    assert run.returncode == 2 and "invalid choice: 'nope'" in run.stderr


def test_help_lists_only_the_commands_that_exist(capsys):
    from metaddp.cli import build_parser

    parser = build_parser()
    text = parser.format_help()
    # argparse lists sub-commands indented by four spaces; wrapped help lines by more.
    listed = {line.split()[0] for line in text.splitlines()
              if line.startswith("    ") and not line.startswith("     ")}
    assert listed == {"train", "verify", "data"}
    assert "bench" not in text.lower()
    for command in listed:  # and each of them answers --help
        with pytest.raises(SystemExit) as done:
            parser.parse_args([command, "--help"])
        assert done.value.code == 0
    assert "usage: metaddp train" in capsys.readouterr().out
