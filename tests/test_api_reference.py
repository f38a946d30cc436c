"""The API reference (docs/): every public name has a docstring and a place on a page,
and the pages build without a warning.

A module's public names are its ``__all__``; a module without one offers the names
its page documents. A name added to ``__all__`` without a docstring, or without a
page that documents it, fails here.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")

# Every module the reference has a page for.
MODULES = [
    "agck", "agck.checkpoint", "agck.errors", "agck.recovery",
    "agck.stores", "agck.stores.file.store", "agck.stores.sqlite.store", "agck.stores.postgres.store",
    "agck.stores.s3.store",
    "agck.snapshot", "agck.journal", "agck.applog", "agck.export",
    "agck.sharded", "agck.distributed", "agck.dcp",
    "agck.integrations.langgraph", "agck.integrations.lightning", "agck.integrations.hf",
    "agck.cli",
]

_DIRECTIVE = re.compile(r"^\.\. (automodule|autoclass|autoexception|autofunction|autodata|automethod|autoattribute)"
                        r"::\s*(\S+)\s*$")
_OPTION = re.compile(r"^:([\w-]+):\s*(.*)$")


def _directives() -> list[dict]:
    """Every autodoc directive of docs/: its kind, target, options and content lines."""
    found = []
    for folder, _, files in os.walk(DOCS):
        if "_build" in os.path.relpath(folder, DOCS).split(os.sep):
            continue
        for name in sorted(files):
            if not name.endswith(".rst"):
                continue
            page = os.path.relpath(os.path.join(folder, name), DOCS)
            lines = open(os.path.join(folder, name), encoding="utf-8").read().splitlines()
            i = 0
            while i < len(lines):
                m = _DIRECTIVE.match(lines[i])
                i += 1
                if not m:
                    continue
                d = {"page": page, "kind": m.group(1), "target": m.group(2), "options": {}, "content": []}
                option = None
                while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                    text = lines[i].strip()
                    i += 1
                    if not text:
                        option = None
                        continue
                    om = _OPTION.match(text)
                    if om and not d["content"]:
                        option = om.group(1)
                        d["options"][option] = om.group(2)
                    elif option is not None and not d["content"]:
                        d["options"][option] += " " + text     # a value continued on the next line
                    else:
                        d["content"].append(text)
                found.append(d)
    return found


def _names(value: str) -> list[str]:
    return [n.strip() for n in value.split(",") if n.strip()]


def _documented() -> dict[tuple[str, str], dict]:
    """(module, name) -> the directive that documents it, for every name on a page."""
    out = {}
    for d in _directives():
        if d["kind"] == "automodule":
            module = d["target"]
            if "members" not in d["options"]:
                continue
            listed = _names(d["options"]["members"])
            names = listed or list(getattr(_module(module), "__all__", []))
            excluded = set(_names(d["options"].get("exclude-members", "")))
            out.update({(module, n): d for n in names if n not in excluded})
        else:
            module, _, name = d["target"].rpartition(".")
            if d["kind"] in ("automethod", "autoattribute"):
                continue
            out[(module, name)] = d
    return out


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.skip(f"{name} cannot be imported here: {e}")
    except Exception as e:   # agck's DependencyError: an integration's framework is missing
        if type(e).__name__.endswith("DependencyError"):
            pytest.skip(f"{name} cannot be imported here: {e}")
        raise


def _public(module: str) -> list[str]:
    names = getattr(_module(module), "__all__", None)
    if names is not None:
        return list(names)
    return sorted(n for m, n in _documented() if m == module)


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_has_a_docstring(module):
    mod = _module(module)
    assert (mod.__doc__ or "").strip(), f"{module} has no module docstring"
    documented = _documented()
    missing = []
    for name in _public(module):
        obj = getattr(mod, name)
        if inspect.isclass(obj):
            doc = obj.__dict__.get("__doc__")            # its own: a class does not inherit its description
        elif inspect.isroutine(obj) or inspect.ismodule(obj):
            doc = obj.__doc__
        else:                                            # a constant: what its page says of it
            directive = documented.get((module, name))
            doc = " ".join(directive["content"]) if directive and directive["kind"] == "autodata" else ""
        if not (doc or "").strip():
            missing.append(name)
    assert not missing, f"public names of {module} without a docstring: {missing}"


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_is_on_a_page(module):
    """Each name of ``__all__`` is documented on a page, under its module or as the same
    object under another name (``agck.Checkpoint`` is ``agck.checkpoint.Checkpoint``)."""
    mod = _module(module)
    documented = _documented()
    objects = set()
    for m, n in documented:
        try:
            objects.add(id(getattr(importlib.import_module(m), n)))
        except (ImportError, AttributeError):
            pass
    absent = [n for n in _public(module)
              if (module, n) not in documented and id(getattr(mod, n)) not in objects]
    assert not absent, f"public names of {module} on no page of docs/: {absent}"


def test_every_page_documents_what_exists():
    """A page that names something that is not there (a name renamed or moved) fails."""
    wrong = []
    for (module, name), d in _documented().items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        except Exception as e:
            if type(e).__name__.endswith("DependencyError"):
                continue
            raise
        if not hasattr(mod, name):
            wrong.append(f"{d['page']}: {module}.{name}")
    assert not wrong


def test_top_level_and_stores_callables_are_documented():
    """``agck`` and ``agck.stores``: every public function and class appears on a page."""
    documented = _documented()
    for module in ("agck", "agck.stores"):
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if callable(obj):
                assert (module, name) in documented, f"{module}.{name} is on no page of docs/"


@pytest.mark.slow
def test_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx")
    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), DOCS, str(tmp_path / "html")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"sphinx -W failed:\n{out.stderr[-6000:]}"
    assert os.path.exists(tmp_path / "html" / "api" / "cli.html")
