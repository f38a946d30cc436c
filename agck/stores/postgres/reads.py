"""The Postgres store's reads: ``read``, ``read_newest``, ``steps``, ``runs`` and ``list``
of :class:`~agck.stores.postgres.store.PostgresStore`.

A small standalone container comes with its manifest row in one statement (one
round trip, one snapshot); anything larger, and every chunk listing, is read in a
read-only repeatable-read transaction whose chunks arrive by a binary COPY straight
into a buffer prepared on another thread. Every read is judged by the rules of
FORMAT.md (chunk layout, checksum, identity) before a byte is returned. A read whose
pooled connection died while it idled is made again once on a new connection.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

import psycopg2

from ... import codec, thresholds
from ...checkpoint import Checkpoint
from ...errors import AgckError, CheckpointNotFoundError, CorruptCheckpointError
from ...memory import new_buffer
from .. import content
from ..base import CheckpointInfo, check_identity, check_last, check_run, check_step
from ..s3.chunks import REQUESTS
from .copy import COPY_IO_SIZE, CopyOut
from ..sqlrows import check_checksum, chunk_plan, decode_read, sql_row

SMALL_READ_MAX = thresholds.SMALL_READ   # a standalone container up to this size is read in one statement
LARGE = object()             # a read's first statement did not bring the container: stream it

T = TypeVar("T")


class _Background:
    """Run ``fn(*args)`` on a thread now; ``result()`` waits for it."""

    def __init__(self, fn, *args):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args):
        try:
            self._value = fn(*args)
        except BaseException as e:  # re-raised in the caller's thread
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class Reads:
    """The reading methods of :class:`~agck.stores.postgres.store.PostgresStore`."""

    def _read_retrying(self, attempt: Callable[[Any], T], error: Callable[[psycopg2.Error, Any], AgckError]) -> T:
        """``attempt(cur)`` on a pooled connection; a database error is raised as ``error(e, cur)``.
        A pooled connection can die while it idles (the server restarted, a standby was
        promoted): a read that finds its connection gone is made again, once, on a new one
        (reading twice changes nothing). Not inside a transaction this thread holds."""
        again = not self._pool.holding()
        while True:
            with self._cursor() as cur:
                try:
                    return attempt(cur)
                except psycopg2.Error as e:
                    if again and isinstance(e, (psycopg2.OperationalError, psycopg2.InterfaceError)) \
                            and cur.connection.closed:
                        again = False
                        continue
                    raise error(e, cur) from None

    def _query(self, query: str, args=()) -> list:
        def attempt(cur):
            cur.execute(query, args)
            return cur.fetchall()
        return self._read_retrying(attempt, lambda e, cur: self._db_error(e, "query failed", self.names.where,
                                                                          conn=cur.connection))

    def runs(self) -> list[str]:
        return [r for (r,) in self._query(f"SELECT DISTINCT run FROM {self.names.manifest} ORDER BY run")]

    def steps(self, run: str, *, last: int | None = None) -> list[int]:
        return [s for (s,) in reversed(self._query(*self._steps_sql(check_run(run), check_last(last))))]

    def _steps_sql(self, run: str, last: int | None) -> tuple[str, tuple]:
        return (f"SELECT step FROM {self.names.manifest} WHERE run = %s ORDER BY step DESC LIMIT %s",   # NULL: all
                (run, last))

    def list(self, run: str | None = None) -> list[CheckpointInfo]:
        n = self.names
        q = (f"SELECT run, step, coalesce(length, size), extract(epoch FROM created_at)::float8, parent, meta, checksum "
             f"FROM {n.manifest}")
        rows = (self._query(q + " ORDER BY run, step") if run is None
                else self._query(q + " WHERE run = %s ORDER BY step", (check_run(run),)))
        return [CheckpointInfo(run=r, step=s, ref=sql_row(n.manifest_ref, r, s), size=size, created_at=created,
                               parent=parent, meta=meta, checksum=checksum)
                for r, s, size, created, parent, meta, checksum in rows]

    def read(self, run: str, step: int, *, verify: bool = True, map_location=None) -> Checkpoint:
        step = check_step(step)
        return self._read(check_run(run), step, verify=verify, map_location=map_location)

    def read_newest(self, run: str, *, verify: bool = True, map_location=None) -> Checkpoint | None:
        """The newest step's checkpoint (see :meth:`Store.read_newest`): a small one in one
        statement, its step found by the same index scan that reads it."""
        check_run(run)
        for tries in range(8):
            try:
                return self._read(run, None, verify=verify, map_location=map_location)
            except CheckpointNotFoundError:    # a large one, deleted between its two statements
                if tries == 7:
                    raise
        return None

    def _read(self, run: str, step: int | None, *, verify, map_location) -> Checkpoint | None:
        """(run, step), or with ``step=None`` the run's newest step (None if it has none)."""
        map_location = codec.check_map_location(map_location)
        sql, params = self._read_sql(run, step)

        def attempt(cur):
            cur.execute(sql, params)
            return cur.fetchone()

        def error(e, cur):
            self._abort(cur)
            return self._read_error(e, run, step, cur.connection)
        row = self._read_retrying(attempt, error)
        got = self._read_row(row, run, step, verify, map_location)
        return self._read_streamed(run, row[0], verify, map_location) if got is LARGE else got

    def _read_sql(self, run: str, step: int | None) -> tuple[str, tuple]:
        """The statement that reads (run, step), or the run's newest step: a small
        standalone container comes with its manifest row, in one statement (one
        snapshot, no transaction to end): one round trip. Anything else, or a listing
        found there, is read by :meth:`_read_streamed`."""
        return (self._layout_sql(", c.data", ", string_agg(data, ''::bytea ORDER BY idx) FILTER "
                                             "(WHERE m.size <= %s AND m.listing IS NOT TRUE) AS data")
                + ("WHERE m.run = %s AND m.step = %s" if step is not None
                   else "WHERE m.run = %s ORDER BY m.step DESC LIMIT 1"),
                (SMALL_READ_MAX, run) + ((step,) if step is not None else ()))

    def _layout_sql(self, data: str = "", agg: str = "") -> str:
        n = self.names
        return (f"SELECT m.step, m.size, m.checksum, m.nchunks, c.idxs, c.lens{data} FROM {n.manifest} m "
                f"LEFT JOIN LATERAL (SELECT array_agg(idx ORDER BY idx) AS idxs, "
                f"array_agg(octet_length(data) ORDER BY idx) AS lens{agg} FROM {n.chunks} "
                f"WHERE run = m.run AND step = m.step) c ON true ")

    def _read_error(self, e: psycopg2.Error, run: str, step: int | None, conn) -> AgckError:
        return self._db_error(e, "read failed", self.ref(run, step) if step is not None else self.names.where,
                              conn=conn)

    def _read_row(self, row, run: str, step: int | None, verify, map_location) -> "Checkpoint | None | object":
        """The checkpoint :meth:`_read_sql`'s row holds; None when the run has no step
        (``step=None``); ``LARGE`` when it must be read by :meth:`_read_streamed`."""
        if row is None:
            if step is None:
                return None
            raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=self.ref(run, step),
                                          hint=f"store.steps({run!r}) lists the steps")
        step, size, checksum, nchunks, idxs, lens, data = row
        ref = self.ref(run, step)
        chunk_plan(size, nchunks, idxs or [], lens or [], manifest_ref=ref,
                   chunk_ref=lambda i: self._chunk_ref(run, step, i))
        if data is None or self.sealer is not None:    # a sealed listing: read with its objects
            return LARGE
        if len(data) != size:   # chunk_plan has checked each row's length in this snapshot
            raise CorruptCheckpointError(f"the chunks hold {len(data)} bytes, not the manifest's {size}",
                                         ref=ref, section="chunks")
        buf = new_buffer(size)
        memoryview(buf).cast("B")[:] = memoryview(data).cast("B")
        check_checksum(buf, checksum, ref, sealed=self.sealer is not None)
        if content.listed_addresses(buf, verify=verify, ref=ref) is not None:
            return LARGE
        ck = content.decode(buf, content.fetcher({}, []), verify=verify, map_location=map_location, ref=ref)
        check_identity(ck, run, step, ref)
        return ck

    def _read_streamed(self, run: str, step: int, verify, map_location) -> Checkpoint:
        """(run, step) in one transaction: its manifest row, its chunks streamed by a COPY
        and, for a listing, the objects it names."""
        n = self.names
        ref = self.ref(run, step)
        chunk_ref = lambda i: self._chunk_ref(run, step, i)  # noqa: E731

        def streamed(cur):
            row = cur.fetchone()
            if row is None:
                raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=ref,
                                              hint=f"store.steps({run!r}) lists the steps")
            _, size, checksum, nchunks, idxs, lens = row
            expected = chunk_plan(size, nchunks, idxs or [], lens or [], manifest_ref=ref, chunk_ref=chunk_ref)
            # Populate the buffer's pages on another core while the server starts the COPY.
            pending = _Background(new_buffer, size)
            sink = CopyOut(pending.result, expected, chunk_ref)
            query = cur.mogrify(f"COPY (SELECT data FROM {n.chunks} WHERE run = %s AND step = %s ORDER BY idx) "
                                f"TO STDOUT (FORMAT binary)", (run, step)).decode("utf-8")
            cur.copy_expert(query, sink, size=COPY_IO_SIZE)
            sink.finish()
            buf = pending.result()
            check_checksum(buf, checksum, ref, sealed=self.sealer is not None)
            buf = self._opened_listing(run, step, buf, ref)
            addresses = content.listed_addresses(buf, verify=verify, ref=ref)
            return buf, addresses, (self._read_objects(cur, addresses, external=False, sealed=True)
                                    if addresses is not None else {})

        # One snapshot for the manifest, the chunk layout, the data and the objects held in the
        # database; objects in an object store are read after, each straight into its place.
        buf, addresses, found = self._transaction(
            "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; " + self._layout_sql()
            + "WHERE m.run = %s AND m.step = %s", (run, step),
            streamed, "read failed", ref)
        outside = {} if self._objects is None or addresses is None else \
            {"fetch_into": self._fetch_into(found), "fetch_threads": REQUESTS}
        if self._sealed is not None:      # sealed chunks opened straight into place (_fetch_into)
            outside = {"fetch_into": self._fetch_into(found), "fetch_threads": REQUESTS if self._objects else None}
        return decode_read(self, buf, found, addresses, run=run, step=step, verify=verify,
                           map_location=map_location, ref=ref, **outside)
