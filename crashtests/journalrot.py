"""Fault kind ``journalrot``: one bit of an acknowledged journal record flipped where it is stored.

A trial runs the journal workload (:mod:`crashtests.journalwork`, sync commit: every
record is acknowledged when its call returns) to its end on a store of its own, then
flips one bit of record ``k`` where the store keeps it: in the run's log file, in the
SQLite or Postgres row that holds it, or in the object of its batch. ``k`` goes round
the records from trial to trial (with as many trials as records every record is hit;
the byte within it, its framing included, is drawn). Then:

* every reader must report the damage: ``agck journal --run`` and ``agck verify`` exit 1
  (``agck journal`` naming at least one damaged record), and the resumed journal's
  ``damaged`` is not empty;
* the pipeline resumed on it must see the values of an uninterrupted run, running again
  only the step whose record was damaged (or, for a stream, that stream), and leave
  the journal holding every step;
* after the resume the damage is healed (``agck journal`` and ``agck verify`` exit 0)
  where FORMAT.md 17.9 says it is: the record's step was written again whole and its
  identity still reads as its own. A damaged batch header alone (its records verify:
  nothing runs again) stays reported. A record whose identity rotted may go either
  way (healed only when what it reads as is whole in the log: 17.9), but before the
  resume it must be reported like any other.

A step run again without a report (the damage passed over in silence) is **lost**;
values that differ, damage no reader reports, a step other than the damaged one run
again, or a report that the rules say should (not) stay are **corrupt**.

Contract: :func:`trials` runs ``cfg.n(store, "journalrot")`` trials per journal store
(file, sqlite, postgres, s3), in-process, one after another; each trial's counts go
to ``Trial.load``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging

from . import journalwork
from .checker import Trial
from .trialkit import TrialKit, log

STORES = ("file", "sqlite", "postgres", "s3")
STEPS = 12


def trials(c: TrialKit) -> None:
    cfg = c.cfg
    if not c.starts("journalrot"):
        return
    ref = journalwork.reference(STEPS)
    plan = [(s, i) for s in STORES if s in cfg.stores for i in range(cfg.n(s, "journalrot"))]
    plan = [(s, i) for s, i in plan if s not in ("postgres",) or c.cluster is not None]
    plan = [(s, i) for s, i in plan if s != "s3" or c.s3 is not None]
    log(cfg, f"journal bit-rot trials: {len(plan)}")
    quiet = logging.getLogger("agck.journal")      # each trial's damage is warned about: judged here instead
    level, quiet.level = quiet.level, logging.ERROR
    try:
        _run(c, ref, plan)
    finally:
        quiet.setLevel(level)


def _run(c: TrialKit, ref: str, plan: list) -> None:
    for store, i in plan:
        t = c.new_trial(store, "journalrot", "jr", "")
        if not c.time_left():
            c.skip(t)
            continue
        try:
            trial(c, ref, t, i)
        except Exception as e:
            t.reasons.append(f"harness error: {type(e).__name__}: {e}")
            t.recovered = "raised"


def trial(c: TrialKit, ref: str, t: Trial, i: int) -> None:
    from agck import journalrec as jr
    from agck.journal import Journal
    t.url = c.own.url(t.store)
    ran: list[list[str]] = [[], []]
    acks: list[list[str]] = [[], []]
    with Journal(t.url, t.run, commit="sync") as j:
        journalwork.pipeline(j, STEPS, ran[0].append, acks[0].append)
    store = c.open(t.url)
    try:
        data, _ = store.log_read(t.run)
        found = jr.scan(data, tears=store.log_positions_are_bytes)
        bounds = _record_bounds(data, found)
        k = i % len(bounds)
        lo, hi = bounds[k]
        at = c.rng.randrange(lo, hi)
        bit = 1 << c.rng.randrange(8)
        entry = found.entries[k][1]
        _flip(store, t.run, at, bit)
        rotted, _ = store.log_read(t.run)
    finally:
        store.close()
    # what the rules say follows (FORMAT.md 17.9): a batch header alone loses nothing and stays
    # reported; a record whose identity still reads as its own is healed by its step running
    # again; one whose name or key rotted stays reported after it ran again
    after = jr.scan(rotted, tears=store.log_positions_are_bytes)
    regions = [off for off, _ in after.damaged]
    framing = len(regions) == 1 and jr.framing_only(after, regions[0])
    own = (entry.kind, entry.name, entry.key, entry.index)
    rot_identity = any(jr.identity_at(rotted, off) != own for off in regions)
    stays = framing
    t.reached = True
    t.point = f"record {k + 1}/{len(bounds)} ({entry.kind}), byte {at - lo} of {hi - lo}" + (
        ", its batch header" if framing else ", its identity" if rot_identity else "")
    lost = corrupt = 0
    rc_j, out_j = _cli(["journal", t.url, "--run", t.run, "--json"])
    rc_v, _ = _cli(["verify", t.url, "--json"])
    if rc_j != 1 or not json.loads(out_j)[0]["damaged"] or rc_v != 1:
        corrupt += 1
        t.reasons.append(f"the damage is not reported: agck journal exit {rc_j}, agck verify exit {rc_v}")
    with Journal(t.url, t.run, commit="sync") as j:
        digest = journalwork.pipeline(j, STEPS, ran[1].append, acks[1].append)
        damaged = list(j.damaged)
    if not damaged:
        corrupt += 1
        t.reasons.append("the resumed journal reports nothing damaged")
    again = sorted({lab[:1] + lab[1:].split(".")[0] for lab in ran[1]})
    want = [] if framing else ["r" if entry.kind == "r" else "s"]
    if [a[:1] for a in again] != want:
        if again and not damaged:
            lost += 1
            t.reasons.append(f"steps ran again with no damage reported: {again}")
        else:
            corrupt += 1
            t.reasons.append(f"ran again: {again or 'nothing'}; the damaged record's step alone should "
                             f"({'none: its records verify' if framing else entry.kind + ' ' + entry.name})")
    if digest != ref:
        corrupt += 1
        t.reasons.append(f"the resumed pipeline's values differ from an uninterrupted run's ({digest} != {ref})")
    rc_j2, out_j2 = _cli(["journal", t.url, "--run", t.run, "--json"])
    rc_v2, _ = _cli(["verify", t.url, "--json"])
    rep = json.loads(out_j2)[0] if out_j2 else {"damaged": [], "healed": []}
    if not rot_identity and (rc_j2, rc_v2) != ((1, 1) if stays else (0, 0)) or (rc_j2, rc_v2) not in ((0, 0), (1, 1)):
        corrupt += 1
        t.reasons.append(f"after the resume: agck journal exit {rc_j2}, agck verify exit {rc_v2}; the damage "
                         + ("should stay reported" if stays else "was written again whole and should be healed"))
    t.detail = f"{len(rep['damaged'])} damaged, {len(rep['healed'])} healed after the resume; ran again: " \
               f"{', '.join(again) or 'nothing'}"
    t.load = {"runs": [], "last": None, "acknowledged": len(acks[0]), "lost": lost, "corrupt": corrupt}


def _cli(argv: list[str]) -> tuple[int, str]:
    from agck.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue()


def _record_bounds(data: bytes, found) -> list[tuple[int, int]]:
    """[lo, hi) of each record, with the framing in front of it (a batch header) counted
    in the record after it: every stored byte belongs to one record."""
    from agck import journalrec as jr
    starts = [off for off, _ in found.entries]
    out = []
    for n, off in enumerate(starts):
        lo = starts[n - 1] + jr.OVERHEAD + int.from_bytes(data[starts[n - 1] + 4:starts[n - 1] + 8], "little") \
            if n else 0
        hi = off + jr.OVERHEAD + int.from_bytes(data[off + 4:off + 8], "little")
        out.append((lo, hi))
    assert out and out[-1][1] == len(data), "the records do not cover the log"
    return out


def _flip(store, run: str, at: int, bit: int) -> None:
    """XOR ``bit`` into byte ``at`` of the run's log as :meth:`log_read` returns it, where it is stored."""
    kind = type(store).__name__
    if kind == "FileStore":
        path = store.log_ref(run)
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)[0]
            f.seek(at)
            f.write(bytes([b ^ bit]))
        return
    if kind == "SqliteStore":
        import sqlite3
        conn = sqlite3.connect(store.path)
        try:
            rows = conn.execute(f"SELECT seq, data FROM {store._t_log} WHERE run = ? ORDER BY seq", (run,)).fetchall()
            seq, data, off = _unit(rows, at)
            conn.execute(f"UPDATE {store._t_log} SET data = ? WHERE run = ? AND seq = ?", (_xor(data, off, bit), run, seq))
            conn.commit()
        finally:
            conn.close()
        return
    if kind == "PostgresStore":
        table = store.names.log

        def body(cur):
            cur.execute(f"SELECT seq, data FROM {table} WHERE run = %s ORDER BY seq", (run,))
            seq, data, off = _unit([(s, bytes(d)) for s, d in cur.fetchall()], at)
            cur.execute(f"UPDATE {table} SET data = %s WHERE run = %s AND seq = %s", (_xor(data, off, bit), run, seq))
        store._transaction("BEGIN", None, body, "flip a bit of a journal row", store.log_ref(run))
        return
    if kind == "S3Store":
        seqs = store._journal_seqs(run, 0)
        rows = [(s, bytes(store.c.get(store._journal_key(run, s)))) for s in seqs]
        seq, data, off = _unit(rows, at)
        store.c.put(store._journal_key(run, seq), _xor(data, off, bit))
        return
    raise ValueError(f"no way to damage the journal of a {kind}")


def _unit(rows: list, at: int) -> tuple:
    """(seq, bytes, offset in them) of the stored unit (row, object) holding byte ``at``."""
    pos = 0
    for seq, data in rows:
        if at < pos + len(data):
            return seq, bytes(data), at - pos
        pos += len(data)
    raise ValueError(f"byte {at} lies past the log's {pos} bytes")


def _xor(data: bytes, off: int, bit: int) -> bytes:
    b = bytearray(data)
    b[off] ^= bit
    return bytes(b)
