"""Every size at which agck changes what it does, crossed on every backend.

``agck/thresholds.py`` declares the sizes. For each one, a checkpoint a little
below and a little above it is put (through ``put`` and through a Snapshotter,
incremental and whole), read back through the same store object and a fresh
one, verified by ``agck verify`` and recovered by ``agck recover``, on file,
SQLite, Postgres, s3 (SeaweedFS and moto) and the Postgres catalog over a
bucket. A size constant declared anywhere but there fails :func:`test_every_size_constant_is_declared`.
"""

from __future__ import annotations

import io
import json
import pathlib
import re
import tokenize
import urllib.parse

import numpy as np
import pytest
import torch

import agck
from agck import thresholds
from agck.cli import main as cli_main
from agck.stores import open_store

from conftest import CONTRACT_BACKENDS, make_spec

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(agck.__file__).parent
BELOW = 2 << 10     # the state's tensor this much below a size: its whole container is below it too
ABOVE = 64          # and this much above it


def crossing_sizes() -> list[int]:
    """The tensor sizes that cross every declared size: just below and just above each."""
    out = set()
    for v in thresholds.SIZES:
        out.update((v - min(BELOW, v // 2), v + ABOVE))
    return sorted(out)


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` distinct-looking bytes at memory speed (no two 8-byte words alike, so
    nothing deduplicates), as a uint8 tensor."""
    words = np.arange(nbytes // 8 + 1, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64((seed * 0x2545F4914F6CDD1D + 1) % (1 << 64))
    return torch.from_numpy(words.view(np.uint8)[:nbytes])


def state_of(nbytes: int, seed: int) -> dict:
    return {"w": pattern(nbytes, seed), "i": seed, "note": f"{nbytes} bytes"}


def same(a: dict, b: dict) -> bool:
    return a["i"] == b["i"] and a["note"] == b["note"] and torch.equal(a["w"], b["w"])


def cli_url(kind: str, url: str, opts: dict) -> str:
    """The URL the CLI reaches the store by (Postgres tables and objects as agck_ parameters)."""
    if kind not in ("postgres", "postgres-s3"):
        return url
    extra = {"agck_prefix": opts["prefix"], "agck_schema": opts["schema"]}
    if "objects" in opts:
        extra["agck_objects"] = opts["objects"]
    return url + ("&" if "?" in url else "?") + urllib.parse.urlencode(extra, safe=":/")


def cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = cli_main([str(a) for a in argv])
    return code, capsys.readouterr().out


def check_cli(capsys, url: str, runs: dict[str, int]) -> None:
    """``agck verify`` finds every checkpoint intact; ``agck recover`` takes each run's newest."""
    code, out = cli(capsys, "verify", url, "--json")
    rep = json.loads(out)
    assert code == 0 and rep["corrupt"] == 0 and rep["ok"] == sum(runs.values()), out
    code, out = cli(capsys, "recover", url, "--json")
    assert code == 0, out
    got = {r["run"]: r["step"] for r in json.loads(out)["runs"]}
    assert got == {run: n for run, n in runs.items()}, out


@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "whole"])
@pytest.mark.parametrize("kind", CONTRACT_BACKENDS)
def test_put_round_trip_across_every_size(kind, incremental, request, tmp_path, capsys):
    """One run per size, so that recovery takes each as its run's newest."""
    _, url, opts = make_spec(kind, request, tmp_path)
    opts = {**opts, "incremental": incremental}
    sizes = crossing_sizes()
    with open_store(url, **opts) as s:
        for n in sizes:
            st = state_of(n, n)
            s.put(f"r{n}", 1, st)
            assert same(s.get(f"r{n}", 1).state, st), n
    opts.pop("init", None)
    with open_store(url, **opts) as fresh:
        for n in sizes:
            assert same(fresh.get(f"r{n}", 1).state, state_of(n, n)), n
    check_cli(capsys, cli_url(kind, url, opts), {f"r{n}": 1 for n in sizes})


@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "whole"])
@pytest.mark.parametrize("kind", CONTRACT_BACKENDS)
def test_snapshot_round_trip_across_every_size(kind, incremental, request, tmp_path, capsys):
    """A pipeline whose state grows across every size: each snapshot is restored by
    the next incarnation, through a fresh store object, before it takes its own."""
    _, url, opts = make_spec(kind, request, tmp_path)
    opts = {**opts, "incremental": incremental}
    open_store(url, **opts).close()
    opts.pop("init", None)
    sizes = crossing_sizes()
    prev = None
    for step, n in enumerate(sizes, 1):
        with open_store(url, **opts) as s:
            snap = agck.Snapshotter(s, "grow", every=1, mode="sync", handle_signals=False, capture_rng=False)
            got = snap.restore({"w": None, "i": None, "note": None})
            if prev is None:
                assert snap.start_step == 0
            else:
                assert snap.start_step == step - 1 and same(got, prev), (kind, step - 1)
            st = state_of(n, step)
            snap.snapshot(step, st)
            assert snap.last_durable_step == step
            assert same(s.get("grow", step).state["state"], st), (kind, n)
            snap.close()
            prev = st
    check_cli(capsys, cli_url(kind, url, opts), {"grow": len(sizes)})


def _code_tokens(path: pathlib.Path):
    """(line number, line) of each line of code, strings and comments left out, with the comment."""
    src = path.read_text()
    lines: dict[int, list[str]] = {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
        elif tok.type not in (tokenize.STRING, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            lines.setdefault(tok.start[0], []).append(tok.string)
    return [(n, " ".join(toks), comments.get(n, "")) for n, toks in sorted(lines.items())]


SIZE_EXPR = re.compile(r"<<\s*(10|20|30)\b")


def test_every_size_constant_is_declared():
    """A size written in code (``n << 10``, ``<< 20``, ``<< 30``) outside agck/thresholds.py
    must be marked ``# not a threshold:`` (a limit, a count, a unit); a threshold lives
    in agck/thresholds.py, where the round trips above cross it."""
    undeclared = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "thresholds.py" and path.parent == ROOT:
            continue
        for n, code, comment in _code_tokens(path):
            if SIZE_EXPR.search(code) and "not a threshold:" not in comment:
                undeclared.append(f"{path.relative_to(ROOT.parent)}:{n}: {code}")
    assert not undeclared, "size constants outside agck/thresholds.py:\n" + "\n".join(undeclared)


def test_the_scan_sees_a_new_size(tmp_path):
    """The check itself: a new size constant is found, a marked one is not."""
    p = tmp_path / "m.py"
    p.write_text("X = 3 << 20\nY = 1 << 20   # not a threshold: a count\nZ = '4 << 20'\n")
    found = [n for n, code, comment in _code_tokens(p) if SIZE_EXPR.search(code) and "not a threshold:" not in comment]
    assert found == [1]


def test_every_declared_size_is_crossed():
    """Each declared size has a round-trip size just below and just above it; both
    sides of the smallest ones hold the whole container on that side too."""
    sizes = crossing_sizes()
    assert set(thresholds.ALL.values()) == set(thresholds.SIZES)
    for name, v in thresholds.ALL.items():
        below = [n for n in sizes if v - BELOW <= n < v]
        above = [n for n in sizes if v < n <= v + ABOVE]
        assert below and above, name
    for v in thresholds.SIZES:
        below, above = v - min(BELOW, v // 2), v + ABOVE
        assert len(agck.dumps(state_of(below, 1))) < v < len(agck.dumps(state_of(above, 1))), v


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres", "s3"])
def test_journal_round_trip_across_every_size_up_to_4_mib(kind, request, tmp_path, capsys):
    """Step results (records of one batch each, sync commit) a little below and above each
    size up to 4 MiB, the journal's own (JOURNAL_COPY) included: replayed whole by a new
    journal on a fresh store object, none run again; `agck journal` and `agck verify` find
    nothing damaged."""
    from agck.journal import Journal
    _, url, opts = make_spec(kind, request, tmp_path)
    sizes = [n for n in crossing_sizes() if n <= 4 << 20]
    with open_store(url, **opts) as s, Journal(s, "j") as j:
        for n in sizes:
            assert same(j.step("w", lambda n: state_of(n, n), n), state_of(n, n))
    opts.pop("init", None)
    ran = []
    with open_store(url, **opts) as s, Journal(s, "j") as j:
        for n in sizes:
            assert same(j.step("w", lambda n: ran.append(n) or state_of(n, -1), n), state_of(n, n)), n
        assert ran == [] and j.damaged == []
    where = cli_url(kind, url, opts)
    assert cli(capsys, "journal", where, "--run", "j")[0] == 0
    assert cli(capsys, "verify", where)[0] == 0
