"""The Postgres store's pool of connections: many threads of one process on one store
object at once (puts, reads, deletes, collections, fencing), the bound on open
connections, ``agck_pool`` in the URL, waiting for a busy pool, broken connections
replaced, and fork."""

from __future__ import annotations

import os
import secrets
import threading
import time

import numpy as np
import pytest

from agck.errors import CheckpointExistsError, StaleEpochError, StoreConnectionError, StoreError, UsageError
from agck.stores import open_store

from conftest import pg_prefix


def _app_dsn(dsn: str, app: str) -> str:
    return dsn + ("&" if "?" in dsn else "?") + f"application_name={app}"


def _backends(admin_cur, app: str) -> int:
    admin_cur.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,))
    return admin_cur.fetchone()[0]


@pytest.fixture
def admin(pg_dsn):
    import psycopg2
    c = psycopg2.connect(pg_dsn)
    c.autocommit = True
    yield c.cursor()
    c.close()


def _run_threads(n: int, fn) -> list:
    errors: list = []
    barrier = threading.Barrier(n)

    def body(i):
        try:
            barrier.wait()
            fn(i)
        except BaseException as e:    # reported by the test
            errors.append((i, e))

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.parametrize("incremental", [True, False])
def test_threads_share_one_store_within_the_bound(pg_dsn, pg_schema, admin, incremental):
    """16 threads put and read 20 checkpoints each through one store of 4 connections:
    every checkpoint reads back exact, at most 4 connections are ever open, and more
    than one was used at once."""
    from agck.stores.postgres.store import PostgresStore
    app = f"agck_pool_{secrets.token_hex(4)}"
    store = PostgresStore(_app_dsn(pg_dsn, app), prefix=pg_prefix(), schema=pg_schema, init=True, pool=4,
                          incremental=incremental, min_chunked=0)
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(_backends(admin, app))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    shared = np.arange(50_000, dtype=np.float32)     # content every thread's checkpoints share

    def work(i):
        for step in range(20):
            state = {"shared": shared, "own": np.full(1000 + i, step, dtype=np.int32), "msg": f"t{i} s{step}"}
            store.put(f"conv-{i}", step, state, meta={"thread": i})
            back = store.read(f"conv-{i}", step)
            assert back.state["msg"] == f"t{i} s{step}" and np.array_equal(back.state["shared"], shared)
            assert np.array_equal(back.state["own"], state["own"])

    try:
        assert _run_threads(16, work) == []
    finally:
        stop.set()
        watcher.join()
    assert max(seen) <= 4 and max(seen) >= 2, seen
    assert store._pool.stats()["open"] <= 4
    assert sorted(store.runs()) == sorted(f"conv-{i}" for i in range(16))
    assert all(store.steps(f"conv-{i}") == list(range(20)) for i in range(16))
    store.close()
    time.sleep(0.2)
    assert _backends(admin, app) == 0     # close() closed every connection


def test_pool_size_from_the_url(pg_dsn, pg_schema):
    prefix = pg_prefix()
    s = open_store(pg_dsn + ("&" if "?" in pg_dsn else "?") + f"agck_pool=7&agck_prefix={prefix}"
                   f"&agck_schema={pg_schema}", init=True)
    try:
        assert s._pool.size == 7 and "agck_pool" not in s.url
    finally:
        s.close()


@pytest.mark.parametrize("bad", ["0", "-1", "x", "1025", "2.5"])
def test_bad_pool_sizes_are_refused(pg_dsn, pg_schema, bad):
    with pytest.raises(UsageError, match="pool size"):
        open_store(pg_dsn + ("&" if "?" in pg_dsn else "?") + f"agck_pool={bad}&agck_schema={pg_schema}",
                   init=True)


def test_a_busy_pool_makes_callers_wait_then_says_so(pg_dsn, pg_schema):
    """A thread that finds every connection busy waits for one; past ``pool_timeout`` it
    gets a StoreConnectionError naming the pool and how to enlarge it."""
    from agck.stores.postgres.store import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, pool=1, pool_timeout=0.3)
    s.put("r", 0, {"x": 1})
    held, release = threading.Event(), threading.Event()

    def hold():
        with s._pool.connection():
            held.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreConnectionError, match="1 connections of the store's pool") as ei:
            s.read("r", 0)
        assert time.monotonic() - t0 >= 0.3 and "agck_pool" in ei.value.hint
    finally:
        release.set()
        t.join()
    # and a caller that waits less than the timeout gets the connection when it is given back
    release.clear()
    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    threading.Timer(0.1, release.set).start()
    assert s.read("r", 0).state == {"x": 1}
    t.join()
    s.close()


def test_a_broken_connection_is_replaced(pg_dsn, pg_schema, admin):
    """A connection the server ended while it idled (a restart, a failover): a read is made
    again on a new one, since reading twice changes nothing; a write is not (it may have
    been sent): it fails, and the next gets a new connection. The store carries on."""
    from agck.stores.postgres.store import PostgresStore
    app = f"agck_pool_{secrets.token_hex(4)}"
    s = PostgresStore(_app_dsn(pg_dsn, app), prefix=pg_prefix(), schema=pg_schema, init=True, pool=2)
    s.put("r", 0, {"x": np.arange(10)})

    def end_its_connections():
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                      (app,))
        time.sleep(0.1)
    end_its_connections()
    assert np.array_equal(s.read("r", 0).state["x"], np.arange(10))     # read again on a new connection
    end_its_connections()
    assert s.steps("r") == [0]
    end_its_connections()
    with pytest.raises(StoreError):
        s.put("r", 1, {"x": np.arange(3)})      # a write is never sent twice
    s.put("r", 1, {"x": np.arange(3)})
    assert s.steps("r") == [0, 1]
    s.close()


def test_a_read_is_made_again_once_only(pg_dsn, pg_schema, admin):
    """A read whose second connection is also ended fails with the connection error."""
    from agck.stores.postgres.store import PostgresStore
    app = f"agck_pool_{secrets.token_hex(4)}"
    s = PostgresStore(_app_dsn(pg_dsn, app), prefix=pg_prefix(), schema=pg_schema, init=True, pool=2)
    s.put("r", 0, {"x": np.arange(10)})
    calls = []
    real = s._connect_one

    def connect_then_end():      # every new connection is ended before its first statement
        conn = real()
        calls.append(conn)
        admin.execute("SELECT pg_terminate_backend(%s)", (conn.get_backend_pid(),))
        time.sleep(0.05)
        return conn
    admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (app,))
    time.sleep(0.1)
    s._pool._connect = connect_then_end
    with pytest.raises(StoreConnectionError, match="lost the connection"):
        s.read("r", 0)
    assert len(calls) == 1      # the idle one, then one new one: two attempts in all
    s._pool._connect = real
    assert s.steps("r") == [0]
    s.close()


def test_racing_puts_of_one_key_one_wins(pg_dsn, pg_schema):
    """Threads of one store putting the same (run, step) without overwrite: one commits,
    the others are refused by name; with overwrite all commit and one remains whole."""
    from agck.stores.postgres.store import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, pool=8)
    outcomes: list = []

    def put_once(i):
        try:
            s.put("r", 5, {"who": i, "x": np.full(20_000, i, dtype=np.int64)}, overwrite=False)
            outcomes.append(("ok", i))
        except CheckpointExistsError:
            outcomes.append(("exists", i))

    assert _run_threads(8, put_once) == []
    winners = [i for k, i in outcomes if k == "ok"]
    assert len(winners) == 1 and len(outcomes) == 8
    assert s.read("r", 5).state["who"] == winners[0]

    assert _run_threads(8, lambda i: s.put("r", 6, {"who": i, "x": np.full(20_000, i, dtype=np.int64)})) == []
    back = s.read("r", 6).state
    assert np.array_equal(back["x"], np.full(20_000, back["who"], dtype=np.int64))
    s.close()


def test_collection_beside_threads_keeps_what_they_commit(pg_dsn, pg_schema):
    """Collections run on one thread while others put and delete through the same store:
    every checkpoint that remains reads back whole."""
    from agck.stores.postgres.store import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, pool=4, min_chunked=0)
    stop = threading.Event()
    gc_errors: list = []

    def collect():
        while not stop.is_set():
            try:
                s.collect_garbage()
            except BaseException as e:
                gc_errors.append(e)
                return

    g = threading.Thread(target=collect)
    g.start()

    def work(i):
        for step in range(15):
            s.put(f"w{i}", step, {"x": np.arange(30_000, dtype=np.int64) * (step % 3), "i": i})
            if step >= 2:
                s.delete(f"w{i}", step - 2)

    try:
        assert _run_threads(4, work) == []
    finally:
        stop.set()
        g.join()
    assert gc_errors == []
    s.collect_garbage()
    for i in range(4):
        assert s.steps(f"w{i}") == [13, 14]
        for step in (13, 14):
            assert np.array_equal(s.read(f"w{i}", step).state["x"], np.arange(30_000, dtype=np.int64) * (step % 3))
    s.close()


def test_fencing_holds_across_the_pool(pg_dsn, pg_schema):
    """A put with an old epoch is refused on whichever connection it runs."""
    from agck.stores.postgres.store import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, pool=4)
    old = s.begin_epoch("r")
    new = s.begin_epoch("r")
    refused: list = []

    def put(i):
        try:
            s.put("r", i, {"i": i}, epoch=old)
        except StaleEpochError:
            refused.append(i)
        s.put("r", 100 + i, {"i": i}, epoch=new)

    assert _run_threads(8, put) == []
    assert sorted(refused) == list(range(8)) and s.steps("r") == [100 + i for i in range(8)]
    s.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_opens_its_own_connections(pg_dsn, pg_schema):
    """A child after fork() never talks on the parent's connections; the parent's stay usable."""
    from agck.stores.postgres.store import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, pool=2)
    s.put("r", 0, {"x": np.arange(5)})
    pid = os.fork()
    if pid == 0:     # the child
        code = 1
        try:
            s.put("r", 1, {"x": np.arange(6)})
            code = 0 if np.array_equal(s.read("r", 0).state["x"], np.arange(5)) else 2
            s.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert s.steps("r") == [0, 1]
    assert np.array_equal(s.read("r", 1).state["x"], np.arange(6))
    s.close()


def test_threads_putting_the_same_new_content_send_it_once(pg_dsn, pg_schema, admin):
    """Two threads of one store putting the same new 8 MiB at once (as LangGraph writes a
    large value as a pending write and a channel together): the bytes reach the objects
    table once, not twice (the second sender would block on the first's rows, fail, and
    leave its copy as dead rows)."""
    from agck.stores.postgres.store import PostgresStore
    s = PostgresStore(pg_dsn, prefix=pg_prefix(), schema=pg_schema, init=True, pool=4)
    x = np.random.default_rng(5).random(1 << 20)          # 8 MiB, new content

    def objects_bytes():
        admin.execute("SELECT pg_total_relation_size(%s::regclass)", (s.names.objects,))
        return admin.fetchone()[0]

    before = objects_bytes()
    for _ in range(3):
        assert _run_threads(2, lambda i: s.put(f"same-{i}-{_}", 1, {"x": x})) == []
    grew = objects_bytes() - before
    assert (8 << 20) <= grew < (12 << 20), grew
    assert all(np.array_equal(s.read(f"same-{i}-2", 1).state["x"], x) for i in range(2))
    s.close()


def test_a_store_refused_at_open_leaves_no_connection(pg_dsn, pg_schema, admin):
    """Opening tables that do not exist raises, and closes the connection it opened
    (`agck recover` asks for the parts tables of every run it walks)."""
    from agck.errors import SchemaUninitializedError
    from agck.stores.postgres.store import PostgresStore
    app = f"agck_pool_{secrets.token_hex(4)}"
    for _ in range(10):
        with pytest.raises(SchemaUninitializedError):
            PostgresStore(_app_dsn(pg_dsn, app), prefix=pg_prefix(), schema=pg_schema)
    time.sleep(0.2)
    assert _backends(admin, app) == 0


def test_a_store_dropped_without_close_frees_its_connections(pg_dsn, pg_schema, admin):
    """A store object nobody holds any more closes its connections at once (as one
    connection did before the pool), not at some later garbage collection."""
    import gc
    from agck.stores.postgres.store import PostgresStore
    app = f"agck_pool_{secrets.token_hex(4)}"
    gc.disable()
    try:
        for i in range(5):
            s = PostgresStore(_app_dsn(pg_dsn, app), prefix=pg_prefix(), schema=pg_schema, init=True)
            s.put("r", i, {"x": i})
            del s
        time.sleep(0.2)
        assert _backends(admin, app) == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("commit", ["sync", "group"])
def test_a_journal_step_keeps_its_result_when_its_idle_connection_died(pg_dsn, pg_schema, admin, commit):
    """The server ended the journal's idle connection between steps: the next step's
    records are appended again on a new connection (twice is harmless: the first record
    of a key is its result), not thrown away with a 'may or may not' error."""
    from agck.journal import Journal
    from agck.stores.postgres.store import PostgresStore
    app = f"agck_pool_{secrets.token_hex(4)}"
    s = PostgresStore(_app_dsn(pg_dsn, app), prefix=pg_prefix(), schema=pg_schema, init=True, pool=2)
    calls = []
    with Journal(s, "r", commit=commit) as j:
        assert j.step("f", lambda x: calls.append(x) or x * 2, 1) == 2
        j.flush()
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (app,))
        time.sleep(0.1)
        assert j.step("f", lambda x: calls.append(x) or x * 2, 2) == 4
    with Journal(s, "r") as j:       # both acknowledged: replayed, not run again
        assert [j.step("f", lambda x: calls.append(x) or x * 2, x) for x in (1, 2)] == [2, 4]
    assert calls == [1, 2]
    s.close()
