"""The package's import graph: one way, no cycles, and no import that points up a floor
(lazy imports inside functions count).

The floors, bottom up (README, "Layout"): a module may import its own floor and the
ones below, never one above. agck/__init__.py, the public face, sits above them all.
"""

import ast
import pathlib

import agck

ROOT = pathlib.Path(agck.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _edges(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


# (floor, module prefixes): a module's floor is that of its longest matching prefix.
FLOORS = [
    (0, ["agck.errors", "agck.names", "agck.args", "agck.thresholds", "agck.memory", "agck.chunking", "agck.version", "agck.failpoints"]),
    (1, ["agck.format", "agck.durable"]),
    (2, ["agck.codec"]),
    (3, ["agck.checkpoint", "agck.export", "agck.journalrec"]),
    (4, ["agck.stores"]),
    (5, ["agck.recovery", "agck.sharded", "agck.journal", "agck.applog"]),
    (6, ["agck.distributed", "agck.snapshot", "agck.snapshot_run", "agck.capture", "agck.staging", "agck.dcp",
         "agck.integrations"]),
    (7, ["agck.cli", "agck.__main__"]),
    (8, ["agck"]),
]


def floor_of(module: str) -> int:
    best = None
    for floor, prefixes in FLOORS:
        for p in prefixes:
            inside = module == p or (p != "agck" and module.startswith(p + "."))   # the face is itself alone
            if inside and (best is None or len(p) > len(best[1])):
                best = (floor, p)
    assert best is not None, f"{module} is on no floor: add it to FLOORS (and to the README's layout)"
    return best[0]


def test_no_import_points_up_a_floor():
    mods = _modules()
    up = []
    for n, p in sorted(mods.items()):
        for d in sorted(_edges(n, p, set(mods))):
            if floor_of(d) > floor_of(n):
                up.append(f"{n} (floor {floor_of(n)}) imports {d} (floor {floor_of(d)})")
    assert not up, "imports that point up:\n" + "\n".join(up)


def test_the_floor_check_sees_an_upward_import(tmp_path):
    """The check itself: a store importing recovery is reported."""
    fake = tmp_path / "agck" / "stores"
    fake.mkdir(parents=True)
    (tmp_path / "agck" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "base.py").write_text("from .. import recovery\n")
    (tmp_path / "agck" / "recovery.py").write_text("")
    known = {"agck", "agck.stores", "agck.stores.base", "agck.recovery"}
    edges = _edges("agck.stores.base", fake / "base.py", known)
    assert edges == {"agck.recovery"} and floor_of("agck.recovery") > floor_of("agck.stores.base")


def test_import_graph_has_no_cycles():
    mods = _modules()
    graph = {n: _edges(n, p, set(mods)) for n, p in mods.items()}
    # Importing agck.x runs agck/__init__ first, so an edge into the package root is
    # an edge from every module; the public face may import anything, nothing imports it.
    into_root = sorted(n for n, deps in graph.items() if "agck" in deps and n != "agck")
    assert not into_root, f"modules that import the public face (agck/__init__): {into_root}"
    state: dict[str, int] = {}

    def visit(n, path):
        state[n] = 1
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                cycle = path[path.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d, path + [d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
