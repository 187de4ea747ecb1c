"""The ``metaddp`` command line: one sub-command per module of this package."""

from __future__ import annotations

import argparse
import importlib
import sys

from ..distributed import keep_freed_memory

# Each module defines ``add_parser(subparsers)`` registering its sub-command, whose parser
# carries ``func=`` taking the parsed arguments and returning the exit status.
COMMANDS = ["verify", "train", "data"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="metaddp",
        description="Meta-learning on many processes whose meta-gradients do not depend on the "
        "number of processes. Commands: train (meta-train on a task family), "
        "verify (compare results at several process counts with one process) and data (what "
        "an image task family holds, and a picture of a few of its tasks).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"metaddp.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_memory()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
