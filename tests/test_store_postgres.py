"""What only the Postgres store has: its write paths (one statement, COPY) killed or
failed at each point, reconnects, server errors, concurrent writers and ``init``,
schema init, versions and migration (``agck db init``/``migrate``), DSN handling
(libpq environment, passwords kept out of errors and URLs, ``agck_*`` parameters),
identifiers, jsonb meta and the storage of its byte columns."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from agck import failpoints, thresholds
from agck.errors import (CheckpointNotFoundError, DurabilityError, SchemaMismatchError, SchemaUninitializedError,
                         StoreConnectionError, StoreError)
from agck.stores import open_store

from conftest import pg_prefix
from storehelpers import (Tamper, assert_state, check_migrated, check_v2_listings_kept, process_writer, state_for,
                          write_v1)

torch = pytest.importorskip("torch")


@pytest.fixture
def pg(pg_dsn, pg_schema):
    from agck.stores.postgres.store import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, chunk_size=4096,
                      min_chunked=0)   # small checkpoints chunked too: each write path is taken
    yield s
    s.close()


def _autocommit(dsn):
    import psycopg2
    c = psycopg2.connect(dsn)
    c.autocommit = True
    return c


# --- writes killed, failed or refused -------------------------------------------------------------

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


@pytest.mark.parametrize("incremental", [False, True])
def test_pg_server_errors_at_commit_are_not_called_ambiguous(pg_dsn, pg_schema, incremental):
    """A lock timeout (the server's verdict: rolled back) is a plain write failure, not
    'may or may not have been written', and the store goes on working. (A standalone
    checkpoint's statements and COMMIT travel in one exchange with its COPY.)"""
    from agck.stores.postgres.store import PostgresStore
    pg = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, incremental=incremental, pool=1)
    pg.put("r", 0, state_for(0))
    holder = _autocommit(pg_dsn)
    holder.cursor().execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (pg._row_lock_key("r", 1),))
    with pg._cursor() as cur:     # the pool's one connection: the put below uses it
        cur.execute("SET lock_timeout = 200")
    try:
        with pytest.raises(DurabilityError) as ei:
            pg.put("r", 1, state_for(1))
        assert "lock timeout" in str(ei.value) and "may or may not" not in str(ei.value)
    finally:
        holder.close()
        with pg._cursor() as cur:
            cur.execute("RESET lock_timeout")
    pg.put("r", 1, state_for(1))
    assert pg.steps("r") == [0, 1]
    pg.close()


def test_pg_backend_terminated_mid_copy_is_a_lost_connection_and_prints_nothing(pg_dsn, pg_schema, capfd,
                                                                                  monkeypatch):
    """The server ends the put's session mid-COPY (a shutdown, an administrator, an OOM
    killer): one error, nothing committed, and nothing on stderr.
    psycopg2 reports the FATAL message and then the lost connection, decoding the second
    with the first still set, and PyErr_Print()s a stray SystemError (pool.py)."""
    from agck.stores.postgres.store import PostgresStore
    prefix = pg_prefix()
    s = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema, init=True, chunk_size=4096, min_chunked=0,
                      incremental=False)
    admin = _autocommit(pg_dsn)
    hit = failpoints.hit

    def end_the_session(name):
        if name == "pg.mid_copy":
            with admin.cursor() as cur:
                cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE pid <> pg_backend_pid() AND query LIKE %s", (f"%COPY%{prefix}%FROM STDIN%",))
                assert cur.fetchall() == [(True,)]
            time.sleep(0.3)       # the FATAL message and the closed socket are both waiting
        return hit(name)

    monkeypatch.setattr(failpoints, "hit", end_the_session)
    try:
        # the COMMIT follows the COPY in the same exchange: the client cannot tell
        # whether it ran, and says so (DurabilityError), or knows it lost the connection first
        with pytest.raises((StoreConnectionError, DurabilityError), match="connection"):
            # above the one-statement size, so a COPY; the cut comes at its second chunk
            s.put("r", 1, {"x": np.zeros(thresholds.SMALL_PUT + 1, dtype=np.int8)})
        monkeypatch.setattr(failpoints, "hit", hit)
        fresh = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema)
        assert fresh.steps("r") == []
        fresh.close()
    finally:
        s.close()
        admin.close()
    err = capfd.readouterr().err
    assert "SystemError" not in err and "psycopg2" not in err, err


def test_pg_backend_terminated_mid_read_is_a_lost_connection(pg_dsn, pg_schema, capfd, monkeypatch):
    """The server ends a read's session mid-COPY: psycopg2's bare "error with status
    PGRES_COPY_OUT and no message from the libpq" is reported as the lost connection it is."""
    from agck.stores.postgres import copy as pgcopy
    from agck.stores.postgres.store import PostgresStore
    prefix = pg_prefix()
    s = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema, init=True, incremental=False)
    x = np.arange(4 * thresholds.COPY_IO, dtype=np.int8)
    s.put("r", 1, {"x": x})
    s.close()
    admin = _autocommit(pg_dsn)
    write = pgcopy.CopyOut.write

    def cut_then_write(self, data):
        if not getattr(self, "cut", False):
            self.cut = True
            with admin.cursor() as cur:
                cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE pid <> pg_backend_pid() AND query LIKE %s", (f"%COPY%{prefix}%TO STDOUT%",))
                assert cur.fetchall() == [(True,)]
            time.sleep(0.3)
        return write(self, data)

    fresh = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema)
    try:
        monkeypatch.setattr(pgcopy.CopyOut, "write", cut_then_write)
        with pytest.raises(StoreConnectionError, match="lost the connection to Postgres"):
            fresh.get("r", 1)
        monkeypatch.setattr(pgcopy.CopyOut, "write", write)
        np.testing.assert_array_equal(fresh.get("r", 1).state["x"], x)     # the next read, on a new connection
    finally:
        fresh.close()
        admin.close()
    assert "SystemError" not in capfd.readouterr().err


def test_pg_a_bare_database_error_on_a_closed_connection_is_a_lost_connection(pg, pg_dsn):
    """A server SIGKILLed while a read streams the shared chunks leaves libpq with no
    message: psycopg2 raises a bare DatabaseError ("error with status PGRES_COPY_OUT and
    no message from the libpq"), and the connection is closed. That is a lost connection
    (StoreConnectionError, with its hint), not an unexplained StoreError. (Seen with a
    private server killed mid-read; the instant is too narrow for a test to hit it.)"""
    import psycopg2
    conn = psycopg2.connect(pg_dsn)
    conn.close()
    e = psycopg2.DatabaseError("error with status PGRES_COPY_OUT and no message from the libpq")
    err = pg._db_error(e, "read failed", "agck_manifest(run='r', step=1)", conn=conn)
    assert type(err) is StoreConnectionError and "lost the connection to Postgres" in str(err)
    open_conn = psycopg2.connect(pg_dsn)
    try:   # the same error on a live connection is the server's answer, not a lost connection
        assert type(pg._db_error(e, "read failed", "x", conn=open_conn)) is StoreError
    finally:
        open_conn.close()


def test_pg_reconnect_forgets_which_objects_the_database_holds(pg_dsn, pg_schema):
    """After a reconnect a put asks again which objects the database holds: a failover
    or a restore may have lost ones this store object saw committed."""
    from agck.stores.postgres.store import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True)
    try:
        x = np.arange(300_000, dtype=np.int64)
        s.put("r", 1, {"x": x})
        admin = _autocommit(pg_dsn)
        admin.cursor().execute(f"DELETE FROM {pg_schema}.{s.prefix}_objects")    # the database lost them
        admin.close()
        with s._pool.connection() as conn:
            conn.close()                 # and the connection went with it
        s.put("r", 2, {"x": x})          # the same content: sent again
        assert np.array_equal(s.read("r", 2).state["x"], x)
    finally:
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


def test_pg_large_multichunk_round_trip(pg_dsn, pg_schema):
    from agck.stores.postgres.store import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, chunk_size=1 << 20)
    w = np.random.default_rng(1).standard_normal(3 << 20).astype(np.float64)   # ~24 MiB
    s.put("big", 1, {"w": w, "t": torch.from_numpy(w[:1000].copy())})
    ck = s.read("big", 1)
    np.testing.assert_array_equal(ck.state["w"], w)
    assert ck.state["w"].flags.writeable
    info = s.list("big")[0]
    assert info.size == ck.nbytes and info.size > w.nbytes
    s.close()


# --- schema: init, versions, migration ------------------------------------------------------------

def _pg_open_repeatedly(dsn: str, prefix: str, schema: str, n: int) -> None:
    from agck.stores.postgres.store import PostgresStore
    for _ in range(n):
        PostgresStore(dsn, prefix=prefix, schema=schema, init=True).close()


def test_pg_init_races_puts_without_deadlock(pg, pg_dsn, pg_schema):
    # Processes that open the store with init=True while others put: init on a
    # complete schema must take no table locks (its DDL would deadlock with a put).
    ctx = multiprocessing.get_context("spawn")
    opts = {"init": True, "prefix": pg.prefix, "schema": pg_schema}
    procs = [ctx.Process(target=process_writer, args=(pg_dsn, opts, w, list(range(w * 100, w * 100 + 40))))
             for w in range(2)]
    procs += [ctx.Process(target=_pg_open_repeatedly, args=(pg_dsn, pg.prefix, pg_schema, 40)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    assert pg.steps("shared") == list(range(40)) + list(range(100, 140))


def test_pg_schema_missing(pg_dsn, pg_schema):
    from agck.stores.postgres.store import SCHEMA_VERSION, PostgresStore
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


def test_pg_schema_version_mismatch(pg, pg_dsn):
    from agck.stores.postgres.store import PostgresStore
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


def test_pg_schema_hint_is_a_command_that_runs(pg_dsn, pg_schema):
    import shlex

    import psycopg2.extensions

    from agck.cli import main
    from agck.stores.postgres.store import PostgresStore
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


# The tables as schema version 1 made them (storehelpers.write_v1 writes a checkpoint as it did).
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


def test_pg_migrates_a_version_1_schema(pg_dsn, pg_schema):
    import psycopg2
    from agck.stores.postgres.store import PostgresStore
    prefix = pg_prefix()
    conn = psycopg2.connect(pg_dsn)
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute(f"SET search_path = {pg_schema}")
    for q in _V1_PG:
        cur.execute(q.format(p=prefix))
    old = write_v1(lambda q, a: cur.execute(q.replace("?", "%s"), a), psycopg2.Binary, prefix, "r", 1,
                    state_for(1, n=50_000))
    conn.close()
    with pytest.raises(SchemaMismatchError, match="agck db migrate"):
        PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema)
    with pytest.raises(SchemaMismatchError, match="agck db migrate"):
        PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema, init=True)    # init never migrates
    raw = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema, check_schema=False)
    assert raw.schema_status()["state"] == "outdated"
    assert raw.migrate() == [2, 3, 4] and raw.migrate() == []
    raw.close()
    s = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema)
    t = Tamper(("postgres", pg_dsn), s)
    try:
        assert s.schema_status()["state"] == "current"
        check_migrated(s, t, old)
    finally:
        t.close()
        s.close()


def test_pg_migrates_a_version_2_schema_with_chunked_checkpoints(pg_dsn, pg_schema):
    """Schema 2 kept a refs row per listed object; 3 flags listings on the manifest
    and drops refs. Listings written under 2 keep their objects alive after it."""
    import psycopg2
    from agck.stores.postgres.store import PostgresStore
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
    assert raw.migrate() == [3, 4] and raw.migrate() == []
    raw.close()
    s = PostgresStore(pg_dsn, prefix=prefix, schema=pg_schema)
    try:
        assert t.sql(f"SELECT to_regclass('{pg_schema}.{prefix}_refs') IS NULL")[0][0]
        check_v2_listings_kept(s, t, listed, model)
    finally:
        t.close()
        s.close()


# --- DSNs, identifiers and columns ----------------------------------------------------------------

def test_pg_libpq_environment(pg_dsn, pg_schema, monkeypatch):
    import psycopg2.extensions
    from agck.stores.postgres.store import PostgresStore
    env = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "dbname": "PGDATABASE", "password": "PGPASSWORD"}
    for key, value in psycopg2.extensions.parse_dsn(pg_dsn).items():
        if key in env:
            monkeypatch.setenv(env[key], value)
    s = PostgresStore("postgresql://", prefix=pg_prefix(), schema=pg_schema, init=True)
    assert s.url == "postgresql://"
    s.put("r", 1, state_for(1))
    assert s.steps("r") == [1]
    s.close()


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
    from agck.stores.postgres.store import PostgresStore, redact_dsn
    with pytest.raises(StoreConnectionError) as e:
        PostgresStore(dsn, connect_timeout=3)
    for secret in ("S3cretPw0rd", "S3cret%40Pw0rd", "S3cret@Pw0rd"):
        assert secret not in str(e.value) and secret not in (e.value.ref or "")
        assert secret not in redact_dsn(dsn)
    assert e.value.__cause__ is None
    assert "\n" not in str(e.value)          # libpq's own message spans two lines


def test_pg_url_is_password_free(pg_dsn, pg_schema):
    from agck.stores.postgres.store import redact_dsn
    assert redact_dsn("postgresql://u:pw@h:5/db?sslmode=require&password=x") == "postgresql://u@h:5/db?sslmode=require"
    assert redact_dsn("postgresql:///db") == "postgresql:///db"
    assert redact_dsn("postgresql://h,h2:5/db") == "postgresql://h,h2:5/db"


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


def test_pg_identifiers_validated(pg_dsn):
    from agck.stores.postgres.store import PostgresStore
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


def test_errors_about_a_run_say_which_tables_were_searched(pg, pg_dsn, capsys):
    """A store is its database and its tables (prefix, schema): "run X has no
    checkpoints" names both, from the library and from the CLI."""
    from agck.cli import main
    tables = f"{pg.schema}.{pg.prefix}_*" if getattr(pg, "schema", None) else f"{pg.prefix}_*"
    with pytest.raises(CheckpointNotFoundError) as e:
        pg.get("nope")
    assert tables in str(e.value), e.value
    url = f"{pg_dsn}{'&' if '?' in pg_dsn else '?'}agck_prefix={pg.prefix}&agck_schema={pg.schema}"
    pg.put("r", 1, {"x": 1})
    assert main(["ls", url, "--run", "nope"]) == 4
    assert tables in capsys.readouterr().err


@pytest.mark.parametrize("option, value, msg", [("pool_timeout", float("inf"), "pool_timeout=inf is not"),
                                                ("pool_timeout", "5", "pool_timeout must be a number"),
                                                ("pool_timeout", None, "pool_timeout must be a number"),
                                                ("pool_timeout", float("nan"), "pool_timeout=nan is not"),
                                                ("objects", 5, "objects must be an s3:// URL")])
def test_postgres_options_out_of_range_are_refused_by_name(pg_dsn, pg_schema, option, value, msg):
    from agck.errors import UsageError
    from agck.stores.postgres.store import PostgresStore
    with pytest.raises(UsageError, match=msg):
        PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, **{option: value})
