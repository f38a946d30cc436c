"""The Postgres store's step-journal logs (:mod:`agck.journal`): ``log_append``,
``log_read``, ``log_runs``, ``log_claims`` and ``log_ref`` of
:class:`~agck.stores.postgres.store.PostgresStore`.

Two tables, made by the first append (:func:`pgschema.log_ddl`; the schema
version does not change): ``{prefix}_log(run, seq, data)``, one row per appended
batch of records (:mod:`agck.journalrec`: they delimit and check themselves),
numbered 1, 2, ... per run, the primary key deciding between writers, and
``{prefix}_log_heads(run, seq)``, a row per run that keeps a journal, which
lists them (``seq`` is written 0 and not kept up: a row updated at every append
cost each sync append a third of its time).

Claims on steps (:class:`PgClaims`, for journals shared between processes) are
session advisory locks taken on a connection of their own: the server drops them
when the holder's connection ends, a killed holder's included.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import psycopg2
import psycopg2.errors

from ..base import check_position, check_records
from ... import failpoints, thresholds
from ...errors import DurabilityError, SchemaUninitializedError, StoreConnectionError
from ...names import check_run
from . import schema as pgschema
from .copy import COPY_IO_SIZE, LogRowIn
from ..logclaims import LogClaims, claim_number

log = logging.getLogger("agck.journal")

_APPEND_TRIES = 1000       # numbers taken by other writers of the run, one after another


class JournalLogs:
    """The journal-log methods of :class:`~agck.stores.postgres.store.PostgresStore`."""

    def log_ref(self, run: str) -> str:
        return f"{self.url} (table {self.names.log_ref}, run {run!r})"

    def log_append(self, run: str, records, *, sync: bool = True) -> tuple[int, int]:
        """Append journal records to the run's log in one transaction and one round trip
        (see :meth:`Store.log_append`): the batch is one row, numbered one past the last
        number this store object knows. The primary key is the arbiter: a number another
        writer took makes the INSERT wait for that writer's transaction, then fail once it
        commits, and the append reads the last number and tries the next. So the numbers
        are dense and commit in order: a reader that sees number n has every one before it.
        Returns the numbers before and after the batch.

        A connection lost during the append (one that died while it idled, the server
        restarted or failed over) leaves the batch's outcome unknown: it is appended
        again, once, on a new connection. Records that end up twice in the log are
        harmless (a reader takes the first of a key: FORMAT.md 17), so the step's
        result is kept rather than thrown away."""
        records = check_records(records)
        check_run(run)
        self._refuse_sealed_log(self.log_ref(run), records)
        n = self.names
        data = b"".join(records)     # one row per batch: its records delimit themselves
        copied = len(data) >= thresholds.JOURNAL_COPY
        body = None if copied else psycopg2.Binary(data)
        ref = self.log_ref(run)
        with self._journal_lock:
            seq = self._journal_heads.get(run)
        sql, first = self._journal_sql(sync)
        made = False
        again = not self._pool.holding()     # (not inside a transaction this thread holds)
        for attempt in range(_APPEND_TRIES):
            if seq is None:
                seq = self._journal_last(run)
                if seq is None:      # no journal tables yet: made here, once
                    if made:
                        raise DurabilityError("journal append failed: its tables were made, then not found", ref=ref)
                    self._transaction("BEGIN; " + pgschema.log_ddl(n), (), lambda cur: None,
                                      "cannot create the journal tables", n.where, DurabilityError,
                                      retry=(psycopg2.errors.UniqueViolation,), retries=1)
                    made = True
                    continue
            known = run in self._journal_known
            with self._cursor() as cur:
                try:
                    failpoints.hit("journal.pg.before_append")
                    if copied:
                        self._append_copied(cur, sync, known, run, seq + 1, data)
                    else:
                        cur.execute(sql if known else first,
                                    (run, seq + 1, body) if known else (run, run, seq + 1, body))
                    failpoints.hit("journal.pg.after_append")
                except (psycopg2.errors.UniqueViolation, psycopg2.errors.UndefinedTable):
                    self._abort(cur)      # the number was taken (or the tables are gone): read the last again
                    seq = None
                    continue
                except psycopg2.Error as e:
                    lost = isinstance(e, (psycopg2.OperationalError, psycopg2.InterfaceError))
                    if lost and self._commit_unknown(e, cur):
                        if again:        # written or not, writing it again is harmless: once more
                            again = False
                            continue
                        raise DurabilityError(
                            f"the connection failed twice while appending journal records: they may or may not "
                            f"have been written ({self._scrubbed(e)})", ref=ref,
                            hint="the step's result is not acknowledged; check the server and run it again") from None
                    self._abort(cur)
                    raise self._db_error(e, "journal append failed", ref, DurabilityError, cur.connection) from None
            with self._journal_lock:
                self._journal_known.add(run)
                if self._journal_heads.get(run, 0) < seq + 1:
                    self._journal_heads[run] = seq + 1
            return seq, seq + 1
        raise DurabilityError(f"journal append failed: {_APPEND_TRIES} other writers' batches came first", ref=ref,
                              hint="too many writers on one run; retry")

    def _append_copied(self, cur, sync: bool, known: bool, run: str, seq: int, data: bytes) -> None:
        """One append as BEGIN, a binary COPY of its row, COMMIT: a large batch's bytes
        go as they are (an INSERT sends them hex-escaped, twice their size, for the
        server to decode), for two more round trips."""
        n = self.names
        begin = f"BEGIN; SET LOCAL synchronous_commit = {'on' if sync else 'off'}"
        if known:
            cur.execute(begin)
        else:
            cur.execute(begin + f"; INSERT INTO {n.log_heads} (run, seq) VALUES (%s, 0) ON CONFLICT (run) DO NOTHING",
                        (run,))
        cur.copy_expert(f"COPY {n.log} (run, seq, data) FROM STDIN (FORMAT binary)", LogRowIn(run, seq, data),
                        size=COPY_IO_SIZE)
        cur.execute("COMMIT")

    def _journal_sql(self, sync: bool) -> tuple[str, str]:
        """The append's statement, and the one for a run's first append by this store
        object (which also makes the run's row of the heads table)."""
        got = self._journal_statements.get(sync)
        if got is None:
            n, commit = self.names, "on" if sync else "off"
            got = self._journal_statements[sync] = (
                f"BEGIN; SET LOCAL synchronous_commit = {commit}; "
                f"INSERT INTO {n.log} (run, seq, data) VALUES (%s, %s, %s); COMMIT",
                f"BEGIN; SET LOCAL synchronous_commit = {commit}; "
                f"INSERT INTO {n.log_heads} (run, seq) VALUES (%s, 0) ON CONFLICT (run) DO NOTHING; "
                f"INSERT INTO {n.log} (run, seq, data) VALUES (%s, %s, %s); COMMIT")
        return got

    def _journal_last(self, run: str) -> int | None:
        """The run's last batch number (0: none yet); None when there are no journal tables."""
        try:
            ((last,),) = self._query(f"SELECT coalesce(max(seq), 0) FROM {self.names.log} WHERE run = %s", (run,))
        except SchemaUninitializedError:
            return None
        return int(last)

    def log_claims(self, run: str) -> "PgClaims":
        return PgClaims(self._connect_one, f"{self.names.where}\0{check_run(run)}", self.log_ref(run),
                        self._scrubbed)

    def log_runs(self) -> list[str]:
        try:
            return [r for (r,) in self._query(f"SELECT run FROM {self.names.log_heads} ORDER BY run")]
        except SchemaUninitializedError:     # no journal yet on this store
            return []

    def log_read(self, run: str, start: int = 0) -> tuple[bytes, int]:
        start = check_position(start)
        check_run(run)
        try:
            rows = self._query(f"SELECT seq, data FROM {self.names.log} WHERE run = %s AND seq > %s ORDER BY seq",
                               (run, start))
        except SchemaUninitializedError:     # no journal yet on this store (UndefinedTable)
            return b"", start
        return b"".join(bytes(d) for _, d in rows), (rows[-1][0] if rows else start)



class PgClaims(LogClaims):
    """Claims as session advisory locks (``pg_try_advisory_lock(bigint)``) on a
    connection of their own. A claim that is taken waits by trying again (1 ms,
    doubling to 50 ms), so that the connection is never held by one waiting statement
    while another thread of the journal has a claim to take or to release.

    If that connection fails, the server has dropped every claim it held: the steps
    running under them may then run a second time in another process (each result
    is recorded; every reader takes the first). That is logged; the next claim opens
    a new connection."""

    def __init__(self, connect, scope: str, ref: str, scrub):
        self.scope, self.ref = scope, ref
        self._connect, self._scrub = connect, scrub
        self._conn = None
        self._pid = os.getpid()
        self._mine: set[int] = set()
        self._lock = threading.Lock()

    def _run(self, sql: str, args) -> list:
        if self._pid != os.getpid():     # after fork(): the parent's connection and claims are its own
            self._conn, self._mine, self._pid = None, set(), os.getpid()
        if self._conn is None:
            self._conn = self._connect()
        try:
            with self._conn.cursor() as cur:
                cur.execute(sql, args)
                return cur.fetchall()
        except psycopg2.Error as e:
            conn, self._conn = self._conn, None
            try:
                conn.close()
            except psycopg2.Error:
                pass
            if self._mine:
                log.warning("journal %s: the connection holding %d step claim(s) failed; the server dropped them",
                            self.ref, len(self._mine))
                self._mine = set()
            raise StoreConnectionError(f"claiming a journal step failed: {self._scrub(e)}", ref=self.ref,
                                       hint="the step was not run; call it again") from None

    def claim(self, key: bytes, *, wait: bool) -> bool:
        n = claim_number(self.scope, key)
        delay = 0.001
        while True:
            with self._lock:
                ((got,),) = self._run("SELECT pg_try_advisory_lock(%s)", (n,))
                if got:
                    self._mine.add(n)
                    return True
            if not wait:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def release(self, keys) -> None:
        with self._lock:
            mine = [n for n in {claim_number(self.scope, k) for k in keys} if n in self._mine]
            if not mine:
                return
            self._mine.difference_update(mine)
            try:
                self._run("SELECT pg_advisory_unlock(k) FROM unnest(%s::bigint[]) AS k", (mine,))
            except StoreConnectionError:
                pass       # the connection is gone, and with it every claim it held

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            self._mine = set()
            if conn is not None and self._pid == os.getpid():
                try:
                    conn.close()      # the server drops the session's claims
                except psycopg2.Error:
                    pass
