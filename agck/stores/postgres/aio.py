"""The Postgres store's asyncio methods: ``aput_many``, ``aread``, ``aread_newest``
and ``asteps``, awaited on the running event loop without a thread.

psycopg2 connections in asynchronous mode (``async_=True``): a statement is sent,
and the coroutine waits for the socket on the event loop (``add_reader`` /
``add_writer``) until the server's answer is in. What travels in one statement
does so here: a put of small standalone containers (:meth:`PostgresStore._put_small`,
one round trip), a read of a small one with its manifest row, a run's steps.
Anything else (a container that is streamed with COPY, which psycopg2 cannot do
asynchronously; a listing with its objects; a put fenced by an epoch) runs the
sync method on a thread, awaited, so every call has the same result and the same
guarantees as the sync one: the same statements, the same fail points, the same
errors.

The connections: at most ``size`` per event loop (``agck_pool``), opened when
first needed, kept between calls (after a statement the server refused, once
ROLLBACK has ended its transaction), dropped when the connection fails or a call
is cancelled mid-statement (the next call opens another), and not shared with the
sync pool's: a store used from threads and from an event loop holds up to twice
``agck_pool``. A call that finds all ``size`` busy waits ``timeout`` seconds, then gets
:class:`~agck.errors.StoreConnectionError`. After ``fork()`` the child opens its own.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import psycopg2
import psycopg2.extensions

from ... import codec, failpoints
from ...checkpoint import Checkpoint
from ...errors import StoreConnectionError, StoreError
from ...names import check_run, check_step
from ..base import PutEntry, check_last
from ..sqlrows import batch_ref, check_entries, prepare_put

_POLL = psycopg2.extensions


async def wait(conn) -> None:
    """Until ``conn`` has done what it was asked (connected, or a statement's answer read):
    psycopg2's asynchronous poll loop, the socket awaited on the running event loop."""
    loop = asyncio.get_running_loop()
    while True:
        state = conn.poll()
        if state == _POLL.POLL_OK:
            return
        if state == _POLL.POLL_READ:
            add, remove = loop.add_reader, loop.remove_reader
        elif state == _POLL.POLL_WRITE:
            add, remove = loop.add_writer, loop.remove_writer
        else:   # pragma: no cover - psycopg2 documents no other state
            raise psycopg2.OperationalError(f"unexpected poll state {state}")
        fd, ready = conn.fileno(), loop.create_future()
        add(fd, ready.set_result, None)
        try:
            await ready
        finally:
            remove(fd)


async def _rolled_back(conn) -> bool:
    """Whether ROLLBACK ended the transaction a refused statement left open on ``conn``."""
    try:
        cur = conn.cursor()     # held while polled: psycopg2 keeps only a weak reference to it
        cur.execute("ROLLBACK")
        await wait(conn)
        return True
    except Exception:
        return False


class _LoopPool:
    """The connections of one event loop."""

    def __init__(self, size: int):
        self.idle: list = []
        self.free = asyncio.Semaphore(size)


class AsyncConnections:
    """At most ``size`` asynchronous connections per event loop (see the module's docstring)."""

    def __init__(self, connect_kwargs: Callable[[], tuple[str, dict]], size: int, timeout: float, where: str,
                 on_broken: Callable[[], None] | None = None):
        self.size = size
        self._connect_kwargs = connect_kwargs
        self._timeout = timeout
        self._where = where
        self._on_broken = on_broken
        self._loops: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPool]" = weakref.WeakKeyDictionary()
        self._pid = os.getpid()
        self._closed = False

    def _pool(self) -> _LoopPool:
        if self._pid != os.getpid():     # after fork(): the parent's connections are the parent's
            self._loops, self._pid = weakref.WeakKeyDictionary(), os.getpid()
        loop = asyncio.get_running_loop()
        pool = self._loops.get(loop)
        if pool is None:
            pool = self._loops[loop] = _LoopPool(self.size)
        return pool

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        """A connection of this loop's pool until the block ends; dropped if the block raises
        (the transaction it ran may have failed part way: never reused)."""
        if self._closed:
            raise StoreError("the store is closed", ref=self._where, hint="open it again")
        pool = self._pool()
        try:
            await asyncio.wait_for(pool.free.acquire(), self._timeout)
        except asyncio.TimeoutError:
            raise StoreConnectionError(
                f"all {self.size} asynchronous connections of the store's pool stayed busy for {self._timeout:g} s",
                ref=self._where, hint="give the store a larger pool (agck_pool=N in the URL, or pool=N)") from None
        conn = None
        try:
            while pool.idle and conn is None:
                conn = pool.idle.pop()
                if conn.closed:
                    conn = None
                    self._broken()
            if conn is None:
                conn = await self._connect()
            yield conn
        except BaseException as e:
            if conn is not None:
                if conn.closed:
                    self._broken()
                elif isinstance(e, Exception) and not conn.isexecuting() and await _rolled_back(conn):
                    pool.idle.append(conn)     # the server refused a statement: its transaction is undone
                else:
                    conn.close()   # cancelled mid-statement, or the connection failed: never reused
            raise
        else:
            if conn.closed:
                self._broken()
            elif self._closed:
                conn.close()
            else:
                pool.idle.append(conn)
        finally:
            pool.free.release()

    async def _connect(self):
        dsn, kwargs = self._connect_kwargs()
        try:
            conn = psycopg2.connect(dsn, async_=True, **kwargs)
            await wait(conn)
        except psycopg2.Error as e:
            raise StoreConnectionError(f"cannot connect to Postgres: {e}", ref=self._where) from None
        return conn

    def _broken(self) -> None:
        if self._on_broken is not None and not self._closed:
            self._on_broken()

    def close(self) -> None:
        """Close the idle connections of every loop; those lent are closed when given back."""
        self._closed = True
        if self._pid != os.getpid():
            return
        for pool in list(self._loops.values()):
            for conn in pool.idle:
                conn.close()
            pool.idle = []


class AsyncMethods:
    """The asyncio methods of :class:`~agck.stores.postgres.store.PostgresStore` (see the module's docstring)."""

    native_async = True

    _aconns: AsyncConnections

    async def _aread_retrying(self, attempt, error):
        """``await attempt(conn, cur)`` on an asynchronous connection; a database error is
        raised as ``error(e, conn)``. A read whose connection died while it idled (the server
        restarted, a standby was promoted) is made again, once, on a new one, as
        :meth:`~agck.stores.postgres.reads.Reads._read_retrying` does for the sync reads."""
        again = True
        while True:
            async with self._aconns.connection() as conn:
                cur = conn.cursor()
                try:
                    return await attempt(conn, cur)
                except psycopg2.Error as e:
                    if again and isinstance(e, (psycopg2.OperationalError, psycopg2.InterfaceError)) and conn.closed:
                        again = False
                        continue
                    raise error(e, conn) from None

    async def _statement(self, sql: str, params, what: str, ref: str) -> list:
        """A reading ``sql`` on an asynchronous connection; its rows."""
        async def attempt(conn, cur):
            cur.execute(sql, params)
            await wait(conn)
            return cur.fetchall() if cur.description is not None else []
        return await self._aread_retrying(attempt, lambda e, conn: self._db_error(e, what, ref, conn=conn))

    async def aput_many(self, entries: Sequence[PutEntry]) -> list[str]:
        """:meth:`put_many`, awaited: small standalone containers in one statement on the
        event loop, anything else on a thread."""
        puts = [prepare_put(self, e.run, e.step, e.state, meta=e.meta, parent=e.parent, overwrite=e.overwrite)
                for e in check_entries(entries)]
        if not puts:
            return []
        if not self._is_small(puts):
            await asyncio.to_thread(self._write, puts, None)
            return [p.ref for p in puts]
        for attempt in range(self._put_retries + 1):
            sql, params = self._small_put_sql(puts)
            try:
                async with self._aconns.connection() as conn:
                    cur = conn.cursor()
                    try:
                        cur.execute(sql, params)
                        await wait(conn)
                    except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
                        if self._commit_unknown(e, cur):
                            raise self._commit_failed(e, batch_ref(puts)) from None
                        raise self._put_error(e, puts, conn) from None
                    except psycopg2.Error as e:
                        raise self._put_error(e, puts, conn) from None
            except self._refused as e:
                if attempt == self._put_retries:
                    raise self._refused_too_often(e, puts) from None
                continue
            break
        self.last_put = None
        failpoints.hit("pg.after_commit")
        return [p.ref for p in puts]

    async def aread(self, run: str, step: int, *, verify: bool = True, map_location=None) -> Checkpoint:
        """:meth:`read`, awaited: a small container in one statement on the event loop."""
        return await self._aread(check_run(run), check_step(step), verify, map_location)

    async def aread_newest(self, run: str, *, verify: bool = True, map_location=None) -> Checkpoint | None:
        """:meth:`read_newest`, awaited."""
        return await self._aread(check_run(run), None, verify, map_location)

    async def _aread(self, run: str, step: int | None, verify, map_location) -> Checkpoint | None:
        map_location = codec.check_map_location(map_location)
        sql, params = self._read_sql(run, step)

        async def attempt(conn, cur):
            cur.execute(sql, params)
            await wait(conn)
            return cur.fetchone()
        row = await self._aread_retrying(attempt, lambda e, conn: self._read_error(e, run, step, conn))
        got = self._read_row(row, run, step, verify, map_location)
        if got is not self._large:
            return got
        if step is None:
            return await asyncio.to_thread(self.read_newest, run, verify=verify, map_location=map_location)
        return await asyncio.to_thread(self._read_streamed, run, row[0], verify, map_location)

    async def asteps(self, run: str, *, last: int | None = None) -> list[int]:
        """:meth:`steps`, awaited."""
        rows = await self._statement(*self._steps_sql(check_run(run), check_last(last)), "query failed",
                                     self.names.where)
        return [s for (s,) in reversed(rows)]
