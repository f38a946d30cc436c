"""One suite for every store backend (file, sqlite, postgres), plus what is specific to each."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import agck

from agck import failpoints
from agck.errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                         DurabilityError, InvalidRunNameError, SchemaMismatchError, SchemaUninitializedError,
                         StoreConnectionError, StoreError, UsageError)
from agck.stores import open_store

from conftest import make_spec, pg_prefix

torch = pytest.importorskip("torch")

BAD_RUNS = ["../../etc", "/abs", "a\x00b", "", ".hidden", "-x", "a/b", "r'; DROP TABLE x; --", "a" * 201, None, 7]


def state_for(step: int, n: int = 64) -> dict:
    return {"w": np.arange(n, dtype=np.float32) + step, "t": torch.full((4, 3), float(step)),
            "opt": {"lr": 0.1, "betas": (0.9, 0.99)}, "step": step}


def assert_state(ck, step: int, n: int = 64) -> None:
    np.testing.assert_array_equal(ck.state["w"], np.arange(n, dtype=np.float32) + step)
    assert torch.equal(ck.state["t"], torch.full((4, 3), float(step)))
    assert ck.state["opt"] == {"lr": 0.1, "betas": (0.9, 0.99)}
    assert ck.state["step"] == step


# --- the shared suite -------------------------------------------------------------------

def test_round_trip(store):
    state = {
        "model": {"w": torch.randn(16, 8), "b": torch.zeros(8, dtype=torch.float16), "i": torch.arange(5)},
        "np": np.random.default_rng(0).standard_normal((7, 3)),
        "mask": np.array([True, False, True]),
        "nested": [1, "two", (3.0, None), {"k": b"bytes"}],
    }
    meta = {"lr": 3e-4, "tags": ["a", "b"], "blob": b"\x00\x01", 5: "int key"}
    ref = store.put("run-1", 42, state, meta=meta, parent=41)
    assert isinstance(ref, str) and ref == store.ref("run-1", 42)
    ck = store.read("run-1", 42)
    for k, v in state["model"].items():
        assert torch.equal(ck.state["model"][k], v) and ck.state["model"][k].dtype == v.dtype
    np.testing.assert_array_equal(ck.state["np"], state["np"])
    np.testing.assert_array_equal(ck.state["mask"], state["mask"])
    assert ck.state["nested"] == state["nested"]
    assert ck.meta == meta
    assert (ck.run, ck.step, ck.parent) == ("run-1", 42, 41)
    assert store.get("run-1", 42, verify=False).state["nested"] == state["nested"]


def test_list_runs_steps_order(store):
    for run, step in [("b", 10), ("a", 7), ("b", 2), ("a", 100), ("b", 7), ("A", 1)]:
        store.put(run, step, state_for(step), meta={"s": step}, parent=step - 1 if step else None)
    assert store.runs() == ["A", "a", "b"]
    assert store.steps("b") == [2, 7, 10]
    assert store.steps("a") == [7, 100]
    assert store.steps("nope") == []
    # the newest few only, still ascending
    assert store.steps("b", last=1) == [10] and store.steps("b", last=2) == [7, 10]
    assert store.steps("b", last=5) == [2, 7, 10] and store.steps("nope", last=1) == []
    for bad in (0, -1, True, 1.5, "1"):
        with pytest.raises(UsageError, match="last must be a positive integer"):
            store.steps("b", last=bad)
    infos = store.list()
    assert [(i.run, i.step) for i in infos] == [("A", 1), ("a", 7), ("a", 100), ("b", 2), ("b", 7), ("b", 10)]
    for i in infos:
        assert i.size and i.size > 0 and i.ref and i.created_at and i.parent == i.step - 1
        assert i.meta == {"s": i.step}
    assert [i.step for i in store.list("b")] == [2, 7, 10]


def test_get_newest(store):
    pytest.importorskip("agck.recovery", reason="recovery not available")
    for s in (3, 1, 2):
        store.put("r", s, state_for(s))
    ck = store.get("r")
    assert ck.step == 3
    assert_state(ck, 3)
    assert store.get("r", 1).step == 1


def test_overwrite(store):
    store.put("r", 5, state_for(1))
    store.put("r", 5, state_for(2))
    assert_state(store.read("r", 5), 2)
    with pytest.raises(CheckpointExistsError) as e:
        store.put("r", 5, state_for(3), overwrite=False)
    # what the README says: a put replaces by default; overwrite=False is what refused
    assert "a checkpoint already exists at step 5, and overwrite=False refuses to replace it" in str(e.value)
    assert "immutable" not in str(e.value) and e.value.ref == store.ref("r", 5)
    with pytest.raises(CheckpointExistsError, match="at step 5, and overwrite=False"):
        store.put("r", 5, {"big": np.ones(1 << 17)}, overwrite=False)      # chunked where the store chunks
    assert_state(store.read("r", 5), 2)
    assert store.steps("r") == [5]
    store.put("r", 6, state_for(6), overwrite=False)
    assert store.steps("r") == [5, 6]


def test_delete(store):
    store.put("r", 1, state_for(1))
    store.put("r", 2, state_for(2))
    store.delete("r", 1)
    assert store.steps("r") == [2]
    with pytest.raises(CheckpointNotFoundError):
        store.read("r", 1)
    with pytest.raises(CheckpointNotFoundError):
        store.delete("r", 1)
    assert_state(store.read("r", 2), 2)


def test_prune(store):
    for s in range(10):
        store.put("r", s, state_for(s, n=4))
    assert store.prune("r", keep_last=2, before=3) == [0, 1, 2]
    assert store.steps("r") == list(range(3, 10))
    assert store.prune("r", keep_every=3) == [4, 5, 7, 8]
    assert store.steps("r") == [3, 6, 9]
    assert store.prune("r", keep_last=0) == [3, 6]      # the newest valid checkpoint always stays
    assert store.steps("r") == [9]
    assert store.prune("nope", keep_last=1) == []


def test_prune_keeps_newest_valid(store_spec, store):
    for s in range(4):
        store.put("r", s, state_for(s, n=4096))
    corrupt_payload(store_spec, store, "r", 3)
    with pytest.raises(CorruptCheckpointError):
        store.read("r", 3)
    deleted = store.prune("r", keep_last=1)
    assert deleted == [0, 1]
    assert store.steps("r") == [2, 3]


@pytest.mark.parametrize("run", BAD_RUNS, ids=repr)
def test_invalid_run_names(store, run):
    for call in (lambda: store.put(run, 1, {"x": 1}), lambda: store.read(run, 1), lambda: store.steps(run),
                 lambda: store.delete(run, 1), lambda: store.ref(run, 1),
                 lambda: store.list(run if run is not None else "")):
        with pytest.raises(InvalidRunNameError):
            call()
    assert store.runs() == []


@pytest.mark.parametrize("step", ["1", 1.0, -1, True, None, 1 << 63])
def test_invalid_steps(store, step):
    with pytest.raises(AgckError):
        store.put("r", step, {"x": 1})
    with pytest.raises(AgckError):
        store.read("r", step)
    assert store.runs() == []


def test_not_found(store):
    with pytest.raises(CheckpointNotFoundError) as e:
        store.read("r", 1)
    assert e.value.ref and "1" in str(e.value)
    store.put("r", 2, state_for(2))
    with pytest.raises(CheckpointNotFoundError):
        store.read("r", 1)
    with pytest.raises(CheckpointNotFoundError):
        store.get("r", 3)


def test_meta_is_data_not_sql(store):
    evil = {"x": "'); DROP TABLE agck_manifest; --", "y": "$$; DELETE FROM pg_class; $$", "\\": "\x00\u2603"}
    store.put("r", 1, state_for(1), meta=evil)
    store.put("r", 2, state_for(2), meta=["'", '"', "\\x00"])
    assert store.read("r", 1).meta == evil
    assert store.read("r", 2).meta == ["'", '"', "\\x00"]
    assert store.steps("r") == [1, 2]
    assert store.list("r")[1].meta == ["'", '"', "\\x00"]


def test_threads_share_a_store(store):
    errors = []

    def worker(t):
        try:
            for i in range(5):
                step = t * 100 + i
                store.put("r", step, state_for(step))
                assert_state(store.read("r", step), step)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.steps("r") == sorted(t * 100 + i for t in range(6) for i in range(5))
    assert store.orphans() == []


def _process_writer(url: str, opts: dict, worker: int, steps: list[int]) -> None:
    s = open_store(url, **opts)
    try:
        for step in steps:
            s.put("shared", step, state_for(step), meta={"by": worker})
    finally:
        s.close()


def test_processes_write_one_run(store_spec, store):
    _, url, opts = store_spec
    ctx = multiprocessing.get_context("spawn")
    plan = {w: [s for s in range(16) if s % 2 == w] + [100, 101] for w in range(2)}  # 100, 101: both write
    procs = [ctx.Process(target=_process_writer, args=(url, opts, w, steps)) for w, steps in plan.items()]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert store.steps("shared") == list(range(16)) + [100, 101]
    assert len(store.list("shared")) == 18
    for step in store.steps("shared"):
        ck = store.read("shared", step)
        assert_state(ck, step)
        if step < 100:
            assert ck.meta == {"by": step % 2}
    assert store.orphans() == []


# --- tampering with the stored bytes -----------------------------------------------------------

def corrupt_payload(spec, store, run, step):
    """Flip one byte inside the last tensor's data."""
    kind = spec[0]
    if kind == "file":
        path = store.ref(run, step)
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(size - 200)
            b = f.read(1)
            f.seek(size - 200)
            f.write(bytes([b[0] ^ 0xFF]))
    else:
        Tamper(spec, store).flip(run, step, -200)


class Tamper:
    """Direct changes to a database store's rows, as a buggy tool or a bad disk would make."""

    def __init__(self, spec, store):
        self.kind = spec[0]
        self.store = store
        if self.kind == "sqlite":
            self.conn = sqlite3.connect(store.path, isolation_level=None)     # foreign keys off, as by default
            self.chunks, self.manifest, self.p = f"{store.prefix}_chunks", f"{store.prefix}_manifest", "?"
            self.objects, self.refs = f"{store.prefix}_objects", None    # schema 3: no refs table
        else:
            import psycopg2
            self.conn = psycopg2.connect(spec[1])
            self.conn.autocommit = True
            self.chunks, self.manifest, self.p = store.names.chunks, store.names.manifest, "%s"
            self.objects, self.refs = store.names.objects, None     # schema 3: no refs table

    def sql(self, q, args=()):
        cur = self.conn.cursor()
        cur.execute(q.replace("?", self.p), args)
        try:
            return cur.fetchall()
        except Exception:
            return None

    def chunk(self, run, step, idx) -> bytes:
        return bytes(self.sql(f"SELECT data FROM {self.chunks} WHERE run = ? AND step = ? AND idx = ?",
                              (run, step, idx))[0][0])

    def nchunks(self, run, step) -> int:
        return self.sql(f"SELECT nchunks FROM {self.manifest} WHERE run = ? AND step = ?", (run, step))[0][0]

    def flip(self, run, step, offset, idx=None):
        """Flip a byte at ``offset`` of chunk ``idx`` (default: the last one; negative from the end)."""
        if idx is None:
            idx = self.nchunks(run, step) - 1
        if self.kind == "postgres":
            self.sql(f"UPDATE {self.chunks} SET data = set_byte(data, "
                     f"(CASE WHEN ? < 0 THEN length(data) + ? ELSE ? END)::int, "
                     f"get_byte(data, (CASE WHEN ? < 0 THEN length(data) + ? ELSE ? END)::int) # 255) "
                     f"WHERE run = ? AND step = ? AND idx = ?",
                     (offset, offset, offset, offset, offset, offset, run, step, idx))
        else:
            data = bytearray(self.chunk(run, step, idx))
            data[offset] ^= 0xFF
            self.set_chunk(run, step, idx, bytes(data))

    def set_chunk(self, run, step, idx, data: bytes):
        value = data if self.kind == "sqlite" else __import__("psycopg2").Binary(data)
        self.sql(f"UPDATE {self.chunks} SET data = ? WHERE run = ? AND step = ? AND idx = ?", (value, run, step, idx))

    def blob(self, data: bytes):
        return data if self.kind == "sqlite" else __import__("psycopg2").Binary(data)

    def objects_bytes(self) -> int:
        length = "length" if self.kind == "sqlite" else "octet_length"
        return int(self.sql(f"SELECT coalesce(sum({length}(data)), 0) FROM {self.objects}")[0][0])

    def object_addresses(self) -> set[bytes]:
        return {bytes(a) for (a,) in self.sql(f"SELECT address FROM {self.objects}")}

    def listed(self, run, step) -> list[bytes]:
        """The addresses a checkpoint's listing names, read from its chunk rows."""
        from agck import format
        rows = self.sql(f"SELECT data FROM {self.chunks} WHERE run = ? AND step = ? ORDER BY idx", (run, step))
        c = format.open_container(b"".join(bytes(d) for (d,) in rows))
        return format.open_chunked(c).addresses

    def close(self):
        self.conn.close()


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
        from agck.stores import postgres
        monkeypatch.setattr(postgres, "SMALL_READ_MAX", -1)
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


# --- incremental checkpoints in the SQL stores: what the tables hold ----------------------------

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


def test_sql_a_damaged_listing_keeps_nothing_alive_and_a_newer_one_stops_collection(inc):
    import struct
    from agck import format
    s, t = inc
    s.put("r", 1, {"x": np.arange(400_000)})
    s.put("r", 2, {"y": np.arange(400_000) + 1})
    t.flip("r", 1, 80, idx=0)                          # inside listing 1's metadata
    got = s.collect_garbage()
    assert got.damaged == [s.ref("r", 1)] and got.deleted_chunks > 0 and got.listings == 1
    np.testing.assert_array_equal(s.read("r", 2).state["y"], np.arange(400_000) + 1)
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


def _churn(url: str, opts: dict, worker: int, n: int, errors: list) -> None:
    """Puts whose content was just left unreferenced by a delete: what a collector races."""
    s = open_store(url, **opts)
    rng = np.random.default_rng(worker)
    pool = [{"x": rng.random(40_000), "tag": j} for j in range(3)]
    try:
        for i in range(n):
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
    writers = [threading.Thread(target=_churn, args=(url, opts, w, n, errors)) for w in range(2)]
    stop = threading.Event()
    collected = []

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
            assert first.steps(f"w{w}") == [n - 1]
            for a in t.listed(f"w{w}", n - 1):
                assert t.sql(f"SELECT count(*) FROM {t.objects} WHERE address = ?", (t.blob(a),))[0][0] == 1
            assert first.read(f"w{w}", n - 1).state["tag"] == (n - 1) % 3
    finally:
        t.close()
        first.close()


def test_sql_collector_skips_what_a_writer_in_flight_relies_on(inc):
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
    try:
        th = threading.Thread(target=writer)
        th.start()
        time.sleep(0.5)
        s.collect_garbage()          # SQLite: waits for the writer; Postgres: skips the objects it locked
        th.join(30)
    finally:
        failpoints.configure("")
    assert not errors, errors
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


# The tables as schema version 1 made them, and a checkpoint as it wrote one.
_V1_SQLITE = ["CREATE TABLE {p}_schema_version (version INTEGER NOT NULL)",
              """CREATE TABLE {p}_manifest (
                  run TEXT NOT NULL, step INTEGER NOT NULL, parent INTEGER, size INTEGER NOT NULL,
                  checksum TEXT NOT NULL, nchunks INTEGER NOT NULL, created_at REAL NOT NULL, meta TEXT,
                  PRIMARY KEY (run, step))""",
              """CREATE TABLE {p}_chunks (
                  run TEXT NOT NULL, step INTEGER NOT NULL, idx INTEGER NOT NULL, data BLOB NOT NULL,
                  PRIMARY KEY (run, step, idx))""",
              "INSERT INTO {p}_schema_version (version) VALUES (1)"]
_V1_PG = ["CREATE TABLE {p}_schema_version (version int NOT NULL)",
          """CREATE TABLE {p}_manifest (
              run text COLLATE "C" NOT NULL, step bigint NOT NULL CHECK (step >= 0), parent bigint,
              size bigint NOT NULL, checksum text NOT NULL, nchunks int NOT NULL,
              created_at timestamptz NOT NULL DEFAULT now(), meta jsonb, PRIMARY KEY (run, step))""",
          "CREATE INDEX {p}_manifest_meta ON {p}_manifest USING gin (meta)",
          """CREATE TABLE {p}_chunks (
              run text COLLATE "C" NOT NULL, step bigint NOT NULL, idx int NOT NULL, data bytea NOT NULL,
              PRIMARY KEY (run, step, idx))""",
          "ALTER TABLE {p}_chunks ALTER COLUMN data SET STORAGE EXTERNAL",
          "INSERT INTO {p}_schema_version (version) VALUES (1)"]


def _write_v1(exec_sql, blob, p: str, run: str, step: int, state) -> bytes:
    import agck
    from agck import format
    from agck.stores.sqlrows import manifest_checksum
    data = agck.dumps(state, run=run, step=step, meta={"v": 1})
    h = format.parse_header(data)
    pieces = [data[i:i + 4096] for i in range(0, len(data), 4096)]
    for idx, piece in enumerate(pieces):
        exec_sql(f"INSERT INTO {p}_chunks (run, step, idx, data) VALUES (?, ?, ?, ?)", (run, step, idx, blob(piece)))
    exec_sql(f"INSERT INTO {p}_manifest (run, step, parent, size, checksum, nchunks, created_at, meta) "
             f"VALUES (?, ?, NULL, ?, ?, ?, {'1700000000' if p.startswith('agck') else 'now()'}, '{{\"v\": 1}}')",
             (run, step, len(data), manifest_checksum(data[len(data) - h.footer_len:]), len(pieces)))
    return data


def _check_migrated(s, t, old: bytes) -> None:
    from agck import format
    ck = s.read("r", 1)
    assert_state(ck, 1, n=50_000) and ck.version == "1.0" and ck.meta == {"v": 1}
    assert s.list("r")[0].size == len(old)
    s.put("r", 2, state_for(2, n=50_000))
    s.put("r", 3, state_for(2, n=50_000) | {"step": 3})
    assert format.is_chunked(format.parse_header(b"".join(
        bytes(d) for (d,) in t.sql(f"SELECT data FROM {t.chunks} WHERE run = 'r' AND step = 2 ORDER BY idx"))))
    assert s.last_put.new_bytes < 100_000 < t.objects_bytes()          # step 3 shares step 2's content
    assert [i.step for i in s.list("r")] == [1, 2, 3]
    assert s.collect_garbage().deleted_chunks == 0
    assert_state(s.read("r", 2), 2, n=50_000)
    s.delete("r", 1)
    assert_state(s.read("r", 2), 2, n=50_000)


def test_sqlite_migrates_a_version_1_database(tmp_path):
    from agck.stores.sqlite import SCHEMA_VERSION
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for q in _V1_SQLITE:
        conn.execute(q.format(p="agck"))
    old = _write_v1(conn.execute, lambda b: b, "agck", "r", 1, state_for(1, n=50_000))
    conn.close()
    s = open_store(f"sqlite:///{path}", create=False)
    t = Tamper(("sqlite",), s)
    try:
        assert t.sql("SELECT version FROM agck_schema_version") == [(SCHEMA_VERSION,)] and SCHEMA_VERSION == 3
        _check_migrated(s, t, old)
    finally:
        t.close()
        s.close()
    open_store(f"sqlite:///{path}").close()                  # opens again as it is


def _check_v2_listings_kept(s, t, listed: dict, model) -> None:
    """After migrating from schema 2: listings written under it keep their objects alive."""
    got = s.collect_garbage()
    assert got.listings == 2 and got.deleted_chunks == 0 and got.live_chunks == len(listed[1] | listed[2])
    s.delete("r", 1)
    s.collect_garbage()
    assert t.object_addresses() == listed[2]
    np.testing.assert_array_equal(s.read("r", 2).state["model"], model)


def test_sqlite_migrates_a_version_2_database_with_chunked_checkpoints(tmp_path):
    """Schema 2 kept a refs row per listed object; opening it as 3 flags listings and
    drops refs, and listings written under 2 keep their objects alive."""
    path = tmp_path / "v2.db"
    s = open_store(f"sqlite:///{path}")
    t = Tamper(("sqlite",), s)
    model = np.random.default_rng(1).random(200_000)
    try:
        for k in (1, 2):
            s.put("r", k, {"model": model, "k": k})
        listed = {k: set(t.listed("r", k)) for k in (1, 2)}
    finally:
        s.close()
    conn = sqlite3.connect(path, isolation_level=None)       # back to schema 2, as that agck left it
    conn.execute("CREATE TABLE agck_refs (run TEXT NOT NULL, step INTEGER NOT NULL, address BLOB NOT NULL, "
                 "PRIMARY KEY (run, step, address)) WITHOUT ROWID")
    conn.executemany("INSERT INTO agck_refs VALUES (?, ?, ?)", [("r", k, a) for k in listed for a in listed[k]])
    conn.execute("ALTER TABLE agck_manifest DROP COLUMN listing")
    conn.execute("UPDATE agck_schema_version SET version = 2")
    conn.close()
    s = open_store(f"sqlite:///{path}")
    t = Tamper(("sqlite",), s)
    try:
        assert t.sql("SELECT version FROM agck_schema_version") == [(3,)]
        assert t.sql("SELECT count(*) FROM sqlite_master WHERE name = 'agck_refs'") == [(0,)]
        _check_v2_listings_kept(s, t, listed, model)
    finally:
        t.close()
        s.close()


def test_pg_migrates_a_version_1_schema(pg_dsn, pg_schema):
    import psycopg2
    from agck.stores.postgres import PostgresStore
    prefix = pg_prefix()
    conn = psycopg2.connect(pg_dsn)
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute(f"SET search_path = {pg_schema}")
    for q in _V1_PG:
        cur.execute(q.format(p=prefix))
    old = _write_v1(lambda q, a: cur.execute(q.replace("?", "%s"), a), psycopg2.Binary, prefix, "r", 1,
                    state_for(1, n=50_000))
    conn.close()
    with pytest.raises(SchemaMismatchError, match="agck db migrate"):
        PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema)
    with pytest.raises(SchemaMismatchError, match="agck db migrate"):
        PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema, init=True)    # init never migrates
    raw = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema, check_schema=False)
    assert raw.schema_status()["state"] == "outdated"
    assert raw.migrate() == [2, 3] and raw.migrate() == []
    raw.close()
    s = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema)
    t = Tamper(("postgres", pg_dsn), s)
    try:
        assert s.schema_status()["state"] == "current"
        _check_migrated(s, t, old)
    finally:
        t.close()
        s.close()


def test_pg_migrates_a_version_2_schema_with_chunked_checkpoints(pg_dsn, pg_schema):
    """Schema 2 kept a refs row per listed object; 3 flags listings on the manifest
    and drops refs. Listings written under 2 keep their objects alive after it."""
    import psycopg2
    from agck.stores.postgres import PostgresStore
    prefix = pg_prefix()
    s = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema, init=True)
    t = Tamper(("postgres", pg_dsn), s)
    model = np.random.default_rng(1).random(200_000)
    try:
        for k in (1, 2):
            s.put("r", k, {"model": model, "k": k})
        listed = {k: set(t.listed("r", k)) for k in (1, 2)}
        n = s.names
        # back to schema 2 as that version of agck left it: refs rows, no listing column
        t.sql(f"CREATE TABLE {n.refs} (run text COLLATE \"C\" NOT NULL, step bigint NOT NULL, "
              f"address bytea NOT NULL, PRIMARY KEY (run, step, address), "
              f"FOREIGN KEY (run, step) REFERENCES {n.manifest} (run, step) ON DELETE CASCADE, "
              f"FOREIGN KEY (address) REFERENCES {n.objects} (address))")
        for k, addrs in listed.items():
            for a in addrs:
                t.sql(f"INSERT INTO {n.refs} (run, step, address) VALUES (?, ?, ?)", ("r", k, psycopg2.Binary(a)))
        t.sql(f"ALTER TABLE {n.manifest} DROP COLUMN listing")
        t.sql(f"UPDATE {n.version} SET version = 2")
    finally:
        s.close()
    with pytest.raises(SchemaMismatchError, match="agck db migrate"):
        PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema)
    raw = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema, check_schema=False)
    assert raw.migrate() == [3] and raw.migrate() == []
    raw.close()
    s = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema)
    try:
        assert t.sql(f"SELECT to_regclass('{pg_schema}.{prefix}_refs') IS NULL")[0][0]
        _check_v2_listings_kept(s, t, listed, model)
    finally:
        t.close()
        s.close()


def test_pg_writers_sending_the_same_new_objects_both_commit(pg, pg_dsn):
    """A writer whose objects another transaction is inserting waits for it, and on
    its commit carries on without them."""
    import psycopg2
    from agck import checkpoint
    from agck.stores import content
    state = {"x": np.arange(300_000, dtype=np.int64)}
    plan = content.plan_chunks(checkpoint.encode(state, run="r", step=1))
    a = max(plan.distinct, key=lambda a: plan.chunk(a).nbytes)    # tensor bytes: the same in the put
    view = plan.chunk(a).view()
    other = psycopg2.connect(pg_dsn)
    cur = other.cursor()
    cur.execute(f"INSERT INTO {pg.names.objects} (address, size, data) VALUES (%s, %s, %s)",
                (psycopg2.Binary(a), view.nbytes, psycopg2.Binary(bytes(view))))   # not committed yet
    errors = []

    def put():
        try:
            pg.put("r", 1, state)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    th = threading.Thread(target=put)
    th.start()
    watch = psycopg2.connect(pg_dsn)
    watch.autocommit = True
    deadline, waited = time.monotonic() + 20, False
    while not waited and time.monotonic() < deadline:     # until the put waits on the uncommitted row
        wc = watch.cursor()
        wc.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'agck' "
                   "AND wait_event_type = 'Lock'")
        waited = wc.fetchone()[0] > 0
        time.sleep(0.02)
    other.commit()
    th.join(30)
    other.close()
    watch.close()
    assert waited and not errors, errors
    np.testing.assert_array_equal(pg.read("r", 1).state["x"], state["x"])
    assert pg.collect_garbage().deleted_chunks == 0           # the other transaction's object is the one listed


@pytest.mark.parametrize("point", ["before_insert", "after_objects", "before_commit"])
def test_sqlite_fail_points(tmp_path, point):
    s = open_store(f"sqlite:///{tmp_path}/f.db", min_chunked=0)
    s.put("r", 1, state_for(1))
    failpoints.configure(f"sqlite.{point}=raise")
    try:
        with pytest.raises(DurabilityError):
            s.put("r", 1, state_for(9))
        with pytest.raises(DurabilityError):
            s.put("r", 2, state_for(2))
    finally:
        failpoints.configure("")
    assert s.steps("r") == [1]
    assert_state(s.read("r", 1), 1)
    s.put("r", 2, state_for(2))
    assert s.steps("r") == [1, 2] and s.orphans() == []


def test_sqlite_urls(tmp_path):
    from agck.stores.sqlite import SqliteStore
    s = open_store(f"sqlite:///{tmp_path}/a.db")
    assert isinstance(s, SqliteStore) and s.path == f"{tmp_path}/a.db" and s.url == f"sqlite:///{tmp_path}/a.db"
    assert s._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 2     # FULL
    m = open_store("sqlite:///:memory:")
    m.put("r", 1, state_for(1))
    assert_state(m.read("r", 1), 1)
    with pytest.raises(StoreConnectionError):
        open_store(f"sqlite:///{tmp_path}/no/such/dir/a.db")
    (tmp_path / "junk.db").write_bytes(b"not a database" * 100)
    with pytest.raises(StoreConnectionError):
        open_store(f"sqlite:///{tmp_path}/junk.db")


def test_sqlite_schema_version(tmp_path):
    s = open_store(f"sqlite:///{tmp_path}/v.db")
    s._conn.execute("UPDATE agck_schema_version SET version = 99")
    s.close()
    with pytest.raises(SchemaMismatchError):
        open_store(f"sqlite:///{tmp_path}/v.db")


# --- Postgres only ------------------------------------------------------------------------------

@pytest.fixture
def pg(pg_dsn, pg_schema):
    from agck.stores.postgres import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, chunk_size=4096,
                      min_chunked=0)   # small checkpoints chunked too: each write path is taken
    yield s
    s.close()


def test_pg_reconnect_forgets_which_objects_the_database_holds(pg_dsn, pg_schema):
    """After a reconnect a put asks again which objects the database holds: a failover
    or a restore may have lost ones this store object saw committed."""
    from agck.stores.postgres import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True)
    try:
        x = np.arange(300_000, dtype=np.int64)
        s.put("r", 1, {"x": x})
        admin = _autocommit(pg_dsn)
        admin.cursor().execute(f"DELETE FROM {pg_schema}.{s.prefix}_objects")    # the database lost them
        admin.close()
        s._conn.close()                  # and the connection went with it
        s.put("r", 2, {"x": x})          # the same content: sent again
        assert np.array_equal(s.read("r", 2).state["x"], x)
    finally:
        s.close()


@pytest.mark.parametrize("incremental", [False, True])
def test_pg_server_errors_at_commit_are_not_called_ambiguous(pg_dsn, pg_schema, incremental):
    """A lock timeout (the server's verdict: rolled back) is a plain write failure, not
    'may or may not have been written', and the store goes on working. (A standalone
    checkpoint's statements and COMMIT travel in one exchange with its COPY.)"""
    from agck.stores.postgres import PostgresStore
    pg = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, incremental=incremental)
    pg.put("r", 0, state_for(0))
    holder = _autocommit(pg_dsn)
    holder.cursor().execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (pg._row_lock_key("r", 1),))
    pg._conn.cursor().execute("SET lock_timeout = 200")
    try:
        with pytest.raises(DurabilityError) as ei:
            pg.put("r", 1, state_for(1))
        assert "lock timeout" in str(ei.value) and "may or may not" not in str(ei.value)
    finally:
        holder.close()
        pg._conn.cursor().execute("RESET lock_timeout")
    pg.put("r", 1, state_for(1))
    assert pg.steps("r") == [0, 1]
    pg.close()


def test_pg_epoch_before_any_begin_epoch_is_stale(pg):
    with pytest.raises(agck.StaleEpochError):
        pg.put("r", 1, state_for(1), epoch=1)
    pg.put("r", 1, state_for(1))        # the connection is fine


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


def test_sqlite_failed_commit_leaves_no_transaction_open():
    from agck.stores.sqlite import _immediate

    class Conn:
        in_transaction = False

        def __init__(self):
            self.log = []

        def execute(self, sql):
            self.log.append(sql)
            if sql == "BEGIN IMMEDIATE":
                self.in_transaction = True
            elif sql == "COMMIT":
                raise sqlite3.OperationalError("disk I/O error")     # SQLite leaves the transaction open
            elif sql == "ROLLBACK":
                self.in_transaction = False

    c = Conn()
    with pytest.raises(sqlite3.OperationalError):
        with _immediate(c):
            pass
    assert c.log == ["BEGIN IMMEDIATE", "COMMIT", "ROLLBACK"] and not c.in_transaction


def _autocommit(dsn):
    import psycopg2
    c = psycopg2.connect(dsn)
    c.autocommit = True
    return c


_KILL_SCRIPT = """
import sys, numpy as np
from agck.stores import open_store
s = open_store(sys.argv[1], prefix=sys.argv[2], schema=sys.argv[3], chunk_size=4096)
s.put("r", 1, {"w": np.ones(100_000, dtype=np.float32)})
print("survived")
"""


@pytest.mark.parametrize("point", ["pg.before_copy", "pg.after_objects", "pg.mid_copy", "pg.before_manifest",
                                   "pg.before_commit"])
def test_pg_client_killed_leaves_nothing(pg, pg_dsn, point):
    pg.put("r", 0, state_for(0))
    env = dict(os.environ, AGCK_FAILPOINTS=f"{point}=kill")
    p = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, pg_dsn, pg.prefix, pg.schema], env=env,
                       capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == -9, p.stderr
    assert "survived" not in p.stdout
    assert pg.steps("r") == [0]
    assert pg.orphans() == []
    with pytest.raises(CheckpointNotFoundError):
        pg.read("r", 1)
    pg.put("r", 1, state_for(1))          # the dead client's lock is gone with its transaction
    assert_state(pg.read("r", 1), 1)


@pytest.mark.parametrize("point", ["pg.before_copy", "pg.after_objects", "pg.mid_copy", "pg.before_manifest",
                                   "pg.before_commit"])
def test_pg_fail_points_roll_back(pg, point):
    pg.put("r", 1, state_for(1, n=5000))
    failpoints.configure(f"{point}=raise")
    try:
        with pytest.raises(DurabilityError) as e:
            pg.put("r", 1, state_for(9, n=5000))
        assert "fail point" in str(e.value) and e.value.ref == pg.ref("r", 1)
        with pytest.raises(DurabilityError):
            pg.put("r", 2, state_for(2, n=5000))
    finally:
        failpoints.configure("")
    assert pg.steps("r") == [1]
    assert_state(pg.read("r", 1), 1, n=5000)
    assert pg.orphans() == []
    pg.put("r", 2, state_for(2))
    assert pg.steps("r") == [1, 2]


def _pg_open_repeatedly(dsn: str, prefix: str, schema: str, n: int) -> None:
    from agck.stores.postgres import PostgresStore
    for _ in range(n):
        PostgresStore(dsn, prefix=prefix, schema=schema, init=True).close()


def test_pg_init_races_puts_without_deadlock(pg, pg_dsn, pg_schema):
    # Processes that open the store with init=True while others put: init on a
    # complete schema must take no table locks (its DDL would deadlock with a put).
    ctx = multiprocessing.get_context("spawn")
    opts = {"init": True, "prefix": pg.prefix, "schema": pg_schema}
    procs = [ctx.Process(target=_process_writer, args=(pg_dsn, opts, w, list(range(w * 100, w * 100 + 40))))
             for w in range(2)]
    procs += [ctx.Process(target=_pg_open_repeatedly, args=(pg_dsn, pg.prefix, pg_schema, 40)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    assert pg.steps("shared") == list(range(40)) + list(range(100, 140))


def test_pg_large_multichunk_round_trip(pg_dsn, pg_schema):
    from agck.stores.postgres import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, chunk_size=1 << 20)
    w = np.random.default_rng(1).standard_normal(3 << 20).astype(np.float64)   # ~24 MiB
    s.put("big", 1, {"w": w, "t": torch.from_numpy(w[:1000].copy())})
    ck = s.read("big", 1)
    np.testing.assert_array_equal(ck.state["w"], w)
    assert ck.state["w"].flags.writeable
    info = s.list("big")[0]
    assert info.size == ck.nbytes and info.size > w.nbytes
    s.close()


def test_pg_schema_missing(pg_dsn, pg_schema):
    from agck.stores.postgres import SCHEMA_VERSION, PostgresStore
    prefix = pg_prefix()
    with pytest.raises(SchemaUninitializedError) as e:
        PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema)
    assert "agck db init" in str(e.value)
    s = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema, init=True)
    assert s.schema_status()["state"] == "current"
    assert s.init_schema()["version"] == SCHEMA_VERSION          # idempotent
    assert s.migrate() == []
    PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema).close()
    s.close()
    raw = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, check_schema=False)
    assert raw.schema_status()["state"] == "uninitialized"
    with pytest.raises(SchemaUninitializedError):
        raw.migrate()
    raw.close()


def test_pg_libpq_environment(pg_dsn, pg_schema, monkeypatch):
    import psycopg2.extensions
    from agck.stores.postgres import PostgresStore
    env = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "dbname": "PGDATABASE", "password": "PGPASSWORD"}
    for key, value in psycopg2.extensions.parse_dsn(pg_dsn).items():
        if key in env:
            monkeypatch.setenv(env[key], value)
    s = PostgresStore("postgresql://", prefix=pg_prefix(), schema=pg_schema, init=True)
    assert s.url == "postgresql://"
    s.put("r", 1, state_for(1))
    assert s.steps("r") == [1]
    s.close()


def test_pg_schema_version_mismatch(pg, pg_dsn):
    from agck.stores.postgres import PostgresStore
    Tamper(("postgres", pg_dsn), pg).sql(f"UPDATE {pg.names.version} SET version = 99")
    with pytest.raises(SchemaMismatchError) as e:
        PostgresStore(pg_dsn, prefix=pg.prefix, schema=pg.schema)
    assert "newer" in str(e.value)
    with pytest.raises(SchemaMismatchError):
        pg.migrate()
    assert pg.schema_status()["state"] == "newer"
    Tamper(("postgres", pg_dsn), pg).sql(f"UPDATE {pg.names.version} SET version = 0")
    with pytest.raises(SchemaMismatchError) as e:
        PostgresStore(pg_dsn, prefix=pg.prefix, schema=pg.schema)
    assert "agck db migrate" in str(e.value)
    with pytest.raises(SchemaMismatchError):
        pg.init_schema()


@pytest.mark.parametrize("dsn", [
    "postgresql://agck_no_such_user:S3cretPw0rd@127.0.0.1:5432/test",
    "postgresql://postgres:S3cretPw0rd@127.0.0.1:1/test",
    "postgresql://postgres@127.0.0.1:1/test?password=S3cretPw0rd",
    "postgres://u:S3cret%40Pw0rd@127.0.0.1:1/test",
    "host=127.0.0.1 port=1 user=u password=S3cretPw0rd dbname=test",
    "host=127.0.0.1 port=1 user=u password = 'S3cretPw0rd' dbname=test",
])
def test_pg_connection_errors_hide_the_password(dsn):
    pytest.importorskip("psycopg2")
    from agck.stores.postgres import PostgresStore, redact_dsn
    with pytest.raises(StoreConnectionError) as e:
        PostgresStore(dsn, connect_timeout=3)
    for secret in ("S3cretPw0rd", "S3cret%40Pw0rd", "S3cret@Pw0rd"):
        assert secret not in str(e.value) and secret not in (e.value.ref or "")
        assert secret not in redact_dsn(dsn)
    assert e.value.__cause__ is None
    assert "\n" not in str(e.value)          # libpq's own message spans two lines


def test_pg_url_is_password_free(pg_dsn, pg_schema):
    from agck.stores.postgres import redact_dsn
    assert redact_dsn("postgresql://u:pw@h:5/db?sslmode=require&password=x") == "postgresql://u@h:5/db?sslmode=require"
    assert redact_dsn("postgresql:///db") == "postgresql:///db"
    assert redact_dsn("postgresql://h,h2:5/db") == "postgresql://h,h2:5/db"


def test_pg_identifiers_validated(pg_dsn):
    from agck.stores.postgres import PostgresStore
    for bad in ("x; DROP TABLE y", "Upper", "1abc", "", "a" * 42, "a-b"):
        with pytest.raises(StoreError):
            PostgresStore(pg_dsn, prefix=bad)
        with pytest.raises(StoreError):
            PostgresStore(pg_dsn, schema=bad)


def test_pg_meta_jsonb(pg):
    pg.put("r", 1, state_for(1), meta={"lr": 0.1, "b": b"\x01\x02", 3: [1, [2, 3]], "nan": float("nan"),
                                       "nul": "a\x00b"})
    info = pg.list("r")[0]
    assert info.meta == {"lr": 0.1, "b": {"$bytes": "AQI="}, "3": [1, [2, 3]], "nan": {"$float": "nan"},
                         "nul": {"$str": "YQBi"}}
    found = pg._query(f"SELECT step FROM {pg.names.manifest} WHERE meta @> %s::jsonb", ('{"lr": 0.1}',))
    assert found == [(1,)]
    assert pg.read("r", 1).meta["b"] == b"\x01\x02"


def test_pg_storage_external(pg):
    for table in (pg.names.chunks, pg.names.objects):     # tensor bytes: compressing them is wasted work
        (storage,) = pg._query("SELECT attstorage FROM pg_attribute WHERE attrelid = %s::regclass "
                               "AND attname = 'data'", (table,))[0]
        assert storage == "e"


# --- names, URLs and opening without creating -----------------------------------------------------

def test_numpy_integer_steps_are_plain_ints(store):
    ref = store.put("r", np.int64(3), state_for(3), parent=np.int32(2))
    assert ref == store.ref("r", 3) == store.ref("r", np.uint8(3))
    assert store.steps("r") == [3] and type(store.steps("r")[0]) is int
    ck = store.read("r", np.int64(3))
    assert type(ck.step) is int and ck.step == 3 and ck.parent == 2 and type(ck.parent) is int
    assert_state(ck, 3)
    assert store.get("r", np.int16(3)).step == 3
    info = store.list("r")[0]
    assert type(info.step) is int and info.parent == 2
    store.delete("r", np.int64(3))
    assert store.steps("r") == []


def test_file_store_lists_only_canonical_step_names(tmp_path):
    from agck.recovery import recover_run
    s = open_store(tmp_path / "st")
    s.put("r", 1, state_for(1))
    s.put("r", 12, state_for(12))
    run_dir = tmp_path / "st" / "r"
    good = (run_dir / "000000000001.agck").read_bytes()
    for stray in ("1.agck", "0000000000001.agck", "\u00b2.agck", "\u0661.agck", "000000000\u0662\u0663\u0664.agck",
                  "abc.agck", "000000000001.agck.bak", "-00000000001.agck", "000000000001.AGCK"):
        (run_dir / stray).write_bytes(good)
    (tmp_path / "st" / "a b").mkdir()                  # not a run name: not a run
    (tmp_path / "st" / ".git").mkdir()
    assert s.runs() == ["r"]
    assert s.steps("r") == [1, 12]
    assert [(i.run, i.step) for i in s.list()] == [("r", 1), ("r", 12)]
    assert recover_run(s, "r").step == 12
    assert s.orphans() == []                            # strays are not leftovers of writes: never cleaned
    big = (1 << 63) - 1
    s.put("r", big, state_for(0))
    assert s.steps("r") == [1, 12, big]


def test_identifiers_are_matched_whole(tmp_path):
    from agck.stores.sqlrows import check_identifier
    for bad in ("abc\n", "abc\n\n", "\nabc", "ab\u0131", "abc\x00"):
        with pytest.raises(StoreError):
            check_identifier(bad, "table prefix")
        with pytest.raises(StoreError):
            open_store(f"sqlite:///{tmp_path}/i.db", prefix=bad)
    assert check_identifier("abc_1", "table prefix") == "abc_1"


def test_sqlite_urls_follow_sqlalchemy(tmp_path, monkeypatch):
    from agck.stores.sqlite import SqliteStore, sqlite_path
    monkeypatch.chdir(tmp_path)
    assert sqlite_path("sqlite:///rel.db") == "rel.db"
    assert sqlite_path("sqlite:////abs/x.db") == "/abs/x.db"
    assert sqlite_path("sqlite:///sub/x.db") == "sub/x.db"
    assert sqlite_path("sqlite:rel.db") == "rel.db"
    assert sqlite_path("sqlite:///:memory:") == ":memory:"
    s = open_store("sqlite:///rel.db")
    assert s.path == str(tmp_path / "rel.db") and (tmp_path / "rel.db").exists()
    assert s.url == f"sqlite:///{tmp_path}/rel.db" and s.url.startswith("sqlite:////")
    s.put("r", 1, state_for(1))
    s.close()
    with open_store(s.url) as again:                    # store.url opens the same database from anywhere
        assert isinstance(again, SqliteStore) and again.path == s.path and again.steps("r") == [1]
    for bad in ("sqlite://host/x.db", "sqlite://x.db", "sqlite://", "sqlite:///"):
        with pytest.raises(StoreConnectionError) as e:
            open_store(bad)
        assert "sqlite:////abs/path.db" in str(e.value)


def test_opening_without_create_creates_nothing(tmp_path):
    for url in (f"sqlite:///{tmp_path}/typo.db", str(tmp_path / "typo"), f"file://{tmp_path}/typo"):
        with pytest.raises(StoreConnectionError):
            open_store(url, create=False)
    assert list(tmp_path.iterdir()) == []
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)")
    with pytest.raises(StoreConnectionError) as e:
        open_store(f"sqlite:///{other}", create=False)
    assert "no agck tables" in str(e.value)
    tables = [n for (n,) in sqlite3.connect(other).execute("SELECT name FROM sqlite_master")]
    assert tables == ["t"]
    assert sqlite3.connect(other).execute("PRAGMA journal_mode").fetchone()[0] != "wal"
    with pytest.raises(StoreConnectionError):
        open_store("sqlite:///:memory:", create=False)
    open_store(f"sqlite:///{tmp_path}/made.db").close()
    with open_store(f"sqlite:///{tmp_path}/made.db", create=False) as s:
        assert s.runs() == []


# --- DSNs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dsn, secret", [
    ("host=h port=1 password=S3cret dbname=d", "S3cret"),
    ("host=h password = 'S3 cr\\'et' dbname=d", "S3 cr'et"),
    ("host=h password=S3\\ cret dbname=d", "S3 cret"),
    ("password='S3cret", "S3cret"),
    ("postgresql://u:S3cret@[::1", "S3cret"),
    ("postgresql://u:S3%2Fcret@h/db?password=Other&sslmode=require", "S3/cret"),
])
def test_redact_dsn_every_form(dsn, secret):
    from agck.stores import dsn_secrets, redact_dsn
    red = redact_dsn(dsn)
    for s in (secret, "S3cret", "Other", "cret"):
        assert s not in red
    assert secret in dsn_secrets(dsn) or secret.replace("/", "%2F") in dsn_secrets(dsn)
    if "://" not in dsn:
        assert red.startswith(dsn[:6])


def test_agck_params_leave_the_rest_of_the_dsn_as_written():
    from agck.stores import split_agck_params
    url = "postgresql://u@h/db?options=-c%20search_path%3Dx&agck_prefix=p&agck_schema=s"
    assert split_agck_params(url) == ("postgresql://u@h/db?options=-c%20search_path%3Dx",
                                      {"prefix": "p", "schema": "s"})
    assert split_agck_params("host=h agck_prefix='p' dbname=d") == ("host=h dbname=d", {"prefix": "p"})
    assert split_agck_params("host=h dbname=d") == ("host=h dbname=d", {})


@pytest.mark.parametrize("dsn", [
    "postgresql://u:S3cretPw0rd@[::1",
    "postgresql://u:S3cretPw0rd@[::1/db?agck_prefix=p",
    "host=127.0.0.1 port=1 user=u password='S3cret Pw0rd' dbname=test",
    "host=127.0.0.1 port=1 user=u password=S3cret\\ Pw0rd dbname=test",
])
def test_pg_bad_dsns_are_one_line_errors_without_the_password(dsn):
    pytest.importorskip("psycopg2")
    with pytest.raises(StoreConnectionError) as e:
        open_store(dsn, connect_timeout=3)
    text = str(e.value) + (e.value.ref or "")
    assert "S3cret" not in text and "Pw0rd" not in text and "\n" not in text


def test_pg_schema_hint_is_a_command_that_runs(pg_dsn, pg_schema):
    import shlex

    import psycopg2.extensions

    from agck.cli import main
    from agck.stores.postgres import PostgresStore
    params = psycopg2.extensions.parse_dsn(pg_dsn)
    if "password" in params:
        pytest.skip("the hint leaves the password out; this server needs one")
    kv = " ".join(f"{k}={v}" for k, v in params.items()) + " password='not used'"   # trust auth ignores it
    prefix = pg_prefix()
    with pytest.raises(SchemaUninitializedError) as e:
        PostgresStore(kv, prefix=prefix, schema=pg_schema)
    hint = e.value.hint
    assert "***" not in hint and "not used" not in hint and "with the password added" in hint
    argv = shlex.split(hint.split("`")[1])
    assert argv[:3] == ["agck", "db", "init"] and main(argv[1:]) == 0
    PostgresStore(kv, prefix=prefix, schema=pg_schema).close()


# --- fencing: a writer of an older incarnation of a run cannot commit ---

def test_a_stale_epoch_cannot_commit(store):
    assert store.epoch("r") is None
    old = store.begin_epoch("r")
    store.put("r", 1, {"x": 1}, epoch=old)
    new = store.begin_epoch("r")
    assert new == old + 1 and store.epoch("r") == new
    with pytest.raises(agck.StaleEpochError, match=f"epoch {new}, this writer's epoch is {old}"):
        store.put("r", 2, {"x": 2}, epoch=old)
    assert store.steps("r") == [1]
    store.put("r", 2, {"x": 2}, epoch=new)
    store.put("r", 3, {"x": 3})                      # unfenced puts are not checked
    assert store.steps("r") == [1, 2, 3]
    other = store.begin_epoch("other")               # epochs are per run
    assert other == 1 and store.epoch("r") == new


def _zombie(spec, epoch, steps, out):
    """A writer of the run's first incarnation that keeps going."""
    from agck.stores import open_store
    _, url, opts = spec
    opts = {k: v for k, v in opts.items() if k != "init"}
    s = open_store(url, **opts)
    results = []
    for step in steps:
        try:
            s.put("r", step, {"who": "zombie", "step": step}, epoch=epoch)
            results.append((step, "ok"))
        except agck.StaleEpochError:
            results.append((step, "stale"))
        time.sleep(0.02)
    s.close()
    out.put(results)


def test_two_processes_that_both_believe_they_own_the_run(store_spec, store):
    """The first incarnation keeps writing from another process while a second one
    begins: once begin_epoch has returned, no commit of the first lands."""
    import multiprocessing as mp
    first = store.begin_epoch("r")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_zombie, args=(store_spec, first, range(1, 200), out))
    p.start()
    while not store.steps("r"):
        time.sleep(0.01)
    second = store.begin_epoch("r")
    taken_over = max(store.steps("r"))               # every zombie commit is at or before this step
    store.put("r", 1000, {"who": "new"}, epoch=second)
    results = out.get(timeout=120)
    p.join(timeout=60)
    ok = [s for s, r in results if r == "ok"]
    stale = [s for s, r in results if r == "stale"]
    assert ok and stale and max(ok) < min(stale)
    assert max(ok) <= taken_over                     # begin_epoch waited for the commit in flight
    assert [s for s in store.steps("r") if s < 1000] == ok
    assert store.get("r", 1000).state == {"who": "new"}


def test_readme_fencing_example_runs(tmp_path, monkeypatch, capsys):
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    [example] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "begin_epoch" in b]
    monkeypatch.chdir(tmp_path)
    exec(example, {"agck": agck})
    assert capsys.readouterr().out.startswith("refused: ")
    assert open_store(str(tmp_path / "ckpts")).steps("doc-pipeline") == [130]


def test_a_stale_epoch_cannot_delete_or_prune(store):
    old = store.begin_epoch("r")
    for step in (1, 2, 3):
        store.put("r", step, {"x": step}, epoch=old)
    new = store.begin_epoch("r")
    with pytest.raises(agck.StaleEpochError):
        store.delete("r", 3, epoch=old)
    with pytest.raises(agck.StaleEpochError):
        store.prune("r", keep_last=1, epoch=old)
    assert store.steps("r") == [1, 2, 3]
    store.delete("r", 1, epoch=new)
    assert store.prune("r", keep_last=1, epoch=new) == [2]
    assert store.steps("r") == [3]


def test_file_store_opened_by_processes_at_once(tmp_path, monkeypatch):
    """Ranks opening one new store: another one may make the directory between this
    one's look and its mkdir (test_four_ranks once failed so). Opening still succeeds."""
    import agck.stores.file as file_mod
    root = tmp_path / "store"
    real_isdir = os.path.isdir
    looks = []

    def isdir_then_made_by_another(path):
        found = real_isdir(path)
        if os.fspath(path) == str(root) and not looks:
            looks.append(path)
            os.mkdir(root)            # the other rank, right after this one looked
        return found

    monkeypatch.setattr(file_mod.os.path, "isdir", isdir_then_made_by_another)
    s = open_store(str(root))
    monkeypatch.undo()
    assert looks and s.runs() == []
    s.put("r", 1, {"x": 1})
    assert open_store(str(root), create=False).steps("r") == [1]


def test_file_store_refuses_a_file_in_the_way(tmp_path):
    (tmp_path / "f").write_text("not a store")
    with pytest.raises(StoreConnectionError, match="a file is in the way"):
        open_store(str(tmp_path / "f"))
    with pytest.raises(StoreConnectionError, match="no such store directory"):
        open_store(str(tmp_path / "missing"), create=False)
    assert not (tmp_path / "missing").exists()


def test_a_missing_store_directory_hints_at_what_exists(tmp_path, monkeypatch):
    """The hint names a real way on: no create=True, which agck.recover does not take."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreConnectionError) as e:
        agck.recover("nosuchdir/", "x")
    assert "nosuchdir" in str(e.value) and "create=True" not in str(e.value)
    assert "check the path" in e.value.hint and "agck.open_store(path)" in e.value.hint
    assert not (tmp_path / "nosuchdir").exists()
    with agck.open_store("nosuchdir/") as s:     # the way the hint names
        assert s.runs() == []


def test_file_store_delete_of_a_runs_last_step_removes_its_directory(tmp_path):
    s = open_store(str(tmp_path / "store"))
    s.put("a", 1, {"x": 1})
    s.put("a", 2, {"x": 2})
    s.put("b", 1, np.ones(100_000, dtype=np.float32))     # an incremental (chunked) one too
    s.delete("a", 1)
    assert s.runs() == ["a", "b"]
    s.delete("a", 2)
    s.delete("b", 1)
    assert s.runs() == [] and not (tmp_path / "store" / "a").exists()
    assert s.steps("a") == [] and s.list("a") == []
    s.put("a", 3, {"x": 3})                                # the run comes back with its next put
    assert s.steps("a") == [3] and s.read("a", 3).state == {"x": 3}
    # a fenced run's directory holds its epoch and lock: it stays, and so does the fencing
    e = s.begin_epoch("f")
    s.put("f", 1, {"x": 1}, epoch=e)
    s.delete("f", 1, epoch=e)
    assert s.epoch("f") == e and "f" in s.runs() and s.steps("f") == []


def test_file_store_put_survives_a_delete_removing_its_run_directory(tmp_path):
    """Another process deletes the run's last checkpoint between this put making sure
    the run directory is there and writing into it: the put makes it again."""
    from agck import durable
    root = tmp_path / "store"

    class DeletedMeanwhile(durable.FileSystem):
        times = 0

        def open_new(self, path):
            d = os.path.dirname(path)
            if os.path.basename(d) == "r" and self.times < 2:
                self.times += 1
                for name in os.listdir(d):
                    os.unlink(os.path.join(d, name))
                os.rmdir(d)                           # the other process's delete, just now
            return super().open_new(path)

    fs = DeletedMeanwhile()
    s = open_store(str(root), fs=fs)
    s.put("r", 1, {"x": 1})
    assert fs.times == 2 and s.steps("r") == [1] and s.read("r", 1).state == {"x": 1}
    fs.times = -10                                    # every try finds its directory gone: the error says so
    with pytest.raises(DurabilityError, match="store/r does not exist"):
        s.put("r", 2, {"x": 2})


def test_file_store_read_racing_a_prune_and_a_collection_is_not_found_not_corrupt(tmp_path):
    """A listing deleted while read, its chunks collected meanwhile: gone, not damaged;
    one replaced meanwhile is read again."""
    from agck.stores.file import FileStore
    s = FileStore(tmp_path / "s")
    s.put("r", 1, state_for(1, n=200_000))
    real = s.objects.read_into

    def racing(address, view):     # the first chunk read finds the checkpoint pruned and collected
        s.objects.read_into = real
        s.delete("r", 1)
        s.collect_garbage()
        return real(address, view)
    s.objects.read_into = racing
    with pytest.raises(CheckpointNotFoundError, match="deleted while it was read"):
        s.read("r", 1)

    s.put("r", 2, state_for(2, n=200_000))

    def replacing(address, view):  # the checkpoint is rewritten with other content meanwhile
        s.objects.read_into = real
        s.put("r", 2, state_for(7, n=200_000))
        s.collect_garbage()
        return real(address, view)
    s.objects.read_into = replacing
    assert_state(s.read("r", 2), 7, n=200_000)


def test_an_io_error_reading_a_checkpoint_is_a_verdict_other_errors_are_not(tmp_path, monkeypatch):
    import builtins
    import errno
    from agck import checkpoint
    from agck.recovery import is_verdict
    path = str(tmp_path / "x.agck")
    agck.save(path, {"x": 1})
    real_open = builtins.open
    for code, verdict in ((errno.EIO, True), (errno.EMFILE, False)):
        def failing(p, *a, code=code, **kw):
            if p == path:
                raise OSError(code, os.strerror(code), p)
            return real_open(p, *a, **kw)
        monkeypatch.setattr(builtins, "open", failing)
        with pytest.raises(AgckError) as ei:
            checkpoint.read_file(path)
        monkeypatch.setattr(builtins, "open", real_open)
        assert is_verdict(ei.value) == verdict and os.strerror(code) in str(ei.value)
