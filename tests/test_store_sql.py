"""What the SQL stores (SQLite and Postgres) share: their rows. A checkpoint's manifest
row and chunk rows, damaged or lost behind the store's back (``Tamper``) and read as
corruption with the row as ref; orphaned rows; the objects table of incremental
checkpoints and its garbage collection, beside writers and after a killed one; the
table prefix. What only one of them has is in test_store_sqlite.py and
test_store_postgres.py; what every backend keeps is in test_store_contract.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from agck import failpoints
from agck.errors import CheckpointExistsError, CorruptCheckpointError, StoreError
from agck.stores import open_store

from conftest import make_spec, pg_prefix
from storehelpers import Tamper, assert_state, state_for

torch = pytest.importorskip("torch")


DB_BACKENDS = ("sqlite", "postgres")


@pytest.fixture(params=DB_BACKENDS)
def db_spec(request, tmp_path):
    return make_spec(request.param, request, tmp_path)


@pytest.fixture(params=[("sqlite", None), ("postgres", "one statement"), ("postgres", "streamed")],
                ids=["sqlite", "postgres", "postgres-streamed"])
def db(request, tmp_path, monkeypatch):
    """A standalone container cut into many chunk rows (incremental checkpoints keep
    only their small listing there; their own tests are further down). Postgres reads
    a container this small with its manifest row in one statement; ``streamed`` makes
    it take the path of a large one (a transaction, then a COPY)."""
    kind, path = request.param
    if path == "streamed":
        from agck.stores.postgres import reads as pgread
        monkeypatch.setattr(pgread, "SMALL_READ_MAX", -1)
    db_spec = make_spec(kind, request, tmp_path)
    _, url, opts = db_spec
    s = open_store(url, chunk_size=1024, incremental=False, **opts)
    t = Tamper(db_spec, s)
    s.put("r", 120, state_for(120, n=1000))          # 4 KiB of floats: several 1 KiB chunks
    yield s, t
    t.close()
    s.close()


def _row(store, table, **kw):
    name = f"{store.prefix}_{table}"
    if getattr(store, "schema", None):
        name = f"{store.schema}.{name}"
    inner = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    return f"{name}({inner})"


# --- a standalone checkpoint: its manifest row and chunk rows -------------------------------------

def test_db_layout(db):
    s, t = db
    assert t.nchunks("r", 120) >= 4
    info = s.list("r")[0]
    assert info.checksum and len(info.checksum) == 16
    assert info.size == sum(len(t.chunk("r", 120, i)) for i in range(t.nchunks("r", 120)))


def test_db_missing_chunk(db):
    s, t = db
    t.sql(f"DELETE FROM {t.chunks} WHERE run = ? AND step = ? AND idx = ?", ("r", 120, 2))
    for verify in (True, False):
        with pytest.raises(CorruptCheckpointError) as e:
            s.read("r", 120, verify=verify)
        assert e.value.ref.endswith(_row(s, "chunks", run="r", step=120, idx=2))
        assert "missing chunk 2" in str(e.value)


def test_db_truncated_chunk(db):
    s, t = db
    t.set_chunk("r", 120, 1, t.chunk("r", 120, 1)[:100])
    with pytest.raises(CorruptCheckpointError) as e:
        s.read("r", 120)
    assert e.value.ref.endswith(_row(s, "chunks", run="r", step=120, idx=1))
    assert "chunk 1 is 100 bytes, expected 1024" in str(e.value)


def test_db_flipped_byte(db):
    s, t = db
    t.flip("r", 120, 10, idx=2)
    with pytest.raises(CorruptCheckpointError) as e:
        s.read("r", 120)
    assert e.value.ref.endswith(_row(s, "manifest", run="r", step=120))
    assert "checksum mismatch" in str(e.value)


def test_db_flipped_byte_in_header_caught_without_verify(db):
    s, t = db
    t.flip("r", 120, 5, idx=0)
    with pytest.raises(CorruptCheckpointError) as e:
        s.read("r", 120, verify=False)
    assert e.value.ref.endswith(_row(s, "manifest", run="r", step=120))


def test_db_manifest_checksum_disagrees(db):
    s, t = db
    t.sql(f"UPDATE {t.manifest} SET checksum = ? WHERE run = ? AND step = ?", ("0" * 16, "r", 120))
    with pytest.raises(CorruptCheckpointError) as e:
        s.read("r", 120)
    assert e.value.ref.endswith(_row(s, "manifest", run="r", step=120))
    assert "checksum mismatch" in str(e.value) and "0000000000000000" in str(e.value)
    with pytest.raises(CorruptCheckpointError):   # the footer check is cheap, so it runs unverified too
        s.read("r", 120, verify=False)


def test_db_manifest_size_disagrees(db):
    s, t = db
    t.sql(f"UPDATE {t.manifest} SET size = size + 1 WHERE run = ? AND step = ?", ("r", 120))
    with pytest.raises(CorruptCheckpointError):
        s.read("r", 120)
    t.sql(f"UPDATE {t.manifest} SET size = 1 << 50, nchunks = 2 WHERE run = ? AND step = ?", ("r", 120))
    with pytest.raises(CorruptCheckpointError):      # refused before allocating a petabyte
        s.read("r", 120)


def test_db_swapped_rows(db):
    s, t = db
    s.put("r", 121, state_for(121, n=1000))
    t.sql(f"DELETE FROM {t.chunks} WHERE run = ? AND step = ?", ("r", 120))
    t.sql(f"DELETE FROM {t.manifest} WHERE run = ? AND step = ?", ("r", 120))
    t.sql(f"UPDATE {t.chunks} SET step = 120 WHERE run = ? AND step = ?", ("r", 121))
    t.sql(f"UPDATE {t.manifest} SET step = 120 WHERE run = ? AND step = ?", ("r", 121))
    with pytest.raises(CorruptCheckpointError) as e:
        s.read("r", 120)
    assert "step 121" in str(e.value)


def test_db_orphans(db):
    s, t = db
    assert s.orphans() == []
    rows = [(c, i) for c, i in ((t.chunk("r", 120, 0), 0),)]
    for data, idx in rows:
        value = data if t.kind == "sqlite" else __import__("psycopg2").Binary(data)
        t.sql(f"INSERT INTO {t.chunks} (run, step, idx, data) VALUES (?, ?, ?, ?)", ("ghost", 7, idx, value))
    assert [o.endswith(_row(s, "chunks", run="ghost", step=7)) for o in s.orphans()] == [True]
    assert s.orphans("r") == []
    assert len(s.clean_orphans()) == 1
    assert s.orphans() == [] and s.steps("r") == [120]


# --- incremental checkpoints: what the tables hold ------------------------------------------------

@pytest.fixture
def inc(db_spec):
    """An incremental SQL store and raw access to its tables."""
    _, url, opts = db_spec
    s = open_store(url, **opts)
    t = Tamper(db_spec, s)
    yield s, t
    t.close()
    s.close()


def _growing(k: int, per: int = 8) -> dict:
    """After k checkpoints of a pipeline that appends ``per`` 64 KiB results each time."""
    rng = np.random.default_rng(11)
    return {"out": [rng.random(16384, dtype=np.float32) for _ in range(k * per)], "k": k,
            "log": [f"item {i}" for i in range(k * per)]}


def test_sql_growing_state_stores_about_the_final_state(inc):
    s, t = inc
    news = []
    for k in range(1, 11):
        s.put("r", k, _growing(k))
        news.append(s.last_put.new_bytes)
        assert t.nchunks("r", k) == 1                        # the listing is small: one chunk row
    final = s.list("r")[-1].size
    held = t.objects_bytes()
    assert final == s.read("r", 10).nbytes                   # list() gives the checkpoint's size, not its listing's
    assert sum(i.size for i in s.list("r")) > 5 * final      # what standalone containers would hold
    assert held < 1.2 * final, (held, final)
    assert max(news[1:]) < 8 * 65536 + 4 * (256 << 10), news  # each put: its new results and a few small chunks
    for k in (1, 5, 10):
        ck = s.read("r", k)
        want = _growing(k)
        assert ck.state["k"] == k and ck.state["log"] == want["log"]
        for a, b in zip(ck.state["out"], want["out"]):
            np.testing.assert_array_equal(a, b)


def test_sql_frozen_tensor_is_stored_once(inc):
    s, t = inc
    model = torch.randn(2 << 20)                              # 8 MiB, never changes
    for k in range(5):
        s.put("r", k, {"model": model, "adapter": torch.full((256,), float(k))})
        if k:
            assert s.last_put.new_bytes < 1 << 20
    assert t.objects_bytes() < 1.1 * model.numel() * 4
    shared = set(t.listed("r", 0)) & set(t.listed("r", 4))
    assert sum(int(t.sql(f"SELECT size FROM {t.objects} WHERE address = ?", (t.blob(a),))[0][0])
               for a in shared) >= model.numel() * 4
    for k in (0, 4):
        ck = s.read("r", k)
        assert torch.equal(ck.state["model"], model) and float(ck.state["adapter"][0]) == k


def test_sql_collect_garbage_removes_exactly_the_unreferenced_objects(inc):
    s, t = inc
    rng = np.random.default_rng(5)
    base = rng.random(300_000)                                # shared by every checkpoint
    states = {k: {"base": base, "own": rng.random(100_000 + k)} for k in range(1, 7)}
    for k, st in states.items():
        s.put("r", k, st)
    assert s.collect_garbage().deleted_chunks == 0           # nothing unreferenced yet
    before = t.object_addresses()
    for k in (2, 3, 5):
        s.delete("r", k)
    assert t.object_addresses() == before                    # delete leaves the objects to the collector
    live = set().union(*(t.listed("r", k) for k in (1, 4, 6)))
    dead = before - live
    dead_bytes = sum(int(t.sql(f"SELECT size FROM {t.objects} WHERE address = ?", (t.blob(a),))[0][0])
                     for a in dead)
    got = s.collect_garbage()
    assert t.object_addresses() == live
    assert (got.deleted_chunks, got.deleted_bytes, got.live_chunks, got.listings) == (len(dead), dead_bytes,
                                                                                       len(live), 3)
    assert s.collect_garbage().deleted_chunks == 0
    for k in (1, 4, 6):
        ck = s.read("r", k)
        np.testing.assert_array_equal(ck.state["base"], base)
        np.testing.assert_array_equal(ck.state["own"], states[k]["own"])


def test_sql_a_damaged_listing_keeps_its_chunks_and_a_newer_one_stops_collection(inc):
    """A verdict of damage deletes nothing: undo the damage and the checkpoint reads whole."""
    import struct
    from agck import format
    s, t = inc
    s.put("r", 1, {"x": np.arange(400_000)})
    s.put("r", 2, {"y": np.arange(400_000) + 1})
    objects = t.object_addresses()
    t.flip("r", 1, 80, idx=0)                          # inside listing 1's metadata
    got = s.collect_garbage()
    assert s.ref("r", 1) in got.damaged + got.unreadable and got.deleted_chunks == 0
    assert t.object_addresses() == objects
    np.testing.assert_array_equal(s.read("r", 2).state["y"], np.arange(400_000) + 1)
    t.flip("r", 1, 80, idx=0)
    np.testing.assert_array_equal(s.read("r", 1).state["x"], np.arange(400_000))
    data = bytearray(t.chunk("r", 2, 0))
    struct.pack_into("<I", data, 8, format.FLAG_CHUNKED | (1 << 14))   # a required flag of a newer agck
    struct.pack_into("<Q", data, 56, format.digest(bytes(data[:56])))
    t.set_chunk("r", 2, 0, bytes(data))
    before = t.object_addresses()
    with pytest.raises(StoreError, match="newer"):
        s.collect_garbage()
    assert t.object_addresses() == before


def test_sql_standalone_checkpoints_keep_no_objects(db_spec):
    _, url, opts = db_spec
    s = open_store(url, incremental=False, **opts)
    t = Tamper(db_spec, s)
    try:
        s.put("r", 1, state_for(1, n=100_000))
        assert t.objects_bytes() == 0 and (t.refs is None or t.sql(f"SELECT count(*) FROM {t.refs}")[0][0] == 0)
        assert s.list("r")[0].size == s.read("r", 1).nbytes
        assert s.collect_garbage().deleted_chunks == 0
        assert_state(s.read("r", 1), 1, n=100_000)
    finally:
        t.close()
        s.close()


def _churn(url: str, opts: dict, worker: int, n: int, errors: list, more=lambda: False, last: dict | None = None
           ) -> None:
    """Puts whose content was just left unreferenced by a delete: what a collector races.
    ``n`` rounds, and on while ``more()`` says so (up to 5n); ``last[worker]``: the last step."""
    s = open_store(url, **opts)
    rng = np.random.default_rng(worker)
    pool = [{"x": rng.random(40_000), "tag": j} for j in range(3)]
    try:
        i = -1
        while i + 1 < n or (more() and i + 1 < 5 * n):
            i += 1
            if last is not None:
                last[worker] = i
            s.put(f"w{worker}", i, pool[i % 3], meta={"i": i})
            if i:
                s.delete(f"w{worker}", i - 1)
            ck = s.read(f"w{worker}", i)
            np.testing.assert_array_equal(ck.state["x"], pool[i % 3]["x"])
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)
    finally:
        s.close()


def test_sql_collector_beside_writers_never_leaves_a_missing_chunk(db_spec):
    kind, url, opts = db_spec
    opts = {**opts, "init": False} if kind == "postgres" else opts
    first = open_store(url, **{**opts, "init": True} if kind == "postgres" else opts)
    errors: list = []
    n = 150
    stop = threading.Event()
    collected = []
    last: dict = {}
    # writers go on past n rounds (up to 5n) until the race was run: ten collections that
    # deleted something between their puts (how often one gets in is up to the scheduler)
    more = lambda: sum(1 for c in collected if c) <= 10   # noqa: E731
    writers = [threading.Thread(target=_churn, args=(url, opts, w, n, errors, more, last)) for w in range(2)]

    def collect():
        g = open_store(url, **opts)            # its own connection
        try:
            while not stop.is_set():
                collected.append(g.collect_garbage().deleted_chunks)
                stop.wait(0.002)    # looping back to back it starved the writers (SQLite: a busy writer sleeps, retries)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            g.close()

    c = threading.Thread(target=collect)
    c.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join(300)
    stop.set()
    c.join(60)
    assert not errors, errors
    assert sum(1 for c in collected if c) > 10     # collections that deleted, between the writers' puts
    t = Tamper(db_spec, first)
    try:
        for w in range(2):
            k = last[w]
            assert first.steps(f"w{w}") == [k] and k >= n - 1
            for a in t.listed(f"w{w}", k):
                assert t.sql(f"SELECT count(*) FROM {t.objects} WHERE address = ?", (t.blob(a),))[0][0] == 1
            assert first.read(f"w{w}", k).state["tag"] == k % 3
    finally:
        t.close()
        first.close()


def test_sql_collector_skips_what_a_writer_in_flight_relies_on(inc, monkeypatch):
    s, t = inc
    x = np.arange(300_000, dtype=np.int64)
    s.put("r", 1, {"x": x})
    s.delete("r", 1)                               # its objects are unreferenced now
    errors = []

    def writer():
        try:
            s2 = open_store(s.url if t.kind == "sqlite" else t.conn.dsn,
                            **({} if t.kind == "sqlite" else {"prefix": s.prefix, "schema": s.schema}))
            s2.put("r", 2, {"x": x})               # the same content: it finds the objects and relies on them
            s2.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    failpoints.configure("sqlite.after_objects=sleep:1.5,pg.after_objects=sleep:1.5")
    paused, times = threading.Event(), {}
    pause = failpoints.hit

    def hit(name):                   # the writer has found the objects and relies on them: now collect
        if name.endswith(".after_objects"):
            paused.set()
        pause(name)

    monkeypatch.setattr(failpoints, "hit", hit)
    try:
        th = threading.Thread(target=lambda: (writer(), times.setdefault("writer done", time.monotonic())))
        th.start()
        assert paused.wait(60), "the writer never reached its objects"
        times["gc began"] = time.monotonic()
        s.collect_garbage()          # SQLite: waits for the writer; Postgres: skips the objects it locked
        th.join(30)
    finally:
        failpoints.configure("")
    assert not errors, errors
    assert times["gc began"] < times["writer done"], "the collection did not overlap the writer's transaction"
    np.testing.assert_array_equal(s.read("r", 2).state["x"], x)
    s.collect_garbage()
    np.testing.assert_array_equal(s.read("r", 2).state["x"], x)


_SQL_KILL_SCRIPT = """
import sys, numpy as np
from agck.stores import open_store
url, opts = sys.argv[1], eval(sys.argv[2])
open_store(url, **opts).put("r", 2, {"x": np.arange(2_000_000)})
print("survived")
"""


def test_sql_writer_killed_after_its_objects_leaves_the_previous_checkpoint(inc, db_spec):
    s, t = inc
    kind, url, opts = db_spec
    s.put("r", 1, {"x": np.arange(100)})
    held = t.object_addresses()
    point = "sqlite.after_objects" if kind == "sqlite" else "pg.after_objects"
    p = subprocess.run([sys.executable, "-c", _SQL_KILL_SCRIPT, url, repr({**opts, "init": False}
                                                                            if kind == "postgres" else opts)],
                       env=dict(os.environ, AGCK_FAILPOINTS=f"{point}=kill"), capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == -9, p.stderr
    assert "survived" not in p.stdout
    assert s.steps("r") == [1] and s.orphans() == []
    np.testing.assert_array_equal(s.read("r", 1).state["x"], np.arange(100))
    # the killed transaction took its objects with it: nothing is left for the collector
    assert t.object_addresses() == held
    assert s.collect_garbage().deleted_chunks == 0
    s.put("r", 2, {"x": np.arange(2_000_000)})
    np.testing.assert_array_equal(s.read("r", 2).state["x"], np.arange(2_000_000))


def test_sql_damaged_or_missing_object_is_corruption(inc):
    from agck.recovery import recover_run
    s, t = inc
    s.put("r", 1, {"x": np.zeros(10)})
    before = t.object_addresses()
    s.put("r", 2, {"x": np.arange(600_000, dtype=np.float64)})
    mine = [a for a in t.listed("r", 2) if a not in before]
    big = max(mine, key=lambda a: t.sql(f"SELECT size FROM {t.objects} WHERE address = ?", (t.blob(a),))[0][0])
    data = bytearray(bytes(t.sql(f"SELECT data FROM {t.objects} WHERE address = ?", (t.blob(big),))[0][0]))
    data[len(data) // 2] ^= 0xFF
    t.sql(f"UPDATE {t.objects} SET data = ? WHERE address = ?", (t.blob(bytes(data)), t.blob(big)))
    with pytest.raises(CorruptCheckpointError) as e:
        s.read("r", 2)
    assert e.value.section == "chunk" and "does not match" in str(e.value)
    assert e.value.ref == s.ref("r", 2)
    rec = recover_run(s, "r")
    assert rec.step == 1 and rec.rejected[0].section == "chunk"
    # a lost row: the tables' own rules are bypassed, as a bad restore or a manual fix would
    if t.refs is not None:
        t.sql(f"DELETE FROM {t.refs} WHERE address = ?", (t.blob(big),))
    t.sql(f"DELETE FROM {t.objects} WHERE address = ?", (t.blob(big),))
    for verify in (True, False):
        with pytest.raises(CorruptCheckpointError, match="missing") as e:
            s.read("r", 2, verify=verify)
        assert e.value.section == "chunk"
    np.testing.assert_array_equal(s.read("r", 1).state["x"], np.zeros(10))


def test_sql_overwrite_and_not_overwrite_keep_refs_straight(inc):
    s, t = inc
    s.put("r", 1, {"x": np.arange(200_000)})
    s.put("r", 1, {"x": np.arange(200_000) * 3})
    with pytest.raises(CheckpointExistsError):
        s.put("r", 1, {"x": np.ones(5)}, overwrite=False)
    if t.refs is not None:
        assert {bytes(a) for (a,) in t.sql(f"SELECT address FROM {t.refs} WHERE run = ? AND step = ?",
                                           ("r", 1))} == set(t.listed("r", 1))
    got = s.collect_garbage()
    assert got.live_chunks == len(set(t.listed("r", 1))) and got.listings == 1
    assert t.object_addresses() == set(t.listed("r", 1))      # the overwritten content is gone
    np.testing.assert_array_equal(s.read("r", 1).state["x"], np.arange(200_000) * 3)
    s.delete("r", 1)
    if t.refs is not None:
        assert t.sql(f"SELECT count(*) FROM {t.refs}")[0][0] == 0
    assert s.collect_garbage().live_chunks == 0 and t.objects_bytes() == 0


# --- table prefixes -------------------------------------------------------------------------------

def test_identifiers_are_matched_whole(db_spec):
    from agck.stores.sqlrows import check_identifier
    _, url, opts = db_spec
    for bad in ("abc\n", "abc\n\n", "\nabc", "ab\u0131", "abc\x00"):
        with pytest.raises(StoreError):
            check_identifier(bad, "table prefix")
        with pytest.raises(StoreError):
            open_store(url, **{**opts, "prefix": bad})
    assert check_identifier("abc_1", "table prefix") == "abc_1"


@pytest.mark.parametrize("length", [35, 36, 41])
def test_parts_of_a_store_with_a_long_prefix(db_spec, length):
    kind, url, opts = db_spec
    prefix = ("p" + pg_prefix())[:8].ljust(length, "x")
    s = open_store(url, **{**opts, "prefix": prefix})
    try:
        parts = s.parts_store(create=True)
        parts.put("r", 1, state_for(1))
        assert_state(parts.read("r", 1), 1)
        assert len(parts.prefix) <= 41 and parts.prefix != s.prefix
        parts.close()
    finally:
        s.close()
