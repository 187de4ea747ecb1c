"""The layers of src/metaddp, read from its imports: each imports only from the ones below it,
no sub-package reaches into another's private modules, and no module imports itself through
others (an import circle)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = SRC / "metaddp"
SUBPACKAGES = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())
# Bottom up; a layer imports from the layers before it only ("core": the top-level modules).
LAYERS = [{"inner", "forward"}, {"core"}, {"algorithms", "distributed"}, {"bilevel", "data", "functional"},
          {"tasks", "testing"}, {"train"},
          {"cli"}]


def layer(parts: list[str]) -> str:
    if len(parts) == 1:
        return "top"
    return parts[1] if parts[1] in SUBPACKAGES else "core"


def imports() -> list[tuple[list[str], list[str]]]:
    """(importing module, imported module) for every relative import in the package, as dotted
    parts; a package is named by its parts (its ``__init__``)."""
    out = []
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        package = parts[:-1]
        me = package if parts[-1] == "__init__" else parts
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                if node.module:
                    out.append((me, base + node.module.split(".")))
                else:
                    out.extend((me, base + [a.name]) for a in node.names)
    return out


def test_the_layers_are_as_the_readme_says():
    assert set(SUBPACKAGES) | {"core"} == set().union(*LAYERS)
    rank = {name: i for i, names in enumerate(LAYERS) for name in names}
    for me, target in imports():
        mine, theirs = layer(me), layer(target)
        if mine in ("top", theirs) or me[-1] == "__main__":
            continue
        assert rank[theirs] < rank[mine], f"{'.'.join(me)} imports {'.'.join(target)} upward"


def test_no_subpackage_imports_anothers_private_module():
    for me, target in imports():
        other = layer(target)
        if other in ("core", "top", layer(me)):
            continue
        private = [p for p in target[2:] if p.startswith("_")]
        assert not private, f"{'.'.join(me)} imports the private {'.'.join(target)}"


def test_no_import_circle():
    modules = {tuple(p.relative_to(SRC).with_suffix("").parts) for p in ROOT.rglob("*.py")}
    graph: dict[tuple, set[tuple]] = {m: set() for m in modules}

    def module(parts: list[str]) -> tuple | None:
        for candidate in (tuple(parts), tuple(parts + ["__init__"]), tuple(parts[:-1])):
            if candidate in modules:
                return candidate
            if candidate + ("__init__",) in modules:
                return candidate + ("__init__",)
        return None

    for me, target in imports():
        a, b = module(me), module(target)
        if a and b and a != b:
            graph[a].add(b)
    # A package's __init__ re-exports its own modules: an edge from one of its modules back
    # to it is a circle only when that module is imported by the __init__ (always, here).
    seen, on_path = set(), []

    def visit(m):
        if m in on_path:
            circle = on_path[on_path.index(m):] + [m]
            raise AssertionError("import circle: " + " -> ".join(".".join(c) for c in circle))
        if m in seen:
            return
        on_path.append(m)
        for n in graph[m]:
            visit(n)
        on_path.pop()
        seen.add(m)

    for m in sorted(graph):
        visit(m)


def test_at_most_twelve_modules_at_the_top():
    top = sorted(p.name for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 12, top
