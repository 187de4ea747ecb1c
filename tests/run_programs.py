"""Runs each program named on the command line as ``python PROGRAM`` would, one after another
in this one process (each under torchrun's environment where launched by it), so that the
documented programs share one interpreter start and one launch. Their process group is
shut down once, after the last (a group destroyed and made again from torchrun's store would
not connect). Rank 0 prints each program's output after a line ``=== PROGRAM``; a program
that raises ends the run with its traceback after ``=== PROGRAM failed``."""

import contextlib
import io
import os
import runpy
import sys
import traceback

import metaddp

if __name__ == "__main__":
    shutdown, metaddp.shutdown = metaddp.shutdown, lambda: None
    rank0 = os.environ.get("RANK", "0") == "0"
    for program in sys.argv[1:]:
        out = io.StringIO()
        sys.argv = [program]
        sys.path[0] = os.path.dirname(os.path.abspath(program))  # as `python PROGRAM` sets it
        try:
            with contextlib.redirect_stdout(out):
                runpy.run_path(program, run_name="__main__")
        except BaseException:
            print(f"=== {program} failed\n{out.getvalue()}{traceback.format_exc()}", flush=True)
            sys.exit(1)
        if rank0:
            print(f"=== {program}\n{out.getvalue()}", end="", flush=True)
    shutdown()
