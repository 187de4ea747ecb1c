"""The README's one-screen API is the script the tests run (examples/quickstart.py)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def code_lines(text: str) -> list[str]:
    """Statements without comments and indentation, blank lines and imports left out."""
    out = []
    for line in text.splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith(("#", "import ", "from ")):
            out.append(line)
    return out


def readme_api_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The API on one screen", 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_readme_api_is_the_tested_quickstart():
    block = code_lines(readme_api_block())
    script = code_lines((ROOT / "examples" / "quickstart.py").read_text())
    assert 8 <= len(block) <= 12  # one screen, and shorter than the 13 statements it replaced
    for line in block:
        assert line in script, f"README line not in examples/quickstart.py: {line}"


def readme_commands() -> list[str]:
    """The README's shell commands that run from the repository after `make demo` (those
    written with `.venv/bin/`), in the order the README gives them."""
    readme = (ROOT / "README.md").read_text()
    blocks = readme.split("```")[1::2]
    lines = [l.split("  #")[0].strip() for b in blocks if not b.startswith("python") for l in b.splitlines()]
    return [l for l in lines if l.startswith(".venv/bin/")]


def readme_streams() -> list[list[str]]:
    """The README's commands that the pool below runs, in streams: a command that names a run
    folder follows the ones before it that name it too. The glyphs run (45 s on 2 cores, and
    30 s more to draw its glyph set) is a slow check: it runs with METADDP_SLOW=1 (make
    verify)."""
    from conftest import SLOW

    streams: dict[str, list[str]] = {}
    for command in readme_commands():
        if " -m pytest " in command:
            assert (ROOT / command.split()[-1]).exists(), command  # the suite runs it itself
            continue
        if " glyphs " in command and not SLOW:
            continue
        folder = next((w for w in command.split() if w.startswith("runs/")), command)
        streams.setdefault(folder, []).append(command)
    return list(streams.values())


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, list]:
    """Every README command and every documented program marked to run on any number of
    processes (all of them in one process, then all under one launch of 2), two runs at a time
    (one per core, one torch thread each), the longest first. Per test below: its jobs'
    outcomes, in its own order (each program at 1 process, then at 2)."""
    import os
    import shutil
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from conftest import GLYPHS, glyph_cache  # tests/ is on sys.path (conftest.py)

    # The glyph set is the one the session draws in the background (tests/conftest.py): the
    # glyphs run waits for it, the other jobs do not.
    env = dict(os.environ, METADDP_CACHE=GLYPHS.get("cache") or str(tmp_path_factory.mktemp("cache")),
               OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    bin_dir = str(Path(sys.executable).parent) + "/"

    def readme(stream: list[str]) -> list[tuple[str, subprocess.CompletedProcess]]:
        if any(" glyphs " in command for command in stream):
            glyph_cache()
        return [(command, subprocess.run(command.replace(".venv/bin/", bin_dir), shell=True, cwd=ROOT,
                                         capture_output=True, text=True, timeout=300, env=env))
                for command in stream]

    def programs(launcher: tuple[str, ...]) -> list[tuple[str, list[str]]]:
        # Every program in one interpreter (tests/run_programs.py), under one launch.
        names = any_world_programs()
        done = subprocess.run([sys.executable, *launcher, "tests/run_programs.py", *names], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return [(f"{launcher}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}", [])]
        outputs = dict(re.findall(r"^=== (\S+)\n(.*?)(?=^=== |\Z)", done.stdout, re.S | re.M))
        return [("", re.findall(r"-?\d+\.\d+", outputs.get(name, ""))) for name in names]  # printed numbers

    streams = sorted(readme_streams(), key=lambda stream: -len(" ".join(stream)))
    launchers = [(), ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")]
    work = [(readme, s) for s in streams] + [(programs, launcher) for launcher in launchers]
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda fn_arg: fn_arg[0](fn_arg[1]), work))
    for folder in ("first", "glyphs-first"):
        shutil.rmtree(ROOT / "runs" / folder, ignore_errors=True)
    one, two = outcomes[len(streams):]
    return {"readme": dict(done for stream in outcomes[: len(streams)] for done in stream),
            "programs": [job for pair in zip(one, two) for job in pair] if len(one) == len(two) else one + two}


def test_every_readme_command_runs_as_written(ran):
    assert len(readme_commands()) >= 5
    failures = [f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
                for command, done in ran["readme"].items() if done.returncode != 0]
    assert not failures, "\n\n".join(failures)


def test_the_readme_verify_command_prints_the_readme_table(ran):
    """The README's table, measured on real gloo processes by its own command: the user's DDP
    recipe gives 7.02 on one process and 6.52 on two, metaddp 7.02 on both, first and second
    order."""
    (command,) = [c for c in ran["readme"] if " verify " in c]
    lines = ran["readme"][command].stdout.strip().splitlines()
    rows = [l for l in lines if l.startswith("seed ")]
    assert len(rows) == 4  # metaddp's two checks (1st, 2nd order) x two world sizes
    # The grad-norm column, printed to 3 significant digits: grad2 after one step.
    assert [l.split()[-3] for l in rows] == ["7.02"] * 4
    at = lines.index("ranks    plain DDP recipe  metaddp, 1st order  metaddp, 2nd order")
    # Compared as the printed text: the table prints two decimals, as the README does, and
    # the values (7.02 and 6.52 within 5e-7 in float32) are far from a rounding boundary.
    table = [["1", "7.02", "7.02", "7.02"], ["2", "6.52", "7.02", "7.02"]]
    assert [l.split() for l in lines[at + 1 : at + 3]] == table
    assert lines[-1].startswith("worst relative difference: ")
    assert lines[-1].endswith("every world size agrees within tolerance")
    readme = (ROOT / "README.md").read_text()
    for row in table:  # and the README's table shows the same numbers (a changed one in bold)
        assert re.search(r"\|\s*" + r"\s*\|\s*".join(rf"(\*\*)?{re.escape(v)}(\*\*)?" for v in row) + r"\s*\|",
                         readme), row


def test_the_capability_table_is_what_the_classes_declare():
    import dataclasses

    from metaddp import Supports
    from metaddp.algorithms import SUPPORTS

    text = (ROOT / "docs" / "algorithms.md").read_text()
    fields = [f.name for f in dataclasses.fields(Supports) if f.type == "bool"]  # not the reasons
    for name, supports in SUPPORTS.items():
        row = f"| `{name}` | " + " | ".join("yes" if getattr(supports, f) else "no" for f in fields) + " |"
        assert row in text, row


# Every code block of README.md and docs/*.md is a complete program, or names the file under
# examples/ that holds it: a comment `# complete program: examples/NAME.py` on its first line,
# or the sentence right before it naming `examples/NAME.py`. A program whose block or file
# says `runs on any number of processes` is run at 1 process and at 2, and must print the
# same numbers.
PROGRAM = "complete program: examples/"
ANY_WORLD = "runs on any number of processes"


def doc_blocks() -> list[tuple[str, str, str, str]]:
    """(file, language, the text before the block, the block) for every fenced block."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        parts = path.read_text().split("```")
        for before, block in zip(parts[0::2], parts[1::2]):
            lang, _, body = block.partition("\n")
            out.append((path.name, lang.strip(), before.rstrip().rsplit("\n\n", 1)[-1], body))
    return out


def named_program(before: str, body: str) -> str | None:
    first = body.lstrip().split("\n", 1)[0]
    found = re.search(r"examples/[\w./]+\.py", first if PROGRAM in first else before)
    return found.group(0) if found else None


def named_programs() -> dict[str, bool]:
    """Every program a page's python block names, and whether it is marked to run on any
    number of processes; asserts that each exists and that a block marked as a complete
    program other than README's (the test above) holds only lines of its file."""
    named = {}
    for name, lang, before, body in doc_blocks():
        if lang == "python" and (program := named_program(before, body)):
            assert (ROOT / program).is_file(), f"{name} names {program}, which is not there"
            text = (ROOT / program).read_text()
            named[program] = ANY_WORLD in body or ANY_WORLD in text
            if PROGRAM in body and name != "README.md":
                missing = [line for line in code_lines(body) if line not in code_lines(text)]
                assert not missing, f"{name}: lines not in {program}: {missing}"
    return named


def any_world_programs() -> list[str]:
    """The named programs marked to run on any number of processes, but the README's own
    (its commands run examples/quickstart.py at 1 and 2 processes already) and, without the
    optional extra metaddp[hf], those that need transformers."""
    import importlib.util

    readme = " ".join(readme_commands())
    programs = [p for p, any_world in sorted(named_programs().items()) if any_world and p not in readme]
    if importlib.util.find_spec("transformers") is None:
        programs = [p for p in programs if "transformers" not in (ROOT / p).read_text()]
    return programs


def test_every_named_program_exists_and_the_marked_ones_agree_at_1_and_2_processes(ran):
    named = named_programs()
    unnamed = [(name, body.strip().splitlines()[0]) for name, lang, before, body in doc_blocks()
               if lang == "python" and not named_program(before, body)]
    assert not unnamed, f"python blocks that are not a complete program and name none: {unnamed}"
    assert {"examples/algorithms_loop.py", "examples/bilevel_reweight.py", "examples/migration_higher.py",
            "examples/migration_learn2learn.py", "examples/quickstart.py", "examples/algorithms_modes.py",
            "examples/algorithms_hf.py", "examples/algorithms_graphs.py"} <= set(named)
    programs = any_world_programs()
    outcomes = ran["programs"]
    failures = [failure for failure, _ in outcomes if failure]
    assert not failures, "\n\n".join(failures)
    assert len(outcomes) == 2 * len(programs) > 0
    printed = [numbers for _, numbers in outcomes]
    for program, one, two in zip(programs, printed[0::2], printed[1::2]):
        assert one and len(one) == len(two), (program, one, two)
        # float32 sums taken in another order at 2 processes differ by rounding (1e-7
        # relative), which a few optimizer steps amplify to 1e-6 at most in these short runs;
        # 1e-4 relative leaves room for a machine that rounds otherwise, and one unit of the
        # last printed digit for a value that rounds to the other side of it.
        for a, b in zip(one, two):
            unit = 10.0 ** -len(a.split(".")[1])
            assert abs(float(a) - float(b)) <= 1e-4 * abs(float(a)) + unit, (program, one, two)


def test_seed_ddp_refuses_torchrun_in_one_line():
    import os
    import subprocess
    import sys

    for variable in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env = dict(os.environ, **{variable: "0"})
        done = subprocess.run([sys.executable, "examples/seed_ddp.py"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done.stderr
        assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
        assert "not under torchrun" in done.stderr


def shell_commands() -> list[tuple[str, str]]:
    """(file, command) for every line of the shell blocks (no language) of README.md and docs/
    that holds a command (not only a comment), continued lines joined."""
    import shlex

    out = []
    for name, lang, _, body in doc_blocks():
        if lang:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):
                out.append((name, line.strip()))
    return out


def test_every_command_in_a_shell_block_is_one_that_runs(capsys, tmp_path, monkeypatch):
    """Each command line a page shows runs as written: ``metaddp train`` runs with
    ``--show-settings`` (everything a run checks before it starts, nothing trained; in an
    empty folder, and the glyph set a stand-in rather than drawn; a dataset folder ``DIR`` is
    the reader's, so only the data is refused), a resume, and ``metaddp verify`` and
    ``data``, parse; ``make`` targets, extras and scripts exist; the README's ``.venv/bin/``
    commands run in full above. Output and diagrams are ``text`` blocks."""
    import shlex
    import tomllib

    import torch

    from metaddp.cli import build_parser, main
    from metaddp.tasks import _fonts, glyphs

    def stand_in(fonts, *args):  # two alphabets of 30 blank characters, 20 drawers each
        return {"fonts": _fonts.identity(fonts), "alphabets": ["a", "b"], "evaluation": ["b"],
                "alphabet": [0] * 30 + [1] * 30,
                "images": torch.zeros(60, glyphs.DRAWERS, 1, glyphs.SIZE, glyphs.SIZE,
                                      dtype=torch.uint8)}

    monkeypatch.setattr(glyphs, "load", stand_in)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)

    makefile = (ROOT / "Makefile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    commands = shell_commands()
    assert len(commands) >= 30
    checked = 0
    for name, command in commands:
        words = shlex.split(command, comments=True)
        if words[0].startswith(".venv/bin/"):
            continue  # test_every_readme_command_runs_as_written
        if words[0] == "make":
            assert f"\n{words[1]}:" in makefile, (name, command)
        elif words[:3] == ["pip", "install", "-e"]:
            wanted = words[3].split("[")[1].rstrip("]").split(",")
            assert set(wanted) <= set(extras), (name, command)
        elif words[0] == "python":
            assert (ROOT / words[1]).is_file(), (name, command)
        elif words[0] == "torchrun":
            assert words[-1] == "your_script.py" or (ROOT / words[-1]).is_file(), (name, command)
        else:
            assert words[0] == "metaddp", f"{name}: a command this test does not know: {command}"
            args = words[1:]
            resume = "--resume" in args and args[args.index("--resume") + 1] != "auto"
            if args[0] == "train" and not resume and "--data" in args:  # --data DIR
                assert main([*args, "--show-settings"]) == 2, (name, command)
                assert "dataset folder DIR does not exist" in capsys.readouterr().err
            elif args[0] == "train" and not resume:
                assert main([*args, "--show-settings"]) == 0, (name, command)
                assert " on " in capsys.readouterr().out, (name, command)
            else:
                build_parser().parse_args(args)
        checked += 1
    assert checked >= 25
