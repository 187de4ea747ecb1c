"""``metaddp verify`` as a user runs it: a verdict on the last line, an exit status (its seed
table: tests/test_docs.py, from the README's own command)."""

import subprocess
import sys

import pytest


def metaddp(*args):
    return subprocess.run([sys.executable, "-m", "metaddp", *args], capture_output=True, text=True,
                          timeout=300)


# The seed table itself: tests/test_docs.py, from the README's own verify command.


def test_verify_rejects_bad_world_sizes(capsys):
    from metaddp.cli import main

    assert main(["verify", "--world-sizes", "1,two"]) == 2
    assert "--world-sizes must be integers" in capsys.readouterr().err
    assert main(["verify", "--world-sizes", "2,2"]) == 2  # the reference compared with itself
    assert "two different sizes" in capsys.readouterr().err


def test_verify_in_a_memory_mode_skips_what_refuses_it(capsys):
    # MAML++ refuses memory='low' (its multi-step loss): it was verified in the default mode
    # as if in the low one; now it is named as skipped, and with nothing left, exit 2.
    from metaddp.cli import main

    assert main(["verify", "--memory", "low", "--scenario", "mamlpp", "protomaml"]) == 2
    captured = capsys.readouterr()
    assert "no memory='low' for mamlpp, protomaml: skipped" in captured.out
    assert "nothing takes memory='low'" in captured.err


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
