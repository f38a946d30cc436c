"""The step journal and AppendLogs on encrypted stores (FORMAT.md 18.8).

Each record's value is sealed to its kind, name, key and index; the key (the
fingerprint of a step's inputs) is keyed, so nobody without the key can test which
inputs ran. A marker planted in results, stream items and AppendLog items is in no
byte of the store; a fresh journal replays without running anything; a sealed value
changed (its record's check recomputed, as a forger would) or moved to another record
does not open: it is damage, and its step runs again; an encrypted store appends no
record whose value is in the clear.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

import agck
from agck import journalrec as jr
from agck.errors import UsageError
from agck.journal import inspect_journal
from agck.stores import open_store

from conftest import make_spec, open_spec, reopen_spec

MARK = "AGCK-PLANTED-MARKER-5e1d"
KEY = "correct horse battery staple"


@pytest.fixture(params=["file", "sqlite", "postgres"])
def spec(request, tmp_path):
    return make_spec(request.param, request, tmp_path)


opened, fresh = open_spec, reopen_spec


def stored_bytes(spec, store) -> list[bytes]:
    """Every byte of the store's files, or of its tables' rows as the server returns them."""
    kind, url, opts = spec
    if kind == "file":
        return [open(p, "rb").read() for p in glob.glob(os.path.join(url, "**"), recursive=True) if os.path.isfile(p)]
    if kind == "sqlite":
        return [open(p, "rb").read() for p in glob.glob(url[len("sqlite:///"):] + "*")]
    import io
    import psycopg2
    out = []
    with psycopg2.connect(url) as c, c.cursor() as cur:
        cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename LIKE %s",
                    (opts["schema"], opts["prefix"] + "\\_%"))
        for (t,) in cur.fetchall():
            sink = io.BytesIO()
            cur.copy_expert(f'COPY (SELECT * FROM "{opts["schema"]}"."{t}") TO STDOUT (FORMAT binary)', sink)
            out.append(sink.getvalue())
    return out


def result(x):
    return {"text": MARK * 30, "x": x, "a": np.arange(6) * x}


def items():
    for i in range(4):
        yield {"item": MARK + str(i)}


def test_results_items_and_appendlog_items_are_sealed_and_replay_on_a_fresh_store(spec):
    s = opened(spec, key=KEY)
    j = agck.Journal(s, "run")
    for x in range(6):
        j.step("f", result, x)
    assert list(j.stream("g", items)) == list(items())
    j.close()
    state = {"done": 0, "results": agck.AppendLog(name="results")}
    with agck.Snapshotter(s, "snap", every=10) as snap:
        state = snap.restore(state)
        for i in snap.steps(30):
            state["results"].append({"i": i, "text": MARK})
    s.close()
    for data in stored_bytes(spec, s):
        assert MARK.encode() not in data
    f = fresh(spec, key=KEY)
    ran = []
    j = agck.Journal(f, "run")
    for x in range(6):
        assert j.step("f", lambda x: ran.append(x), x)["x"] == x
    assert list(j.stream("g", lambda: ran.append("g") or iter(()))) == list(items())
    j.close()
    assert ran == []                                          # replayed, nothing ran again
    report = inspect_journal(f, "run")
    assert report["results"] == 6 and not report["damaged"]
    back = agck.Snapshotter(f, "snap", every=10)
    restored = back.restore({"done": 0, "results": agck.AppendLog(name="results")})
    assert back.start_step == 30 and list(restored["results"]) == [{"i": i, "text": MARK} for i in range(30)]
    back.close()


def test_input_fingerprints_are_keyed(spec, request, tmp_path):
    keys = []
    for sp, key in ((spec, KEY), (make_spec("file", request, tmp_path / "other"), os.urandom(32))):
        s = opened(sp, key=key)
        with agck.Journal(s, "run") as j:
            j.step("f", result, 7)
        data, _ = s.log_read("run")
        [(_, e)] = jr.scan(data).entries
        assert e.enc == "x"
        keys.append(e.key)
    assert keys[0] != keys[1] and jr.fingerprint((7,), {}) not in keys


def _rewrite(data: bytes, at: int, body: list) -> bytes:
    """The log with the record at ``at`` replaced by one of ``body``'s fields, its check
    recomputed: what someone who can write the store but holds no key can do."""
    import struct
    (n,) = struct.unpack_from("<I", data, at + 4)
    new = jr.record(*body)
    assert len(new) == jr.OVERHEAD + n
    return data[:at] + new + data[at + jr.OVERHEAD + n:]


def test_a_forged_or_moved_sealed_value_does_not_open_and_its_step_runs_again(tmp_path):
    s = open_store(str(tmp_path / "s"), key=KEY)
    with agck.Journal(s, "run") as j:
        for x in (1, 2):
            j.step("f", result, x)
    path = s.log_ref("run")
    good = open(path, "rb").read()
    (a, ea), (b, eb) = [(off, e) for off, e in jr.scan(good).entries]
    payload = bytearray(ea.payload)
    for i in sorted(set(range(0, 48, 3)) | set(range(48, len(payload), 37)) | {len(payload) - 1}):   # header, text, tag
        bad = bytearray(payload)
        bad[i] ^= 1 << (i % 8)
        with open(path, "wb") as f:
            f.write(_rewrite(good, a, [ea.kind, ea.name, ea.key, ea.index, "x", bytes(bad)]))
        report = inspect_journal(open_store(str(tmp_path / "s"), key=KEY), "run")
        assert len(report["damaged"]) == 1 and "does not decode" in report["damaged"][0]["reason"], i
    # step 2's sealed value moved into step 1's record: it does not open there
    with open(path, "wb") as f:
        f.write(_rewrite(good, a, [ea.kind, ea.name, ea.key, ea.index, "x", eb.payload]))
    ran = []
    with agck.Journal(open_store(str(tmp_path / "s"), key=KEY), "run") as j:
        assert j.step("f", lambda x: ran.append(x) or result(x), 1)["x"] == 1
        assert j.step("f", lambda x: ran.append(x) or result(x), 2)["x"] == 2
        assert j.damaged
    assert ran == [1]                                    # the moved one ran again; the other replayed


def test_an_encrypted_store_appends_no_value_in_the_clear(spec):
    s = opened(spec, key=KEY)
    plain = jr.record("r", "f", bytes(16), 0, "t", b"\xa5" + MARK.encode()[:5])
    sealed = jr.record("r", "f", bytes(16), 0, "t", b"\xc0", sealer=s.sealer)
    for batch in ([plain], [sealed, plain], [sealed + plain], [b"not a record"]):
        with pytest.raises(UsageError, match="sealed"):
            s.log_append("run", batch)
    s.log_append("run", [sealed, jr.record("e", "g", bytes(16), 0, "t", b"\xc0")])
    data, _ = s.log_read("run")
    assert len(jr.scan(data).entries) == 2
