"""The step journal: records (property tests, every byte damaged, torn tails),
fingerprints, steps run once and replayed, streams, durability modes, and a process
SIGKILLed mid-run that resumes without running an acknowledged step again."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import agck
from agck import journalrec as jr
from agck.errors import EncodeError, UsageError
from agck.journal import Journal
from agck.stores import Store

from conftest import make_spec, worker_url

torch = pytest.importorskip("torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

plain = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
                     | st.text() | st.binary(),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
                     | st.tuples(inner, inner), max_leaves=12)


# --- records -------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(values=st.lists(plain, min_size=1, max_size=5), name=st.text(min_size=1, max_size=20))
def test_records_round_trip(values, name):
    """FORMAT.md 17.1: what a writer frames, a reader reads back."""
    key = jr.fingerprint((name,), {})
    log = b"".join(jr.record("i", name, key, i, *jr.encode_value(v)) for i, v in enumerate(values))
    found = jr.scan(log)
    assert found.damaged == [] and not found.torn and found.end == len(log)
    assert [e.index for _, e in found.entries] == list(range(len(values)))
    for (_, e), v in zip(found.entries, values):
        assert (e.kind, e.name, e.key) == ("i", name, key)
        assert jr.decode_value(e) == v


def test_values_with_tensors_are_containers_and_come_back_whole():
    value = {"emb": torch.arange(12, dtype=torch.float16).reshape(3, 4), "ids": np.arange(5), "t": (1, {2})}
    enc, payload = jr.encode_value(value)
    assert enc == "c" and payload[:4] == b"AGCK"
    back = jr.decode_value(jr.Entry("r", "s", b"k" * 16, 0, enc, payload))
    assert torch.equal(back["emb"], value["emb"]) and np.array_equal(back["ids"], value["ids"])
    assert back["t"] == (1, {2})
    assert jr.encode_value({"a": [1, "x"]}) == ("t", agck.codec.plain_packed({"a": [1, "x"]}))


def test_every_damaged_byte_is_found_and_the_rest_is_read():
    """A byte flipped anywhere in a record of the middle: that record is reported
    damaged, every other one reads back, and nothing is taken for a torn tail."""
    recs = [jr.record("r", f"s{i}", bytes(16), 0, *jr.encode_value({"i": i, "pad": "x" * 20})) for i in range(3)]
    log = b"".join(recs)
    start = len(recs[0])
    for off in range(start, start + len(recs[1])):
        bad = bytearray(log)
        bad[off] ^= 0x40
        found = jr.scan(bytes(bad))
        assert [e.name for _, e in found.entries] == ["s0", "s2"], off
        assert [d[0] for d in found.damaged] == [start] and not found.torn, off
        assert found.end == len(log)


def test_a_torn_tail_is_told_apart():
    recs = [jr.record("r", f"s{i}", bytes(16), 0, *jr.encode_value(i)) for i in range(3)]
    log = b"".join(recs)
    whole = len(recs[0]) + len(recs[1])
    for cut in range(whole + 1, len(log)):
        found = jr.scan(log[:cut])
        assert [e.name for _, e in found.entries] == ["s0", "s1"] and found.torn and found.end == whole
        assert found.damaged == []
    assert not jr.scan(log).torn and jr.scan(b"").end == 0


def test_a_record_that_verifies_but_is_malformed_is_damage():
    import msgpack
    import struct
    import xxhash
    body = msgpack.packb(["r", "s", b"short", 0, "t", b"\xc0"])
    head = struct.pack("<4sI", b"AGJR", len(body))
    rec = head + body + struct.pack("<Q", xxhash.xxh3_64_intdigest(head + body))
    found = jr.scan(rec + jr.record("r", "ok", bytes(16), 0, "t", b"\x01"))
    assert [e.name for _, e in found.entries] == ["ok"] and "malformed" in found.damaged[0][1]


def _batches(n=3):
    """A file log of ``n`` batches of one record each, and where each batch starts."""
    batches = [jr.batch(jr.record("r", f"s{i}", bytes(16), 0, *jr.encode_value({"i": i, "pad": "x" * 9})))
               for i in range(n)]
    starts = [sum(len(b) for b in batches[:i]) for i in range(n)]
    return b"".join(batches), starts


def test_rot_in_any_byte_of_any_batch_is_damage_never_a_torn_tail():
    """FORMAT.md 17.7 and 17.8: a whole batch (its checked length all there) that fails is
    damage, the last included: nothing of it is cut off, and every other record reads back."""
    log, starts = _batches()
    for i, start in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else len(log)
        for off in range(start, stop):
            bad = bytearray(log)
            bad[off] ^= 0x10
            found = jr.scan(bytes(bad))
            assert not found.torn and found.end == len(log) and found.damaged, (i, off)
            names = [e.name for _, e in found.entries]
            assert {f"s{k}" for k in range(3) if k != i} <= set(names), (i, off)
            if i == 2:
                assert "cannot tell" in found.damaged[-1][1] or "s2" in names, off


def test_a_torn_batch_is_told_apart_and_its_records_are_not_read():
    """FORMAT.md 17.6 and 17.7: a batch shorter than its checked length says, or zeros where
    it should be, is a torn tail (never acknowledged): cut off, its records not taken, nothing
    reported."""
    log, starts = _batches()
    last = starts[-1]
    for cut in range(last + 1, len(log)):
        for tail in (log[last:cut], log[last:cut] + bytes(len(log) - cut)):    # cut short; zeros after
            found = jr.scan(log[:last] + tail)
            assert [e.name for _, e in found.entries] == ["s0", "s1"], cut
            if len(tail) > cut - last and len(log) - cut < 8:
                # zeros in part of the last check only: told apart from damage to it, or reported
                assert (found.torn and found.end == last) or "cannot tell" in found.damaged[0][1], cut
                continue
            assert found.torn and found.end == last and found.damaged == [], cut
    found = jr.scan(log + bytes(4096))                  # a file grown by a power cut, never written
    assert found.torn and found.end == len(log) and len(found.entries) == 3
    found = jr.scan(log[:last] + b"\x01" + log[last + 1:last + 9])      # cut short after damage: both said
    assert found.torn and found.end == last and found.damaged == [] or found.damaged


def test_in_a_database_or_an_object_every_failure_is_damage():
    """FORMAT.md 17.5: a row or an object is written whole or not at all: a record cut short
    there is damage."""
    log = b"".join(jr.record("r", f"s{i}", bytes(16), 0, "t", b"\x01") for i in range(3))
    for cut in range(len(log) - 20, len(log)):
        found = jr.scan(log[:cut], tears=False)
        assert not found.torn and found.end == cut and found.damaged and len(found.entries) == 2, cut


def test_fingerprints():
    fp = jr.fingerprint
    assert fp((1, "a"), {"x": 2}) == fp((1, "a"), {"x": 2})
    assert fp(({"a": 1, "b": 2},), {}) == fp(({"b": 2, "a": 1},), {})          # a dict's order does not count
    assert fp((), {"a": 1, "b": 2}) == fp((), {"b": 2, "a": 1})
    assert fp(([1, 2],), {}) != fp(((1, 2),), {}) != fp(({1, 2},), {})        # nor is a list a tuple or a set
    assert fp((1,), {}) != fp((True,), {}) != fp((1.0,), {})
    assert fp((), {"a": 1}) != fp(({"a": 1},), {})
    a = np.arange(6, dtype=np.int64)
    assert fp((a,), {}) == fp((a.copy(),), {}) == fp((a[::-1][::-1],), {})
    assert fp((a,), {}) != fp((a.astype(np.int32),), {}) != fp((a.reshape(2, 3),), {})
    b = a.copy()
    b[3] = 99
    assert fp((a,), {}) != fp((b,), {})
    t = torch.arange(6)
    assert fp((t,), {}) == fp((t.clone(),), {}) != fp((t.float(),), {})
    assert fp((torch.zeros(0),), {}) == fp((torch.zeros(0),), {})
    with pytest.raises(EncodeError, match=r"inputs\[1\]\[0\]: cannot fingerprint a builtins.object"):
        fp((object(),), {})
    with pytest.raises(EncodeError, match="array of Python objects"):
        fp((np.array([object()]),), {})


# --- the journal ---------------------------------------------------------------------------

JOURNAL_STORES = ["file", "sqlite", "postgres", "s3"]
SHARED_STORES = ["file", "sqlite", "postgres"]      # claims on steps (an object store has none)


def _store(kind, request, tmp_path):
    _, url, opts = make_spec(kind, request, tmp_path)
    return agck.open_store(url, **opts)


@pytest.mark.parametrize("kind", JOURNAL_STORES)
def test_a_step_runs_once_and_is_read_back(kind, request, tmp_path):
    calls = []

    def embed(doc, scale=1.0):
        calls.append(doc)
        return {"doc": doc, "vec": torch.full((4,), float(len(doc)) * scale)}

    store = _store(kind, request, tmp_path)
    with Journal(store, "r") as j:
        a = j.step("embed", embed, "hello")
        assert torch.equal(j.step("embed", embed, "hello")["vec"], a["vec"])
        j.step("embed", embed, "hello", scale=2.0)               # other inputs: run again
        j.step("other", embed, "hello")                          # another step's name: run again
    assert calls == ["hello"] * 3
    with Journal(store, "r") as j:                              # a new journal, as after a crash
        assert torch.equal(j.step("embed", embed, "hello")["vec"], torch.full((4,), 5.0))
        assert j.step("embed", embed, "hello", scale=2.0)["vec"][0] == 10.0
    assert calls == ["hello"] * 3
    with Journal(store, "other-run") as j:                      # runs keep journals of their own
        j.step("embed", embed, "hello")
    assert calls == ["hello"] * 4
    store.close()


@pytest.mark.parametrize("kind", SHARED_STORES)
def test_shared_journals_see_each_others_results(kind, request, tmp_path):
    store = _store(kind, request, tmp_path)
    a, b = Journal(store, "r", shared=True), Journal(store, "r", shared=True)
    calls = []
    f = lambda x: calls.append(x) or x * 2      # noqa: E731
    assert a.step("f", f, 1) == 2 and b.step("f", f, 1) == 2 and calls == [1]
    lone = Journal(store, "r")                  # not shared: reads the log when it opens
    assert lone.step("f", f, 1) == 2 and calls == [1]
    b.step("f", f, 2)
    assert a.step("f", f, 2) == 4 and calls == [1, 2]
    for j in (a, b, lone):
        j.close()
    store.close()


def test_streams_are_recorded_as_they_come_and_replayed(tmp_path):
    ran = []

    def tokens(prompt, n):
        for i in range(n):
            ran.append(i)
            yield f"{prompt}-{i}"

    with Journal(str(tmp_path), "r") as j:
        assert list(j.stream("gen", tokens, "p", 4)) == ["p-0", "p-1", "p-2", "p-3"]
        assert list(j.stream("gen", tokens, "p", 4)) == ["p-0", "p-1", "p-2", "p-3"]
        it = j.stream("gen", tokens, "q", 5)
        assert [next(it), next(it)] == ["q-0", "q-1"]          # cut short: two items recorded
    assert ran == [0, 1, 2, 3, 0, 1]
    ran.clear()
    with Journal(str(tmp_path), "r") as j:
        assert list(j.stream("gen", tokens, "q", 5)) == ["q-0", "q-1", "q-2", "q-3", "q-4"]
        assert list(j.stream("gen", tokens, "p", 4)) == ["p-0", "p-1", "p-2", "p-3"]
    assert ran == [0, 1, 2, 3, 4]          # q ran again from its start, its first two items dropped


def test_the_decorator(tmp_path):
    j = Journal(str(tmp_path), "r")
    calls = []

    @j
    def square(x):
        calls.append(x)
        return x * x

    @j(name="count")
    def count(n):
        yield from range(n)

    assert [square(3), square(3), square(4)] == [9, 9, 16] and calls == [3, 4]
    assert list(count(3)) == list(count(3)) == [0, 1, 2]
    assert square.__name__ == "square"
    with pytest.raises(UsageError, match="generator function"):
        j.step("g", count.__wrapped__, 3)
    j.close()


def test_what_cannot_be_stored_is_refused_by_name(tmp_path):
    with Journal(str(tmp_path), "r") as j:
        with pytest.raises(EncodeError, match=r"step 'bad': result\['x'\]: .*object"):
            j.step("bad", lambda: {"x": object()})
        with pytest.raises(EncodeError, match="cannot fingerprint"):
            j.step("in", lambda o: 1, object())
        with pytest.raises(UsageError, match="name"):
            j.step("", lambda: 1)
        assert j.recorded == 0
    for bad in ({"commit": "fast"}, {"every": 0}, {"ms": -1}):
        with pytest.raises(UsageError):
            Journal(str(tmp_path), "r", **bad)
    with pytest.raises(UsageError, match="keeps no step journal"):    # a store without journals (s3:// now)
        Store.log_read(agck.open_store(str(tmp_path)), "r")


@pytest.mark.parametrize("kind", JOURNAL_STORES)
def test_group_commit_acknowledges_what_is_on_disk(kind, request, tmp_path):
    store = _store(kind, request, tmp_path)
    j = Journal(store, "r", commit="group", every=10, ms=60_000)
    for i in range(25):
        j.step("s", lambda i: i, i)
    assert j.recorded == 25 and j.last_durable == 20            # two batches of 10 flushed, 5 pending
    data, _ = store.log_read("r")
    assert len(jr.scan(data).entries) == 20
    assert j.flush() == 25 and len(jr.scan(store.log_read("r")[0]).entries) == 25
    j.close()
    timed = Journal(store, "t", commit="group", every=1000, ms=20)
    timed.step("s", lambda: 1)
    import time
    deadline = time.monotonic() + 5
    while timed.last_durable < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert timed.last_durable == 1        # flushed by time, not by count
    timed.close()


def test_a_damaged_record_is_reported_and_its_step_runs_again(tmp_path, caplog):
    calls = []

    def f(x):
        calls.append(x)
        return x + 1

    with Journal(str(tmp_path), "r") as j:
        for x in range(3):
            j.step("f", f, x)
    path = agck.open_store(str(tmp_path)).log_ref("r")
    data = bytearray(open(path, "rb").read())
    second = jr.scan(bytes(data)).entries[1][0]
    data[second + 12] ^= 0xFF
    open(path, "wb").write(bytes(data))
    # at_level: the warning is captured whatever logging state an earlier test left behind
    with caplog.at_level(logging.WARNING, logger="agck.journal"), Journal(str(tmp_path), "r") as j:
        assert [j.step("f", f, x) for x in range(3)] == [1, 2, 3]
        assert len(j.damaged) == 1 and f"byte {second} of the records after position 0" in j.damaged[0]
    assert calls == [0, 1, 2, 1] and "runs again" in caplog.text


def test_a_torn_tail_is_cut_before_the_next_append(tmp_path):
    store = agck.open_store(str(tmp_path))
    with Journal(store, "r") as j:
        j.step("a", lambda: 1)
    path = store.log_ref("r")
    with open(path, "ab") as f:
        f.write(jr.record("r", "b", bytes(16), 0, "t", b"\x02")[:-3])     # a batch cut short by a crash
    with Journal(agck.open_store(str(tmp_path)), "r") as j:
        assert j.step("b", lambda: 2) == 2 and j.damaged == []
        j.step("c", lambda: 3)
    found = jr.scan(open(path, "rb").read())
    assert [e.name for _, e in found.entries] == ["a", "b", "c"] and not found.torn and found.damaged == []


_WORKER = textwrap.dedent("""
    import json, os, sys, time
    import agck
    from agck.journal import Journal
    root, commit, url = sys.argv[1], sys.argv[2], sys.argv[3]
    ran = open(os.path.join(root, "ran.txt"), "a")
    acked = open(os.path.join(root, "acked.txt"), "a")
    def work(i):
        ran.write(f"{i}\\n"); ran.flush()
        return {"i": i, "sq": i * i}
    j = Journal(url, "job", commit=commit, every=7, ms=5)
    for i in range(400):
        assert j.step("work", work, i) == {"i": i, "sq": i * i}
        if commit == "sync":
            acked.write(f"{i}\\n"); acked.flush()
        else:
            acked.write(f"{j.last_durable}\\n"); acked.flush()
        time.sleep(0.001)
    j.close()
    print(json.dumps("done"))
""")


@pytest.mark.parametrize("kind", JOURNAL_STORES)
@pytest.mark.parametrize("commit", ["sync", "group"])
def test_sigkilled_mid_run_resumes_without_running_an_acknowledged_step_again(tmp_path, commit, kind, request):
    """A process SIGKILLed mid-run: started again, no step whose result was acknowledged
    (sync: returned; group: counted in last_durable) runs again, and every step after runs."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "PYTHONPATH": ROOT}
    _, url, opts = make_spec(kind, request, tmp_path)
    agck.open_store(url, **opts).close()     # made once (a Postgres store's tables)
    if kind == "postgres":                   # the worker opens it by its URL alone
        url += ("&" if "?" in url else "?") + f"agck_prefix={opts['prefix']}&agck_schema={opts['schema']}"
    args = [sys.executable, str(script), str(tmp_path), commit, url]
    p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE)
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (tmp_path / "acked.txt").exists() and len((tmp_path / "acked.txt").read_text().split()) > 100:
            break
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    acked = [int(x) for x in (tmp_path / "acked.txt").read_text().split()]
    durable = (max(acked) + 1) if commit == "sync" else max(acked)     # steps 0..durable-1 were acknowledged
    before = len((tmp_path / "ran.txt").read_text().split())
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout) == "done", done.stderr
    rerun = [int(x) for x in (tmp_path / "ran.txt").read_text().split()[before:]]
    assert rerun and min(rerun) >= durable          # no acknowledged step ran again
    assert sorted(set(rerun)) == list(range(min(rerun), 400))


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_damaged_row_is_reported_and_its_step_runs_again(kind, request, tmp_path):
    store = _store(kind, request, tmp_path)
    calls = []
    f = lambda x: calls.append(x) or x + 1       # noqa: E731
    with Journal(store, "r") as j:
        for x in range(3):
            j.step("f", f, x)
    data, _ = store.log_read("r")
    entries = jr.scan(data).entries
    bad = bytearray(data[entries[1][0]:entries[2][0]])
    bad[12] ^= 0xFF
    if kind == "sqlite":
        c = store._db()
        c.execute(f"UPDATE {store._t_log} SET data = ? WHERE run = 'r' AND seq = 2", (bytes(bad),))
        c.commit()
    else:
        with store._cursor() as cur:
            cur.execute(f"UPDATE {store.names.log} SET data = %s WHERE run = 'r' AND seq = 2", (bytes(bad),))
    with Journal(store, "r") as j:
        assert [j.step("f", f, x) for x in range(3)] == [1, 2, 3] and len(j.damaged) == 1
    assert calls == [0, 1, 2, 1]
    store.close()


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_agck_journal_reports_what_each_journal_holds(kind, request, tmp_path, capsys):
    from agck.cli import main
    _, url, opts = make_spec(kind, request, tmp_path)
    store = agck.open_store(url, **opts)
    assert main(["journal", url]) == 0 and "(no journals)" in capsys.readouterr().out
    with Journal(store, "embed") as j:
        for i in range(3):
            j.step("embed", lambda i: {"i": i}, i)
        list(j.stream("gen", lambda n: iter(range(n)), 2))
    assert main(["journal", url]) == 0
    assert "embed: 3 results (embed 3), 1 stream (1 complete), 6 records" in capsys.readouterr().out
    assert main(["journal", url, "--run", "nope"]) == 4 and "journals: embed" in capsys.readouterr().err
    assert main(["journal", url, "--json"]) == 0
    (rep,) = json.loads(capsys.readouterr().out)
    assert (rep["results"], rep["streams_complete"], rep["damaged"], rep["torn_tail"]) == (3, 1, [], False)
    if kind == "file":        # a byte flipped in the second record: reported, exit 1
        path = store.log_ref("embed")
        data = bytearray(open(path, "rb").read())
        second = jr.scan(bytes(data)).entries[1][0]
        data[second + 10] ^= 0xFF
        open(path, "wb").write(bytes(data))
        assert main(["journal", url]) == 1
        out = capsys.readouterr().out
        assert f"DAMAGED at byte {second} of {path}: checksum mismatch" in out and "2 results" in out
        assert "1 damaged record" in out
    store.close()


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_ls_show_verify_and_recover_read_journals(kind, request, tmp_path, capsys):
    """A run that keeps only a journal is listed, shown, verified and recovered; a
    damaged record makes verify and recover exit 1, naming where it is."""
    from agck.cli import main
    _, url, opts = make_spec(kind, request, tmp_path)
    store = agck.open_store(url, **opts)
    store.put("ckpts", 1, {"w": 1})
    with Journal(store, "embed") as j:
        for i in range(4):
            j.step("embed", lambda i: {"i": i}, i)
    state = {"results": agck.AppendLog()}
    with agck.Snapshotter(store, "snap", every=2) as snap:
        state = snap.restore(state)
        for i in snap.steps(4):
            state["results"].append(i)
    line = "4 results (embed 4), 0 streams (0 complete), 4 records"
    assert main(["ls", url]) == 0
    out = capsys.readouterr().out
    assert "embed  journal" in out and line in out and "AppendLog" in out and "ckpts" in out
    assert main(["ls", url, "--run", "embed", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["journal"]["results"] == 4
    assert main(["show", url, "--run", "embed"]) == 0 and line in capsys.readouterr().out
    assert main(["verify", url]) == 0
    assert "3 ok, 0 corrupt; 2 journals: 6 records ok, 0 damaged" in capsys.readouterr().out
    assert main(["recover", url]) == 0
    out = capsys.readouterr().out
    assert f"embed: journal: {line}" in out and "ckpts: last valid step 1" in out and "embed: no checkpoints" not in out
    # a journal-only store still has something to verify and recover
    if kind == "file":
        path = store.log_ref("embed")
        data = bytearray(open(path, "rb").read())
        second = jr.scan(bytes(data)).entries[1][0]
        data[second + 12] ^= 0x01
        open(path, "wb").write(bytes(data))
        assert main(["verify", url, "--run", "embed"]) == 1
        assert f"DAMAGED at byte {second} of {path}" in capsys.readouterr().out
        assert main(["recover", url, "--run", "embed", "--json"]) == 1
        (r,) = json.loads(capsys.readouterr().out)["runs"]
        assert r["journal"]["damaged"][0]["at"] == second and r["step"] is None
        assert main(["show", url, "--run", "embed"]) == 1
    store.close()


_SHARED_WORKER = textwrap.dedent("""
    import json, os, random, sys, time
    from agck.journal import Journal
    root, commit, url, me = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    ran = os.open(os.path.join(root, "ran.txt"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    rng = random.Random(me)
    def work(i):
        os.write(ran, f"{i} {me}\\n".encode())
        time.sleep(rng.random() * 0.002)
        return {"i": i, "by": me, "nonce": rng.random()}
    keys = list(range(120))
    rng.shuffle(keys)
    got = {}
    with Journal(url, "pool", commit=commit, every=5, ms=5, shared=True) as j:
        for i in keys:
            got[i] = j.step("work", work, i)
    print(json.dumps(got))
""")


@pytest.mark.parametrize("kind", SHARED_STORES)
@pytest.mark.parametrize("commit", ["sync", "group"])
def test_workers_sharing_a_run_run_each_step_once(tmp_path, commit, kind, request):
    """Four processes over one run's 120 keys, each in its own order: every step runs
    once between them, and every worker gets the one recorded result of each key."""
    script = tmp_path / "worker.py"
    script.write_text(_SHARED_WORKER)
    url = worker_url(kind, request, tmp_path)
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), commit, url, str(me)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for me in range(4)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    ran = [tuple(map(int, line.split())) for line in (tmp_path / "ran.txt").read_text().splitlines()]
    assert sorted(i for i, _ in ran) == list(range(120))          # each key ran once, in one worker
    by = dict(ran)
    for got in outs:
        assert {int(k): v["by"] for k, v in got.items()} == by
    for k in outs[0]:
        assert len({json.dumps(got[k]) for got in outs}) == 1      # the same result everywhere


_HOLDER = textwrap.dedent("""
    import os, sys, time
    from agck.journal import Journal
    root, url, who = sys.argv[1], sys.argv[2], sys.argv[3]
    def slow():
        open(os.path.join(root, who + ".started"), "w").close()
        if who == "holder":
            time.sleep(600)
        return who
    with Journal(url, "pool", shared=True) as j:
        print(j.step("slow", slow))
""")


@pytest.mark.parametrize("kind", SHARED_STORES)
def test_a_claim_dies_with_its_holder(tmp_path, kind, request):
    """A worker that waits for a step another runs, then sees its holder SIGKILLed,
    runs the step itself (the holder's result was never acknowledged)."""
    import time
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    url = worker_url(kind, request, tmp_path)
    env = {**os.environ, "PYTHONPATH": ROOT}
    holder = subprocess.Popen([sys.executable, str(script), str(tmp_path), url, "holder"], env=env)
    deadline = time.monotonic() + 60
    while not (tmp_path / "holder.started").exists():
        assert time.monotonic() < deadline and holder.poll() is None
        time.sleep(0.01)
    waiter = subprocess.Popen([sys.executable, str(script), str(tmp_path), url, "waiter"], env=env,
                              stdout=subprocess.PIPE, text=True)
    time.sleep(3)
    assert waiter.poll() is None and not (tmp_path / "waiter.started").exists()    # it waits for the holder
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    out, _ = waiter.communicate(timeout=60)
    assert waiter.returncode == 0 and out.strip() == "waiter"


def test_threads_of_one_journal_run_a_step_once(tmp_path):
    import threading
    import time
    calls = []

    def work(i):
        calls.append(i)
        time.sleep(0.001)
        return i * 3

    with Journal(agck.open_store(str(tmp_path / "s")), "r", commit="group") as j:
        got = []

        def worker():
            got.append([j.step("w", work, i % 20) for i in range(60)])
        threads = [threading.Thread(target=worker) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(calls) == list(range(20))
    assert all(g == [(i % 20) * 3 for i in range(60)] for g in got)


def test_a_store_without_claims_refuses_a_shared_journal(tmp_path, request):
    store = agck.open_store("sqlite:///:memory:")
    with pytest.raises(UsageError, match="in-memory SQLite"):
        Journal(store, "r", shared=True)
    store.close()
    store = _store("s3", request, tmp_path)
    with pytest.raises(UsageError, match="cannot share a journal between processes"):
        Journal(store, "r", shared=True)
    store.close()


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres", "s3"])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_an_acknowledged_record_damaged_later_is_reported_by_every_reader(tmp_path, kind, which, request,
                                                                          monkeypatch, capsys):
    """FORMAT.md 17.8 and 17.9. One bit flipped in any of three acknowledged (sync) records, the last included:
    `agck journal` and `agck verify` exit 1 naming it, the journal reports it and runs
    its step again, and nothing of the log is cut off (it was once taken for a torn
    tail: reported as nothing, and truncated by the next append)."""
    from agck.cli import main as cli
    url = worker_url(kind, request, tmp_path)
    with Journal(url, "r") as j:
        for x in range(3):
            j.step("f", lambda x: x + 1, x)
    store = agck.open_store(url)
    data, _ = store.log_read("r")
    start = jr.scan(data, tears=store.log_positions_are_bytes).entries[which][0]
    at = start + jr.OVERHEAD + int.from_bytes(data[start + 4:start + 8], "little") - 3     # in its check
    if kind == "file":
        path = store.log_ref("r")
        raw = bytearray(open(path, "rb").read())
        raw[at] ^= 0x04
        open(path, "wb").write(bytes(raw))
    else:                       # as every reader sees it: the stored batch rotted
        cls, real = type(store), type(store).log_read

        def rotted(self, run, start=0):
            got, end = real(self, run, start)
            if start == 0:
                got = bytearray(got)
                got[at] ^= 0x04
            return bytes(got), end

        monkeypatch.setattr(cls, "log_read", rotted)
    capsys.readouterr()
    assert cli(["journal", url, "--run", "r", "--json"]) == 1
    assert len(json.loads(capsys.readouterr().out)[0]["damaged"]) == 1
    assert cli(["verify", url, "--json"]) == 1
    calls = []
    with Journal(url, "r") as j:
        assert [j.step("f", lambda x: calls.append(x) or x + 1, x) for x in range(3)] == [1, 2, 3]
        assert len(j.damaged) == 1 and calls == [which]
    if kind == "file":          # kept, with the step's new result after it
        assert len(open(path, "rb").read()) > len(raw)
    # healed: its step ran again and was recorded whole, so nothing reports it any more
    capsys.readouterr()
    assert cli(["journal", url, "--run", "r", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)[0]
    assert rep["damaged"] == [] and len(rep["healed"]) == 1
    assert cli(["verify", url, "--json"]) == 0
    with Journal(url, "r") as j:
        assert [j.step("f", lambda x: calls.append(x) or x + 1, x) for x in range(3)] == [1, 2, 3]
        assert j.damaged == [] and calls == [which]


@pytest.mark.parametrize("byte", range(jr.BATCH_HEAD_SIZE))
def test_a_damaged_batch_header_alone_loses_nothing_and_stays_reported(tmp_path, byte, capsys):
    """FORMAT.md 17.9: a bit flipped in any byte of a batch header whose records verify:
    the records are read (no step runs again), and the damage is reported as kind
    `batch` by every reader, before and after more appends (never taken as healed)."""
    from agck.cli import main as cli
    from agck.journal import FRAMING_FATE
    url = str(tmp_path / "s")
    with Journal(url, "r") as j:
        for x in range(3):
            j.step("f", lambda x: x + 1, x)
    store = agck.open_store(url)
    path = store.log_ref("r")
    raw = bytearray(open(path, "rb").read())
    second = jr.scan(bytes(raw)).entries[1][0] - jr.BATCH_HEAD_SIZE
    raw[second + byte] ^= 0x04
    open(path, "wb").write(bytes(raw))
    for appended in range(2):
        capsys.readouterr()
        assert cli(["journal", url, "--run", "r"]) == 1
        assert FRAMING_FATE in capsys.readouterr().out
        assert cli(["journal", url, "--run", "r", "--json"]) == 1
        rep = json.loads(capsys.readouterr().out)[0]
        assert [d["kind"] for d in rep["damaged"]] == ["batch"] and rep["healed"] == [] and rep["results"] == 3 + appended
        assert cli(["verify", url, "--json"]) == 1
        calls = []
        with Journal(url, "r") as j:
            assert [j.step("f", lambda x: calls.append(x) or x + 1, x) for x in range(4)] == [1, 2, 3, 4]
            assert calls in ([], [3]) and len(j.damaged) == 1 and FRAMING_FATE not in j.damaged[0]


def test_rot_in_an_items_index_is_not_taken_for_a_sibling_written_again(tmp_path):
    """FORMAT.md 17.9: a bit flipped in item 0's index makes it read as item 1, which a
    later record holds: it must still be reported (the stream is not whole), and its
    stream runs again; once the stream is whole again it is healed."""
    url = str(tmp_path / "s")

    def items(n):
        yield from range(n)
    with Journal(url, "r") as j:
        assert list(j.stream("g", items, 3)) == [0, 1, 2]
    store = agck.open_store(url)
    path = store.log_ref("r")
    raw = bytearray(open(path, "rb").read())
    off, e = jr.scan(bytes(raw)).entries[0]
    assert e.kind == "i" and e.index == 0
    raw[off + jr.HEAD_SIZE + 1 + 2 + 2 + 18] ^= 1     # array, "i", "g", the key: then the index, 0
    open(path, "wb").write(bytes(raw))
    assert jr.identity_at(bytes(raw), off)[3] == 1
    ran = []

    def counted(n):
        for k in range(n):
            ran.append(k)
            yield k
    with Journal(url, "r") as j:
        assert len(j.damaged) == 1
        assert list(j.stream("g", counted, 3)) == [0, 1, 2] and ran == [0, 1, 2]
    rep = agck.journal.inspect_journal(store, "r")
    assert rep["damaged"] == [] and len(rep["healed"]) == 1


def test_a_step_or_stream_that_calls_itself_is_refused_not_a_hang(tmp_path):
    """Re-entrant calls with the same inputs in one thread would wait for their own result
    forever: each is one UsageError, and the journal goes on working after it."""
    with Journal(str(tmp_path), "r") as j:
        with pytest.raises(UsageError, match="while it runs, in the same thread"):
            j.step("s", lambda x: j.step("s", lambda y: y, x), 0)

        def g(n):
            yield from range(n)

        def again(n):
            yield 0
            yield from j.stream("t", again, n)

        with pytest.raises(UsageError, match="same inputs"):
            list(j.stream("t", again, 3))
        it = j.stream("u", g, 3)
        assert next(it) == 0
        with pytest.raises(UsageError, match="finish"):
            list(j.stream("u", g, 3))
        assert list(it) == [1, 2] and list(j.stream("u", g, 3)) == [0, 1, 2]
        assert j.step("s", lambda x: x + 1, 0) == 1 and j.step("s", lambda x: x + 5, 1) == 6


def test_bad_inputs_and_settings_are_one_clear_error(tmp_path):
    """Each is one AgckError line, never a raw ValueError, RecursionError, RuntimeError,
    UnicodeEncodeError or a flusher thread dying of an OverflowError."""
    deep: list = []
    cur = deep
    for _ in range(5000):
        cur.append([])
        cur = cur[0]
    loop: list = []
    loop.append(loop)
    for bad, what in [((deep,), "deeper"), ((loop,), "deeper"),
                      ((torch.eye(3).to_sparse(),), "sparse"), ((torch.empty(3, device="meta"),), "meta"),
                      ((torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),), "nested")]:
        with pytest.raises(EncodeError, match=what):
            jr.fingerprint(bad, {})
    for a in (np.array(["2026-12-04", "NaT"], dtype="datetime64[s]"), np.timedelta64(5, "ms"),
              np.array([1, 2], dtype="timedelta64[ns]")):
        assert jr.fingerprint((a,), {}) == jr.fingerprint((a.copy(),), {}) != jr.fingerprint((a.astype("int64"),), {})
    for ms in (float("inf"), 1e13, float("nan"), 0):
        with pytest.raises(UsageError, match="ms must be"):
            Journal(str(tmp_path / "x"), "r", commit="group", ms=ms)
    with Journal(str(tmp_path), "u", shared=True) as j:
        assert j.step("lone \udc80 surrogate", lambda: 7) == 7


def test_two_unshared_journals_of_one_run_in_a_process_are_refused(tmp_path):
    with Journal(str(tmp_path), "r") as j:
        with pytest.raises(UsageError, match="already has an open journal"):
            Journal(str(tmp_path), "r")
        j.step("a", lambda: 1)
    with Journal(str(tmp_path), "r") as j:         # once the first is closed: fine
        assert j.step("a", lambda: 2) == 1


def test_a_group_commit_step_that_returns_after_close_is_written(tmp_path):
    """A step still running when another thread closes the journal appends its record
    itself (no flush would come for it): the next journal replays it."""
    import threading
    started, release = threading.Event(), threading.Event()
    j = Journal(str(tmp_path), "r", commit="group", ms=60_000, every=1000)

    def slow():
        started.set()
        release.wait(10)
        return 42

    t = threading.Thread(target=lambda: j.step("slow", slow))
    t.start()
    started.wait(10)
    j.close()
    release.set()
    t.join(10)
    calls = []
    with Journal(str(tmp_path), "r") as again:
        assert again.step("slow", lambda: calls.append(1) or 0) == 42 and calls == []


def test_records_that_verify_but_break_rule_17_2_or_17_3_are_one_damaged_record_each(tmp_path, capsys):
    """FORMAT.md 17.2 and 17.3: an empty name, a result of index 5, an end whose value is
    not nil, and a "c" record holding a chunked container are each one damaged record
    (the log read on past them), never the whole log refused; FORMAT.md 17.4: of two
    records of a key, the first decides."""
    import struct
    import msgpack
    import xxhash
    from agck.cli import main as cli

    def raw(fields):          # a record whose check holds, whatever its fields
        body = msgpack.packb(fields, use_bin_type=True)
        head = struct.pack("<4sI", b"AGJR", len(body))
        return head + body + struct.pack("<Q", xxhash.xxh3_64_intdigest(head + body))

    key = jr.fingerprint((1,), {})
    listing = agck.format.dumps_chunked(run=None, step=None, parent=None, meta=None, addresses=[bytes(32)],
                                        sizes=[10])
    bad = [raw(["r", "", key, 0, "t", b"\x01"]), raw(["r", "s", key, 5, "t", b"\x01"]),
           raw(["e", "s", key, 3, "t", b"\x01"])]
    for rec in bad:
        found = jr.scan(rec + jr.record("r", "ok", key, 0, "t", b"\x02"))
        assert [e.name for _, e in found.entries] == ["ok"] and "malformed" in found.damaged[0][1]
    store = agck.open_store(str(tmp_path))
    store.log_append("r", [raw(["r", "c", key, 0, "c", listing]), jr.record("r", "first", key, 0, "t", b"\x01"),
                           jr.record("r", "first", key, 0, "t", b"\x02")])
    capsys.readouterr()
    assert cli(["journal", str(tmp_path), "--run", "r", "--json"]) == 1       # one damaged record, not exit 2
    [rep] = json.loads(capsys.readouterr().out)
    assert len(rep["damaged"]) == 1 and "chunked container" in rep["damaged"][0]["reason"]
    with Journal(store, "r") as j:
        assert j.step("first", lambda x: 9, 1) == 1
