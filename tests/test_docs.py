"""The README's table of contents lists every section, in order, with working anchors;
the documents it links to exist."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_readme_contents_list_every_section():
    text = open(os.path.join(ROOT, "README.md")).read()
    body = text[text.index("## Contents"):]
    toc, rest = body.split("\n## ", 1)
    heads = [(len(h), t) for h, t in re.findall(r"^(##|###) (.+)$", "## " + rest, re.M)]
    entries = re.findall(r"^( *)- \[(.+?)\]\(#([^)]+)\)$", toc, re.M)
    assert [(2 + len(ind) // 2, t) for ind, t, _ in entries] == heads
    assert all(a == _anchor(t) for _, t, a in entries)


def test_linked_documents_exist():
    text = open(os.path.join(ROOT, "README.md")).read()
    for doc in set(re.findall(r"\]\(([A-Z]+\.md)\)", text)):
        assert os.path.exists(os.path.join(ROOT, doc)), doc
