"""A Postgres store on a primary and its standby: one multi-host URL, carrying on after a
failover, and the failover judge's teeth. The campaign (``--faults failover``) runs the
failovers at random instants; these check the pieces it rests on."""

from __future__ import annotations

import time

import numpy as np
import pytest

from crashtests import pgcluster

pytestmark = pytest.mark.skipif(pgcluster.available() is not None,
                                reason=f"no private Postgres: {pgcluster.available()}")


@pytest.fixture(scope="module")
def pair():
    from crashtests.pgreplica import PgPair
    p = PgPair(synchronous=True).start(databases=("crash",))
    yield p
    p.destroy()


def _standby_first(pair, db: str = "crash") -> str:
    """The pair's URL with the standby listed first: libpq must pass over it."""
    nodes = [pair.standby, pair.leader]
    return (f"postgresql://postgres@/{db}?host={','.join(n.sockdir for n in nodes)}"
            f"&port={','.join(str(n.port) for n in nodes)}&target_session_attrs=read-write")


def test_a_multi_host_url_reaches_the_primary_whichever_comes_first(pair):
    from agck.stores import open_store
    s = open_store(_standby_first(pair) + "&agck_prefix=multi", init=True)
    try:
        s.put("r", 1, {"x": np.arange(5)})
        assert s.steps("r") == [1]
        assert "target_session_attrs=read-write" in s.url and "agck_prefix" not in s.url
    finally:
        s.close()


def test_the_cli_reads_through_a_multi_host_url(pair, capsys):
    from agck.cli import main
    from agck.stores import open_store
    url = _standby_first(pair) + "&agck_prefix=clihosts"
    s = open_store(url, init=True)
    s.put("job", 3, {"x": np.arange(3)})
    s.close()
    assert main(["recover", url, "--json"]) == 0
    assert '"job"' in capsys.readouterr().out


def test_one_store_object_carries_on_after_a_failover(pair):
    """Acknowledged puts are on the new primary; the same store object reads and writes there
    once libpq finds it, with no reopening."""
    from agck.errors import StoreError
    from agck.stores.postgres.store import PostgresStore
    s = PostgresStore(pair.dsn("crash"), prefix="carry", init=True)
    try:
        for step in range(3):
            s.put("r", step, {"x": np.full(1000, step)})
        before = pair.leader
        pair.failover()
        assert pair.leader is not before
        assert s.steps("r") == [0, 1, 2]             # an idle connection to the dead primary is replaced
        assert np.array_equal(s.read("r", 2).state["x"], np.full(1000, 2))
        for attempt in range(3):                    # a write on a connection the failover ended fails once
            try:
                s.put("r", 3, {"x": np.full(1000, 3)})
                break
            except StoreError:
                time.sleep(0.1)
        assert s.steps("r") == [0, 1, 2, 3]
    finally:
        s.close()


def test_the_failover_judge_has_teeth():
    """An asynchronous standby cut off from its primary: every checkpoint acknowledged since is
    gone after the failover, and the trial says lost."""
    import psycopg2

    from agck.stores.postgres.store import PostgresStore
    from crashtests import pgfailover
    from crashtests.campaign import Campaign, Config
    from crashtests.checker import classify
    from crashtests.pgreplica import PgPair
    c = Campaign(Config(stores=("postgres",), faults=("failover",), quiet=True, seed=1))
    c.pair = pair = PgPair(synchronous=False).start(databases=("crash",))
    store = None
    try:
        store = PostgresStore(pair.dsn("crash"), init=True)
        time.sleep(0.5)                    # the schema reaches the standby
        pair.standby.execute("ALTER SYSTEM SET primary_conninfo = ''")
        pair.standby.execute("SELECT pg_reload_conf()")
        conn = psycopg2.connect(pair.leader.dsn())
        conn.autocommit = True
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                cur = conn.cursor()
                cur.execute("SELECT count(*) FROM pg_stat_replication")
                if cur.fetchone()[0] == 0:
                    break
                time.sleep(0.05)
        finally:
            conn.close()
        t = c.new_trial("postgres", "failover", "fo", pair.dsn("crash"))
        pgfailover.trial(c, pair, store, t, 2, c.trees())      # killed right after an ack
        assert classify(t) == "lost", t
        assert t.unreadable and set(t.unreadable) <= set(t.acked)
    finally:
        if store is not None:
            store.close()
        c.cleanup()
