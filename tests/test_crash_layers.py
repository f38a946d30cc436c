"""The crash harness's import graph (crashtests/): no cycles, and one way up. The fault
kinds' modules (each with ``trials(c)``) import what they share from
:mod:`crashtests.trialkit` and the modules below it, never :mod:`crashtests.campaign`
nor one another; the campaign alone imports them all. Lazy imports inside functions count.

The approach of tests/test_layers.py (the agck package's floors), on crashtests/.
"""

import ast
import pathlib

import crashtests
from test_layers import _edges     # the crashtests modules a module imports, lazily or not

ROOT = pathlib.Path(crashtests.__file__).parent
TOP = "crashtests.campaign"     # runs every fault kind: the one module that imports them all


def _modules() -> dict[str, pathlib.Path]:
    return {("crashtests" if p.name == "__init__.py" else f"crashtests.{p.stem}"): p for p in ROOT.glob("*.py")}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {n: _edges(n, p, set(mods)) for n, p in mods.items()}


def _fault_modules() -> set[str]:
    """The modules of a fault kind: those with a top-level ``trials`` function."""
    return {n for n, p in _modules().items()
            if any(isinstance(d, ast.FunctionDef) and d.name == "trials" for d in ast.parse(p.read_text()).body)}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(n, path):
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d, path + [d])
                if found:
                    return found
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n, [n])
            if found:
                return found
    return None


def test_crashtests_imports_have_no_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_only_the_campaign_imports_the_campaign():
    up = sorted(n for n, deps in _graph().items() if TOP in deps)
    assert not up, f"modules that import {TOP}: {up}"


def test_fault_modules_share_only_the_layer_below():
    graph, faults = _graph(), _fault_modules()
    assert {"crashtests.kill", "crashtests.powerloss", "crashtests.journalrot"} <= faults
    assert faults <= graph[TOP], f"fault modules the campaign does not run: {sorted(faults - graph[TOP])}"
    crossings = sorted(f"{n} imports {d}" for n in faults for d in graph[n] if d in faults)
    assert not crossings, "fault modules importing one another:\n" + "\n".join(crossings)
    assert not sorted(n for n in faults if "crashtests.trialkit" not in graph[n])
    # and the shared modules know no fault kind: they sit below every one
    below = sorted(f"{n} imports {d}" for n in graph if n not in faults and n != TOP for d in graph[n] if d in faults)
    assert not below, "\n".join(below)


def test_the_check_sees_a_cycle_and_a_lazy_import(tmp_path):
    """The check itself: an import inside a function is an edge, and a loop is reported."""
    (tmp_path / "kill.py").write_text("def trials(c):\n    from .campaign import log\n")
    known = {"crashtests", "crashtests.kill", "crashtests.campaign"}
    edges = _edges("crashtests.kill", tmp_path / "kill.py", known)
    assert edges == {"crashtests.campaign"}
    cycle = _cycle({"crashtests.kill": edges, "crashtests.campaign": {"crashtests.kill"}})
    assert cycle is not None and set(cycle) == known - {"crashtests"} and cycle[0] == cycle[-1]
