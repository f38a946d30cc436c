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
    (0, ["agck.errors", "agck.names", "agck.args", "agck.thresholds", "agck.memory", "agck.chunking", "agck.chunkcodec",
         "agck.cipher", "agck.version", "agck.failpoints"]),
    (1, ["agck.format", "agck.durable"]),
    (2, ["agck.codec"]),
    (3, ["agck.checkpoint", "agck.export", "agck.journalrec"]),
    # the stores: what the backends share, the backends (a package each; the catalog over a
    # bucket makes postgres/ use s3/'s chunks), and open_store above them all
    (4.0, ["agck.stores.base", "agck.stores.compression", "agck.stores.content", "agck.stores.damage",
           "agck.stores.encryption", "agck.stores.logclaims", "agck.stores.sqlrows", "agck.stores.metajson",
           "agck.stores.dsn"]),
    (4.1, ["agck.stores.file", "agck.stores.sqlite", "agck.stores.s3"]),
    (4.2, ["agck.stores.postgres"]),
    (4.3, ["agck.stores="]),
    (4.4, ["agck.stores.tiered"]),       # two stores of any backend, opened by URL (open_store)
    (5, ["agck.recovery", "agck.sharded", "agck.journal", "agck.applog"]),
    (6, ["agck.distributed", "agck.replicas", "agck.snapshot", "agck.snapshot_run", "agck.capture", "agck.staging", "agck.dcp",
         "agck.integrations"]),
    (7, ["agck.cli", "agck.__main__"]),
    (8, ["agck="]),
]


def floor_of(module: str) -> float:
    """A prefix ending in "=" is that module alone (a package's face), not what is inside it."""
    best = None
    for floor, prefixes in FLOORS:
        for p in prefixes:
            alone = p.endswith("=")
            p = p.rstrip("=")
            inside = module == p or (not alone and module.startswith(p + "."))
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


BACKENDS = ("file", "sqlite", "s3", "postgres")
# the one crossing: a Postgres catalog keeps its chunks in a bucket (agck_objects)
BACKEND_CROSSINGS = {("postgres", "agck.stores.s3.chunks"), ("postgres", "agck.stores.s3.client")}


def test_each_backend_is_a_package_that_imports_no_other():
    mods = _modules()
    for b in BACKENDS:
        assert f"agck.stores.{b}" in mods and (ROOT / "stores" / b / "__init__.py").exists()
    crossings = set()
    for n, p in mods.items():
        own = n.split(".")[2] if n.startswith("agck.stores.") else None
        if own not in BACKENDS:
            continue
        for d in _edges(n, p, set(mods)):
            other = d.split(".")[2] if d.startswith("agck.stores.") and d.count(".") >= 2 else None
            if other in BACKENDS and other != own:
                crossings.add((own, d))
    assert crossings == BACKEND_CROSSINGS, crossings
    # and the shared modules know no backend: they sit below every one
    shared = [n for n in mods if n.startswith("agck.stores.") and n.split(".")[2] not in BACKENDS]
    for n in shared:
        assert not [d for d in _edges(n, mods[n], set(mods))
                    if d.startswith("agck.stores.") and d.split(".")[2] in BACKENDS], n
