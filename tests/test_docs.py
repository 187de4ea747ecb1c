"""The README's one-screen API is the script the tests run (examples/quickstart.py)."""

from pathlib import Path

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
        if line.startswith("mesh = md.Mesh.create("):
            # The script picks a task-group count that fits any world size it is run on.
            assert any(s.startswith("mesh = md.Mesh.create(") for s in script)
            continue
        assert line in script, f"README line not in examples/quickstart.py: {line}"
