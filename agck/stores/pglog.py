"""The Postgres store's step-journal logs (:mod:`agck.journal`): ``log_append``,
``log_read``, ``log_runs`` and ``log_ref`` of
:class:`~agck.stores.postgres.PostgresStore`.

Two tables, made by the first append (:func:`pgschema.log_ddl`; the schema
version does not change): ``{prefix}_log(run, seq, data)``, one row per appended
batch of records (:mod:`agck.journalrec`: they delimit and check themselves), and
``{prefix}_log_heads(run, seq)``, the last number given per run, whose row lock,
held to the COMMIT, makes a run's appends commit in the order of their numbers.
"""

from __future__ import annotations

import psycopg2
import psycopg2.errors

from ..errors import DurabilityError, SchemaUninitializedError
from ..names import check_run
from . import pgschema


class JournalLogs:
    """The journal-log methods of :class:`~agck.stores.postgres.PostgresStore`."""

    def log_ref(self, run: str) -> str:
        return f"{self.url} (table {self.names.log_ref}, run {run!r})"

    def log_append(self, run: str, records, *, sync: bool = True) -> None:
        """Append journal records to the run's log in one transaction and one round trip
        (see :meth:`Store.log_append`): the batch is one row, numbered by the run's head
        row, whose lock (held to the COMMIT) makes the run's appends commit in the order
        of their numbers. Positions are not returned (that would take a second round trip)."""
        check_run(run)
        n = self.names
        sql = (f"BEGIN; SET LOCAL synchronous_commit = {'on' if sync else 'off'}; "
               f"WITH h AS (INSERT INTO {n.log_heads} AS x (run, seq) VALUES (%s, 1) "
               f"ON CONFLICT (run) DO UPDATE SET seq = x.seq + 1 RETURNING seq) "
               f"INSERT INTO {n.log} (run, seq, data) SELECT %s, h.seq, %s FROM h; COMMIT")
        # the batch is one row: its records delimit themselves, and a row's overhead is paid once
        args = (run, run, psycopg2.Binary(b"".join(records)))
        ref = self.log_ref(run)
        for attempt in range(3):
            with self._cursor() as cur:
                try:
                    cur.execute(sql, args)
                    return None
                except (psycopg2.errors.UndefinedTable, psycopg2.errors.UniqueViolation):
                    self._abort(cur)      # no journal yet (made below), or two first appends made it at once
                except psycopg2.Error as e:
                    lost = isinstance(e, (psycopg2.OperationalError, psycopg2.InterfaceError))
                    if lost and self._commit_unknown(e, cur):
                        raise DurabilityError(
                            f"the connection failed during COMMIT: the journal records may or may not have been "
                            f"written ({self._scrubbed(e)})", ref=ref,
                            hint="read the journal again before writing them") from None
                    self._abort(cur)
                    raise self._db_error(e, "journal append failed", ref, DurabilityError, cur.connection) from None
            self._transaction("BEGIN; " + pgschema.log_ddl(n), (), lambda cur: None,
                              "cannot create the journal tables", n.where, DurabilityError,
                              retry=(psycopg2.errors.UniqueViolation,), retries=1)
        raise DurabilityError("journal append failed: its tables were made, then not found", ref=ref)

    def log_runs(self) -> list[str]:
        try:
            return [r for (r,) in self._query(f"SELECT run FROM {self.names.log_heads} ORDER BY run")]
        except SchemaUninitializedError:     # no journal yet on this store
            return []

    def log_read(self, run: str, start: int = 0) -> tuple[bytes, int]:
        check_run(run)
        try:
            rows = self._query(f"SELECT seq, data FROM {self.names.log} WHERE run = %s AND seq > %s ORDER BY seq",
                               (run, start))
        except SchemaUninitializedError:     # no journal yet on this store (UndefinedTable)
            return b"", start
        return b"".join(bytes(d) for _, d in rows), (rows[-1][0] if rows else start)

