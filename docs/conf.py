"""Sphinx configuration of agck's API reference, built from the docstrings.

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import agck  # noqa: E402  (after the path, so the checkout is documented, not an installed copy)

project = "agck"
author = "agck contributors"
release = version = agck.__version__

extensions = ["sphinx.ext.autodoc"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = f"agck {release} API reference"
# Docstrings write ``code`` and `name` for names: a single-backquoted name is code, not emphasis.
default_role = "code"
# Many docstrings show code as an indented block: typographic quotes would break it on copying.
smartquotes = False

# The optional dependencies, each imported by one part of agck only. Those missing here are
# mocked, so the pages of the parts that need them still build from their docstrings; but
# agck.dcp and agck.integrations.hf compute tables from torch and transformers when imported,
# so their pages need those two installed (the test extra brings both).
OPTIONAL_IMPORTS = ["torch", "psycopg2", "obstore", "langgraph", "langchain_core", "ormsgpack",
                    "lightning", "transformers", "accelerate"]


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


autodoc_mock_imports = [name for name in OPTIONAL_IMPORTS if not _importable(name)]
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True     # show ``MIN_CHUNKED``, not 65536, where the code says so


def _own_docs_only(app, what, name, obj, options, lines):
    """Keep only what agck's own docstrings say.

    autodoc gives an object without a docstring the one its base class has: a class
    without one would read as its base (FileStore as "Backend interface"), and a method
    implementing another library's interface (DCP's StorageReader, LangGraph's saver,
    Lightning's CheckpointIO) would carry that library's docstring, written in its own
    conventions (Markdown, Google style), which is not reST. Such a method gets a line
    naming the method it implements instead."""
    if what in ("class", "exception"):
        if isinstance(obj, type) and not obj.__dict__.get("__doc__"):
            lines[:] = []
        return
    if what not in ("method", "property") or _own_doc(obj):
        return
    cls_name, _, attr = name.rpartition(".")
    cls = _resolve(cls_name)
    if not isinstance(cls, type):
        return
    for base in cls.__mro__[1:]:
        if attr in base.__dict__ and _own_doc(base.__dict__[attr]):
            if not base.__module__.startswith("agck"):
                lines[:] = [f"Implements ``{base.__module__}.{base.__qualname__}.{attr}``."]
            return


def _own_doc(member) -> bool:
    member = getattr(member, "fget", None) or getattr(member, "__func__", member)
    return bool(getattr(member, "__doc__", None))


def _resolve(dotted: str):
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


# -- the command line: `agck --help` and each command's help, from agck.cli's parser -------------

HELP_WIDTH = "100"     # argparse wraps at $COLUMNS: fixed, so the page is the same on every machine


def _cli_helps() -> list[tuple[str, str]]:
    """(command line, help text) for ``agck`` and each subcommand, in the parser's order."""
    from agck.cli import build_parser

    with _columns(HELP_WIDTH):
        parser = build_parser()
        helps = [("agck --help", parser.format_help())]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    helps.append((f"agck {name} --help", sub.format_help()))
    return helps


@contextlib.contextmanager
def _columns(width: str):
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


class CliHelp(SphinxDirective):
    """``.. agck-cli-help::``: a section per command, holding its ``--help`` output."""

    def run(self):
        out = []
        for command, text in _cli_helps():
            section = nodes.section(ids=[nodes.make_id(command)])
            section += nodes.title("", "", nodes.literal(command, command))
            section += nodes.literal_block(text, text, language="text")
            out.append(section)
        return out


def setup(app):
    app.connect("autodoc-process-docstring", _own_docs_only)
    app.add_directive("agck-cli-help", CliHelp)
    return {"parallel_read_safe": True}
