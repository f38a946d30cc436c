"""What only the SQLite store has: its URLs, opening without creating, its schema
version and the migration of databases schema versions 1 and 2 left, its fail
points, and its transactions."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from agck import failpoints
from agck.errors import DurabilityError, SchemaMismatchError, StoreConnectionError
from agck.stores import open_store

from storehelpers import Tamper, assert_state, check_migrated, check_v2_listings_kept, state_for, write_v1


# --- URLs and opening -----------------------------------------------------------------------------

def test_sqlite_urls(tmp_path):
    from agck.stores.sqlite.store import SqliteStore
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


def test_sqlite_urls_follow_sqlalchemy(tmp_path, monkeypatch):
    from agck.stores.sqlite.store import SqliteStore, sqlite_path
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


def test_sqlite_opened_without_create_creates_nothing(tmp_path):
    with pytest.raises(StoreConnectionError):
        open_store(f"sqlite:///{tmp_path}/typo.db", create=False)
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


# --- schema versions ------------------------------------------------------------------------------

def test_sqlite_schema_version(tmp_path):
    s = open_store(f"sqlite:///{tmp_path}/v.db")
    s._conn.execute("UPDATE agck_schema_version SET version = 99")
    s.close()
    with pytest.raises(SchemaMismatchError):
        open_store(f"sqlite:///{tmp_path}/v.db")


# The tables as schema version 1 made them (storehelpers.write_v1 writes a checkpoint as it did).
_V1_SQLITE = ["CREATE TABLE {p}_schema_version (version INTEGER NOT NULL)",
              """CREATE TABLE {p}_manifest (
                  run TEXT NOT NULL, step INTEGER NOT NULL, parent INTEGER, size INTEGER NOT NULL,
                  checksum TEXT NOT NULL, nchunks INTEGER NOT NULL, created_at REAL NOT NULL, meta TEXT,
                  PRIMARY KEY (run, step))""",
              """CREATE TABLE {p}_chunks (
                  run TEXT NOT NULL, step INTEGER NOT NULL, idx INTEGER NOT NULL, data BLOB NOT NULL,
                  PRIMARY KEY (run, step, idx))""",
              "INSERT INTO {p}_schema_version (version) VALUES (1)"]


def test_sqlite_migrates_a_version_1_database(tmp_path):
    from agck.stores.sqlite.store import SCHEMA_VERSION
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for q in _V1_SQLITE:
        conn.execute(q.format(p="agck"))
    old = write_v1(conn.execute, lambda b: b, "agck", "r", 1, state_for(1, n=50_000))
    conn.close()
    s = open_store(f"sqlite:///{path}", create=False)
    t = Tamper(("sqlite",), s)
    try:
        assert t.sql("SELECT version FROM agck_schema_version") == [(SCHEMA_VERSION,)] and SCHEMA_VERSION == 3
        check_migrated(s, t, old)
    finally:
        t.close()
        s.close()
    open_store(f"sqlite:///{path}").close()                  # opens again as it is


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
        check_v2_listings_kept(s, t, listed, model)
    finally:
        t.close()
        s.close()


# --- fail points and transactions -----------------------------------------------------------------

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


def test_sqlite_failed_commit_leaves_no_transaction_open():
    from agck.stores.sqlite.store import _immediate

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


def test_a_database_in_a_missing_directory_is_refused_by_name(tmp_path):
    """No talk of servers or credentials for a file: the error names the missing directory."""
    from agck.errors import StoreConnectionError
    from agck.stores.sqlite.store import SqliteStore
    where = tmp_path / "no" / "such"
    with pytest.raises(StoreConnectionError, match="does not exist") as ei:
        SqliteStore(f"sqlite:///{where}/a.db")
    assert str(where) in str(ei.value) and "server" not in str(ei.value)
