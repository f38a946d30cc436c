"""The Postgres store's asyncio methods (``aput_many``, ``aread``, ``aread_newest``,
``asteps``): the same results and errors as the sync ones, small containers on the
event loop and large ones on a thread, the bound on connections per loop, a busy
pool, a broken connection replaced, and a closed store."""

from __future__ import annotations

import asyncio
import secrets
import time

import numpy as np
import pytest

from agck.errors import (CheckpointExistsError, CheckpointNotFoundError, InvalidRunNameError, StoreConnectionError,
                         StoreError)
from agck.stores import PutEntry

from conftest import pg_prefix


def _store(pg_dsn, pg_schema, app=None, **kw):
    from agck.stores.postgres.store import PostgresStore
    dsn = pg_dsn if app is None else pg_dsn + ("&" if "?" in pg_dsn else "?") + f"application_name={app}"
    return PostgresStore(dsn, prefix=pg_prefix(), schema=pg_schema, init=True, **kw)


@pytest.mark.parametrize("incremental", [True, False])
def test_async_methods_give_what_the_sync_ones_give(pg_dsn, pg_schema, incremental):
    s = _store(pg_dsn, pg_schema, incremental=incremental)
    big = np.random.default_rng(0).random(1 << 19)          # 4 MiB: chunked or streamed, on a thread

    async def main():
        assert await s.aread_newest("r") is None and await s.asteps("r") == []
        refs = await s.aput_many([PutEntry("r", 1, {"a": np.arange(5)}, {"m": 1}),
                                  PutEntry("r", 2, {"b": "two"}, parent=1)])
        assert refs == [s.ref("r", 1), s.ref("r", 2)]
        ck = await s.aread("r", 1)
        assert np.array_equal(ck.state["a"], np.arange(5)) and ck.meta == {"m": 1}
        newest = await s.aread_newest("r")
        assert (newest.step, newest.parent, newest.state) == (2, 1, {"b": "two"})
        await s.aput_many([PutEntry("r", 3, {"big": big})])
        assert np.array_equal((await s.aread("r", 3)).state["big"], big)
        assert np.array_equal((await s.aread_newest("r")).state["big"], big)
        assert await s.asteps("r") == [1, 2, 3] and await s.asteps("r", last=2) == [2, 3]
        with pytest.raises(CheckpointExistsError):
            await s.aput_many([PutEntry("r", 1, {"a": 0}, overwrite=False)])
        await s.aput_many([PutEntry("r", 1, {"a": 0})])       # a put that replaces
        assert (await s.aread("r", 1)).state == {"a": 0}
        with pytest.raises(CheckpointNotFoundError):
            await s.aread("r", 99)
        with pytest.raises(InvalidRunNameError):
            await s.aread_newest("../x")
        assert await s.aput_many([]) == []
        # many at once, as many conversations of one server
        await asyncio.gather(*(s.aput_many([PutEntry("c", i, {"i": i})]) for i in range(30)))
        got = await asyncio.gather(*(s.aread("c", i) for i in range(30)))
        assert [c.state["i"] for c in got] == list(range(30))

    asyncio.run(main())
    # the sync methods see exactly what the async ones wrote
    assert s.steps("r") == [1, 2, 3] and s.read("r", 1).state == {"a": 0}
    assert np.array_equal(s.read("r", 3).state["big"], big) and s.steps("c") == list(range(30))
    s.close()


def test_connections_per_loop_stay_within_the_bound(pg_dsn, pg_schema):
    s = _store(pg_dsn, pg_schema, pool=2)
    opened = []
    connect = s._aconns._connect

    async def counting():
        opened.append(1)
        return await connect()

    s._aconns._connect = counting

    async def main():
        await asyncio.gather(*(s.aput_many([PutEntry("r", i, {"i": i})]) for i in range(40)))
        await asyncio.gather(*(s.aread("r", i) for i in range(40)))
        for _ in range(5):      # a statement the server refused: rolled back, the connection kept
            with pytest.raises(CheckpointExistsError):
                await s.aput_many([PutEntry("r", 0, {"i": -1}, overwrite=False)])
        assert (await s.aread("r", 0)).state == {"i": 0}

    asyncio.run(main())
    assert len(opened) == 2 and s.steps("r") == list(range(40))
    s.delete("r", 0)
    asyncio.run(main())                 # another event loop: connections of its own, as many at most
    assert len(opened) == 4
    s.close()


def test_a_busy_pool_makes_callers_wait_then_says_so(pg_dsn, pg_schema):
    s = _store(pg_dsn, pg_schema, pool=1, pool_timeout=0.3)
    s.put("r", 0, {"x": 1})

    async def main():
        held = asyncio.Event()

        async def hold(seconds):
            async with s._aconns.connection():
                held.set()
                await asyncio.sleep(seconds)

        task = asyncio.create_task(hold(1.0))
        await held.wait()
        t0 = time.monotonic()
        with pytest.raises(StoreConnectionError, match="1 asynchronous connections") as e:
            await s.aread("r", 0)
        assert time.monotonic() - t0 >= 0.3 and "agck_pool" in e.value.hint
        await task
        held.clear()
        task = asyncio.create_task(hold(0.1))      # given back within the timeout: the caller gets it
        await held.wait()
        assert (await s.aread("r", 0)).state == {"x": 1}
        await task

    asyncio.run(main())
    s.close()


def test_a_broken_connection_is_replaced(pg_dsn, pg_schema):
    """A connection ended while it idled: a read is made again on a new one, a write fails
    (it may have been sent) and the next opens another."""
    import psycopg2
    app = f"agck_async_{secrets.token_hex(4)}"
    s = _store(pg_dsn, pg_schema, app=app, pool=2)
    admin = psycopg2.connect(pg_dsn)
    admin.autocommit = True

    async def end_its_connections():
        admin.cursor().execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                               (app,))
        await asyncio.sleep(0.1)

    async def main():
        await s.aput_many([PutEntry("r", 0, {"x": np.arange(10)})])
        await end_its_connections()
        assert np.array_equal((await s.aread("r", 0)).state["x"], np.arange(10))     # read again on a new one
        await end_its_connections()
        assert await s.asteps("r") == [0]
        await end_its_connections()
        with pytest.raises(StoreError):
            await s.aput_many([PutEntry("r", 1, {"x": 1})])     # a write is never sent twice
        await s.aput_many([PutEntry("r", 1, {"x": 1})])
        assert await s.asteps("r") == [0, 1]

    try:
        asyncio.run(main())
    finally:
        admin.close()
        s.close()


def test_a_closed_store_says_so(pg_dsn, pg_schema):
    s = _store(pg_dsn, pg_schema)
    s.close()
    with pytest.raises(StoreError, match="closed"):
        asyncio.run(s.aread_newest("r"))
