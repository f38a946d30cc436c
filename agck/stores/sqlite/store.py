"""SQLite store: checkpoints as chunk rows plus a manifest row in one database file.

    sqlite:///relative/to.db     relative to the working directory (SQLAlchemy's convention)
    sqlite:////abs/path/to.db    absolute: four slashes
    sqlite:relative/to.db
    sqlite:///:memory:           (one process only; gone on close)

Tables (``prefix`` defaults to ``agck``)::

    {prefix}_schema_version(version)
    {prefix}_manifest(run, step, parent, size, checksum, nchunks, created_at, meta, length, listing)
                                                               PRIMARY KEY(run, step)
    {prefix}_chunks(run, step, idx, data)                      PRIMARY KEY(run, step, idx)
    {prefix}_objects(address, size, data)                      PRIMARY KEY(address)
    {prefix}_epochs(run, epoch)                                PRIMARY KEY(run); made by the first begin_epoch
    {prefix}_quarantine(address, size, data, detected_at, reason)   objects found damaged, moved out of
                                                               objects; made by the first one found
    {prefix}_parts_*                                           the same tables again: the parts of
                                                               multi-rank checkpoints (FORMAT.md section 13),
                                                               made by the first one

Each checkpoint is one container kept as chunk rows: ``size`` is the
container's bytes, ``checksum`` the xxh3-64 of its footer, ``length`` the
checkpoint's own size (what :meth:`list` reports). By default
(``incremental=True``) that container is a chunk listing (FORMAT.md, version
1.1; ``listing`` is 1) and the checkpoint's content is kept in ``objects``,
one row per distinct BLAKE3-256 address shared by every checkpoint holding
those bytes; a container under ``min_chunked`` bytes (64 KiB) is stored
standalone all the same. ``incremental=False`` stores standalone 1.0 containers. Writers
and the collector each run in one ``BEGIN IMMEDIATE`` transaction, which
SQLite serialises: no collection runs between a put finding an object and
its COMMIT (:mod:`agck.stores.content`, rule 2), and a collection reads
every committed listing. Schema 2 kept a ``refs`` row per listed object per
checkpoint; opening such a store migrates it to 3 (listings flagged, ``refs``
dropped).

A checkpoint is written in one ``BEGIN IMMEDIATE`` transaction: the objects
the store lacks, then its chunk rows (each a BLOB of at most ``chunk_size``
bytes, filled in place through the incremental blob API so the container is
never assembled in memory), then the manifest row. WAL mode with
``synchronous=FULL`` makes the COMMIT durable before ``put`` returns; a crash
before it leaves nothing, not even objects. Objects no checkpoint refers to
any more are deleted by :meth:`collect_garbage`. Opening a store of schema
version 1 or 2 migrates it to 3 (checkpoints stay as they were written).
``put_many`` writes several checkpoints in one such transaction.

``meta`` is kept twice: exactly, inside the container (``read().meta``), and
as JSON text in the manifest for listing and querying (see :func:`meta_to_json`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import urllib.parse
import weakref
from contextlib import contextmanager
from functools import partial
from typing import Any

from ... import codec, failpoints
from ...args import check_addresses
from ...checkpoint import Checkpoint
from ...errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                      DurabilityError, SchemaMismatchError, StoreConnectionError, StoreError,
                      UsageError)
from ...memory import new_buffer
from .. import compression, content, damage, encryption
from ..base import (CheckpointInfo, Store, check_last,
                   check_position, check_records, check_run, check_step)
from ..logclaims import FileClaims
from ..sqlrows import (batch_ref, decode_read, DEFAULT_CHUNK_SIZE, PreparedPut, TransactionalPuts, batches, check_checksum, check_chunk_size,
                      check_identifier, chunk_plan, parts_prefix, split_chunks, sql_row)

SCHEMA_VERSION = 3
_IN_BATCH = 500       # addresses per IN (...) list: well under SQLite's bound on query parameters


# --- the store ---------------------------------------------------------------------

def sqlite_path(url: str) -> str:
    """As SQLAlchemy reads them: ``sqlite:///rel.db`` -> ``rel.db``, ``sqlite:////abs.db`` ->
    ``/abs.db``; also ``sqlite:rel.db`` -> ``rel.db``; a plain path is itself."""
    if not url.startswith("sqlite:"):
        return url
    rest = url[len("sqlite:"):]
    if rest.startswith("//"):
        host, _, rest = rest[2:].partition("/")
        if host:
            raise StoreConnectionError(f"a SQLite URL names no host, but {url!r} has {host!r}",
                                       hint="use sqlite:///relative/path.db or sqlite:////abs/path.db")
    return ":memory:" if rest == ":memory:" else rest


@contextmanager
def _immediate(c: sqlite3.Connection):
    """A write transaction (``BEGIN IMMEDIATE``): committed if the block completes,
    rolled back if it raises. A failed rollback never hides the error that caused it."""
    c.execute("BEGIN IMMEDIATE")
    try:
        yield
        c.execute("COMMIT")    # a COMMIT that fails (I/O, disk full) may leave the transaction open
    except BaseException:
        if c.in_transaction:
            try:
                c.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        raise


def _journal_mode_wal(c: sqlite3.Connection, busy_timeout: float) -> str:
    """Switch to WAL. SQLite does not call the busy handler for a journal mode change, so
    processes opening one new database at once (the ranks of a job) would get "database is
    locked": retried here within the busy timeout."""
    deadline = time.monotonic() + busy_timeout
    while True:
        try:
            return c.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class SqliteStore(TransactionalPuts, Store):
    """Checkpoints in one SQLite database file; safe to share between threads and processes."""

    def __init__(self, url: str | os.PathLike, *, prefix: str = "agck", chunk_size: int = DEFAULT_CHUNK_SIZE,
                 busy_timeout: float = 30.0, create: bool = True, incremental: bool = True,
                 full_every: int | None = None, min_chunked: int | None = None,
                 verify_reused: str = damage.DEFAULT_VERIFY_REUSED, compress: str = compression.DEFAULT,
                 level: int | None = None, key=None, seal_meta: bool = False):
        super().__init__()
        self._set_compression(compress, level, local=True, what="SQLite database")
        given = encryption.given_key(key)     # a bad key argument is refused before anything is made
        self.seal_meta = encryption.check_seal_meta(seal_meta, given)
        url = os.fspath(url)
        self.path = sqlite_path(url)
        if not self.path:
            raise StoreConnectionError(f"no database path in {url!r}",
                                       hint="use sqlite:///relative/path.db or sqlite:////abs/path.db")
        if self.path != ":memory:":
            self.path = os.path.abspath(self.path)
        self.url = "sqlite:///:memory:" if self.path == ":memory:" else "sqlite:///" + self.path
        self.prefix = check_identifier(prefix, "table prefix")
        self.chunk_size = check_chunk_size(chunk_size)
        self._busy_timeout = busy_timeout
        self._set_policy(incremental, full_every, min_chunked, verify_reused)
        self.last_put: content.Chunks | None = None
        p = self.prefix
        self._t_version, self._t_manifest, self._t_chunks = f"{p}_schema_version", f"{p}_manifest", f"{p}_chunks"
        self._t_objects, self._t_refs = f"{p}_objects", f"{p}_refs"
        self._t_epochs = f"{p}_epochs"   # made by the first begin_epoch
        self._t_log = f"{p}_log"         # made by the first log_append (agck.journal)
        self._t_quarantine = f"{p}_quarantine"   # made by the first damaged chunk found
        self._owner_pid = os.getpid()
        target, uri = self.path, False
        if not create and self.path != ":memory:":
            if not os.path.isfile(self.path):
                raise StoreConnectionError("no such database file", ref=self.path,
                                           hint="check the path: sqlite:///relative/path.db or sqlite:////abs/path.db")
            target, uri = "file:" + urllib.parse.quote(self.path) + "?mode=rw", True  # mode=rw never creates
        try:
            self._conn = sqlite3.connect(target, timeout=busy_timeout, isolation_level=None,
                                         check_same_thread=False, uri=uri)
        except sqlite3.Error as e:
            parent = os.path.dirname(os.path.abspath(self.path))
            if self.path != ":memory:" and not os.path.isdir(parent):
                raise StoreConnectionError(f"cannot create the database: its directory {parent} does not exist",
                                           ref=self.path, hint="create the directory first") from None
            raise StoreConnectionError(f"cannot open the database: {e}", ref=self.path,
                                       hint="check the path, and that this user may read and write the file "
                                            "and its directory") from None
        try:
            c = self._conn
            c.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            if not create and self._version() is None:
                raise StoreConnectionError(f"no agck tables with prefix {self.prefix!r} in this database",
                                           ref=self.path, hint="check the path and the prefix")
            if self.path != ":memory:":
                mode = _journal_mode_wal(c, busy_timeout)
                if str(mode).lower() != "wal":
                    raise StoreConnectionError(f"cannot switch the database to WAL mode (it stays {mode})",
                                               ref=self.path)
            c.execute("PRAGMA synchronous = FULL")
            self._init_schema()
        except sqlite3.Error as e:
            self._conn.close()
            raise StoreConnectionError(f"cannot open the database: {e}", ref=self.path,
                                       hint="check that the file is an agck SQLite store and is writable") from None
        except AgckError:
            self._conn.close()
            raise
        try:
            self._set_encryption(_KeySlots(self), given, where=self.path)
        except BaseException:
            self._conn.close()
            raise

    def location(self) -> tuple:
        return ("sqlite", self.path if self.path == ":memory:" else os.path.realpath(self.path), self.prefix)

    def _stored_head(self, run: str, step: int) -> bytes | None:
        with self._lock:
            row = self._db().execute(f"SELECT substr(data, 1, 8) FROM {self._t_chunks} WHERE run = ? AND step = ? "
                                     "AND idx = 0", (run, step)).fetchone()
        return bytes(row[0]) if row else None

    # -- schema ----------------------------------------------------------------
    def _version(self) -> int | None:
        c = self._conn
        if not c.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                         (self._t_version,)).fetchone():
            return None
        row = c.execute(f"SELECT max(version) FROM {self._t_version}").fetchone()
        return row[0]

    def _init_schema(self) -> None:
        v = self._version()
        if v is None:
            c = self._conn
            with _immediate(c):
                c.execute(f"CREATE TABLE IF NOT EXISTS {self._t_version} (version INTEGER NOT NULL)")
                c.execute(f"""CREATE TABLE IF NOT EXISTS {self._t_manifest} (
                    run TEXT NOT NULL, step INTEGER NOT NULL, parent INTEGER, size INTEGER NOT NULL,
                    checksum TEXT NOT NULL, nchunks INTEGER NOT NULL, created_at REAL NOT NULL, meta TEXT,
                    length INTEGER, listing INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (run, step))""")
                c.execute(f"""CREATE TABLE IF NOT EXISTS {self._t_chunks} (
                    run TEXT NOT NULL, step INTEGER NOT NULL, idx INTEGER NOT NULL, data BLOB NOT NULL,
                    PRIMARY KEY (run, step, idx))""")
                self._create_shared_tables(c)
                if c.execute(f"SELECT count(*) FROM {self._t_version}").fetchone()[0] == 0:
                    c.execute(f"INSERT INTO {self._t_version} (version) VALUES (?)", (SCHEMA_VERSION,))
            v = self._version()
        if v in (1, 2):
            self._migrate()
            v = self._version()
        if v != SCHEMA_VERSION:
            raise SchemaMismatchError(f"schema version {v}, this agck uses {SCHEMA_VERSION}", ref=self.path,
                                      hint="use the agck version that created this database")

    def _create_shared_tables(self, c: sqlite3.Connection) -> None:
        c.execute(f"""CREATE TABLE IF NOT EXISTS {self._t_objects} (
            address BLOB PRIMARY KEY NOT NULL, size INTEGER NOT NULL, data BLOB NOT NULL)""")

    def _migrate(self) -> None:
        """To version 3. From 1: shared content (objects), the checkpoint's own size
        (manifest.length) and the listing flag; its checkpoints are standalone
        containers and stay so. From 2: listings flagged from ``refs``, which is
        dropped (a row per listed object per checkpoint, no longer needed)."""
        c = self._conn
        try:
            with _immediate(c):
                v = self._version()            # another process may have migrated meanwhile
                if v in (1, 2):
                    cols = [r[1] for r in c.execute(f"PRAGMA table_info({self._t_manifest})")]
                    if "length" not in cols:
                        c.execute(f"ALTER TABLE {self._t_manifest} ADD COLUMN length INTEGER")
                    if "listing" not in cols:
                        c.execute(f"ALTER TABLE {self._t_manifest} ADD COLUMN listing INTEGER NOT NULL DEFAULT 0")
                    self._create_shared_tables(c)
                    if v == 2:
                        m, r = self._t_manifest, self._t_refs
                        c.execute(f"UPDATE {m} SET listing = 1 WHERE EXISTS "
                                  f"(SELECT 1 FROM {r} WHERE {r}.run = {m}.run AND {r}.step = {m}.step)")
                        c.execute(f"DROP TABLE {r}")
                    c.execute(f"DELETE FROM {self._t_version}")
                    c.execute(f"INSERT INTO {self._t_version} (version) VALUES (?)", (SCHEMA_VERSION,))
        except sqlite3.Error as e:
            raise SchemaMismatchError(f"this store must be migrated to schema version {SCHEMA_VERSION} and that "
                                      f"failed: {e}", ref=self.path,
                                      hint="open the store where the database file is writable (the migration "
                                      "runs on open), or use the agck version that created it") from None

    # -- refs --------------------------------------------------------------------
    def ref(self, run: str, step: int) -> str:
        return f"{self.path}::{sql_row(self._t_manifest, check_run(run), check_step(step))}"

    def _chunk_ref(self, run: str, step: int, idx: int) -> str:
        return f"{self.path}::{sql_row(self._t_chunks, run, step, idx)}"

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError("the store is closed", ref=self.path, hint="open it again")
        if os.getpid() != self._owner_pid:
            raise StoreError("a SQLite store cannot be used across fork()", ref=self.path,
                             hint="open the store in the child process")
        return self._conn

    # -- writing ---------------------------------------------------------------
    def _write(self, puts: list[PreparedPut], epoch: int | None) -> None:
        """One write transaction holding ``puts``. An error names the put it concerns
        (``ref`` follows the loop), or the whole batch."""
        ref = batch_ref(puts)
        with self._lock:
            c = self._db()
            try:
                c.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise DurabilityError(f"cannot start the write transaction: {e}", ref=ref) from None
            try:
                if epoch is not None:
                    for run in dict.fromkeys(p.run for p in puts):
                        self._check_epoch(c, run, epoch, ref)
                for p in puts:
                    key, ref = (p.run, p.step), p.ref
                    exists = c.execute(f"SELECT 1 FROM {self._t_manifest} WHERE run = ? AND step = ?",
                                       key).fetchone()
                    if exists and not p.overwrite:
                        raise CheckpointExistsError.refused(p.ref, p.step)
                    c.execute(f"DELETE FROM {self._t_chunks} WHERE run = ? AND step = ?", key)
                    c.execute(f"DELETE FROM {self._t_manifest} WHERE run = ? AND step = ?", key)
                ref = batch_ref(puts)
                failpoints.hit("sqlite.before_insert")
                for p in puts:
                    ref = p.ref
                    if p.plan is not None:
                        self._write_objects(c, p.plan, self._reread_turn())
                        failpoints.hit("sqlite.after_objects")
                    nchunks = self._write_chunks(c, p.run, p.step, p.parts(), p.total)
                    c.execute(f"INSERT INTO {self._t_manifest} (run, step, parent, size, checksum, nchunks, "
                              f"created_at, meta, length, listing) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                              p.manifest_row(nchunks))
                ref = batch_ref(puts)
                failpoints.hit("sqlite.before_commit")
                c.execute("COMMIT")
            except BaseException as e:
                try:
                    c.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                if isinstance(e, AgckError):
                    raise e.at(ref)
                if isinstance(e, (sqlite3.Error, OSError)):
                    raise DurabilityError(f"write failed: {e}", ref=ref) from e
                raise
            last = puts[-1].plan
            self.last_put = last.chunks if last is not None else None
        for p in puts:
            if p.cache is not None:
                self._caches.give(p.run, p.cache)
        failpoints.hit("sqlite.after_commit")

    # -- fencing: a row per run in <prefix>_epochs ---------------------------------
    def begin_epoch(self, run: str) -> int:
        check_run(run)
        with self._lock:
            c = self._db()
            try:
                with _immediate(c):
                    c.execute(f"CREATE TABLE IF NOT EXISTS {self._t_epochs} "
                              f"(run TEXT PRIMARY KEY, epoch INTEGER NOT NULL)")
                    c.execute(f"INSERT INTO {self._t_epochs} (run, epoch) VALUES (?, 1) "
                              f"ON CONFLICT (run) DO UPDATE SET epoch = epoch + 1", (run,))
                    return self._current_epoch(c, run)
            except sqlite3.Error as e:
                raise DurabilityError(f"cannot begin a new epoch of run {run!r}: {e}", ref=self.path) from None

    def epoch(self, run: str) -> int | None:
        check_run(run)
        with self._lock:
            try:
                return self._current_epoch(self._db(), run)
            except sqlite3.Error as e:
                raise StoreError(f"cannot read the epoch of run {run!r}: {e}", ref=self.path) from None

    def _check_epoch(self, c: sqlite3.Connection, run: str, epoch: int, ref: str) -> None:
        """In a write transaction: refuse unless ``epoch`` is the run's newest
        (BEGIN IMMEDIATE holds begin_epoch off until COMMIT)."""
        current = self._current_epoch(c, run)
        if current != epoch:
            raise self._stale(run, epoch, current, ref)

    @staticmethod
    def _has_table(c: sqlite3.Connection, name: str) -> bool:
        return c.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None

    def _current_epoch(self, c: sqlite3.Connection, run: str) -> int | None:
        if not self._has_table(c, self._t_epochs):
            return None
        row = c.execute(f"SELECT epoch FROM {self._t_epochs} WHERE run = ?", (run,)).fetchone()
        return None if row is None else row[0]

    # -- journal logs: rows of <prefix>_log, made by the first append (agck.journal) -----
    @property
    def where(self) -> str:
        """The database and its tables, as error messages name them."""
        return f"{self.url} (tables {self.prefix}_*)"

    def log_ref(self, run: str) -> str:
        return f"{self.path} (table {self._t_log}, run {run!r})"

    def log_append(self, run: str, records, *, sync: bool = True) -> tuple[int, int]:
        """Append journal records to the run's log in one transaction (see
        :meth:`Store.log_append`): the batch is one row, numbered on from the run's last."""
        records = check_records(records)
        check_run(run)
        self._refuse_sealed_log(self.log_ref(run), records)
        records = list(records)
        with self._lock:
            c = self._db()
            try:
                with _immediate(c):       # one writer at a time: the numbers follow the commits
                    c.execute(f"CREATE TABLE IF NOT EXISTS {self._t_log} (run TEXT NOT NULL, seq INTEGER NOT NULL, "
                              f"data BLOB NOT NULL, PRIMARY KEY (run, seq)) WITHOUT ROWID")
                    (last,) = c.execute(f"SELECT coalesce(max(seq), 0) FROM {self._t_log} WHERE run = ?",
                                        (run,)).fetchone()
                    # the batch is one row: its records delimit themselves, and a row's overhead is paid once
                    c.execute(f"INSERT INTO {self._t_log} (run, seq, data) VALUES (?, ?, ?)",
                              (run, last + 1, b"".join(records)))
                    failpoints.hit("journal.sqlite.before_commit")
                failpoints.hit("journal.sqlite.after_commit")
            except sqlite3.Error as e:
                raise DurabilityError(f"journal append failed: {e}", ref=self.log_ref(run),
                                      hint="the records of this batch are not acknowledged; write them again") from None
        return last, last + 1

    def log_runs(self) -> list[str]:
        with self._lock:
            c = self._db()
            if not self._has_table(c, self._t_log):
                return []
        return [r for (r,) in self._query(f"SELECT DISTINCT run FROM {self._t_log} ORDER BY run")]

    def log_claims(self, run: str) -> FileClaims:
        if self.path == ":memory:":
            raise UsageError("an in-memory SQLite database cannot be shared between processes", ref=self.path,
                             hint="give the store a file path")
        # one lock file beside the database for every run and prefix: the key's hash covers both
        return FileClaims(self.path + "-agck-claims", f"{self._t_log}\0{check_run(run)}")

    def log_read(self, run: str, start: int = 0) -> tuple[bytes, int]:
        start = check_position(start)
        check_run(run)
        with self._lock:
            c = self._db()
            try:
                if not self._has_table(c, self._t_log):
                    return b"", start
                rows = c.execute(f"SELECT seq, data FROM {self._t_log} WHERE run = ? AND seq > ? ORDER BY seq",
                                 (run, start)).fetchall()
            except sqlite3.Error as e:
                raise StoreError(f"cannot read the journal: {e}", ref=self.log_ref(run)) from None
        return b"".join(bytes(d) for _, d in rows), (rows[-1][0] if rows else start)

    def _write_objects(self, c: sqlite3.Connection, plan: content.Plan, turn: int) -> None:
        """Insert the chunks the store lacks. The write transaction is open: nothing
        can delete an object between this check and the COMMIT. Objects found damaged
        (``verify_reused``) are quarantined and inserted afresh."""
        stored: dict[bytes, int] = {}
        names = self._sealed.names(plan.distinct) if self._sealed is not None else None
        for batch in batches(list(plan.distinct) if names is None else list(names), _IN_BATCH):
            rows = c.execute(f"SELECT address, length(data) FROM {self._t_objects} WHERE address IN "
                             f"({','.join('?' * len(batch))})", batch)
            stored.update((bytes(a), n) for a, n in rows)
        if names is not None:
            stored = self._sealed.sizes(stored, names)
        bad = damage.reused_damage(stored, plan.size, self.verify_reused, turn,
                                    lambda addresses: self._read_objects(c, addresses))
        if bad:
            self._quarantine_rows(c, bad)
        present = set(stored) - set(bad)
        rows = content.encode_chunks(plan.missing(present), self.compression, plan.itemsize)
        c.executemany(f"INSERT INTO {self._t_objects} (address, size, data) VALUES (?, ?, ?)",
                      rows if self._sealed is None else self._sealed.sealed(rows))

    def _write_chunks(self, c: sqlite3.Connection, run: str, step: int, parts, total: int) -> int:
        insert = f"INSERT INTO {self._t_chunks} (run, step, idx, data) VALUES (?, ?, ?, zeroblob(?))"
        blob, cur_idx = None, -1
        blobopen = getattr(c, "blobopen", None)
        pending: bytearray | None = None      # Python < 3.11: no blob API, assemble the chunk
        try:
            for idx, clen, piece in split_chunks(parts, total, self.chunk_size):
                if idx != cur_idx:
                    if blob is not None:
                        blob.close()
                        blob = None
                    if pending is not None:
                        c.execute(f"INSERT INTO {self._t_chunks} (run, step, idx, data) VALUES (?, ?, ?, ?)",
                                  (run, step, cur_idx, pending))
                        pending = None
                    cur_idx = idx
                    if blobopen is not None:
                        rowid = c.execute(insert, (run, step, idx, clen)).lastrowid
                        blob = blobopen(self._t_chunks, "data", rowid)
                    else:
                        pending = bytearray()
                if blob is not None:
                    blob.write(piece)
                else:
                    pending += piece
            if pending is not None:
                c.execute(f"INSERT INTO {self._t_chunks} (run, step, idx, data) VALUES (?, ?, ?, ?)",
                          (run, step, cur_idx, pending))
        finally:
            if blob is not None:
                blob.close()
        return cur_idx + 1

    def delete(self, run: str, step: int, *, epoch: int | None = None) -> None:
        step = check_step(step)
        ref = self.ref(run, step)
        with self._lock:
            c = self._db()
            try:
                with _immediate(c):
                    if epoch is not None:
                        self._check_epoch(c, run, epoch, ref)
                    n = c.execute(f"DELETE FROM {self._t_manifest} WHERE run = ? AND step = ?", (run, step)).rowcount
                    if n == 0:
                        raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=ref)
                    c.execute(f"DELETE FROM {self._t_chunks} WHERE run = ? AND step = ?", (run, step))
            except sqlite3.Error as e:
                raise DurabilityError(f"delete failed: {e}", ref=ref) from None

    # -- reading ---------------------------------------------------------------
    def _query(self, sql: str, args=()) -> list:
        with self._lock:
            try:
                return self._db().execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise StoreError(f"query failed: {e}", ref=self.path) from None

    def runs(self) -> list[str]:
        return [r for (r,) in self._query(f"SELECT DISTINCT run FROM {self._t_manifest} ORDER BY run")]

    def steps(self, run: str, *, last: int | None = None) -> list[int]:
        check_run(run)
        limit = check_last(last) or -1     # SQLite: a negative LIMIT is none
        return [s for (s,) in reversed(self._query(
            f"SELECT step FROM {self._t_manifest} WHERE run = ? ORDER BY step DESC LIMIT ?", (run, limit)))]

    def list(self, run: str | None = None) -> list[CheckpointInfo]:
        cols = "run, step, coalesce(length, size), created_at, parent, meta, checksum"
        if run is None:
            rows = self._query(f"SELECT {cols} FROM {self._t_manifest} ORDER BY run, step")
        else:
            rows = self._query(f"SELECT {cols} FROM {self._t_manifest} WHERE run = ? ORDER BY step",
                               (check_run(run),))
        out = []
        for r, s, size, created, parent, meta, checksum in rows:
            try:
                meta = json.loads(meta) if meta is not None else None
            except ValueError:
                pass
            out.append(CheckpointInfo(run=r, step=s, ref=f"{self.path}::{sql_row(self._t_manifest, r, s)}",
                                      size=size, created_at=created, parent=parent, meta=meta, checksum=checksum))
        return out

    def read(self, run: str, step: int, *, verify: bool = True, map_location=None) -> Checkpoint:
        step = check_step(step)
        ref = self.ref(run, step)
        map_location = codec.check_map_location(map_location)
        with self._lock:
            c = self._db()
            try:
                c.execute("BEGIN")  # one snapshot for the manifest, its chunks and its objects
                try:
                    buf, checksum = self._read_locked(c, run, step, ref)
                    check_checksum(buf, checksum, ref, sealed=self.sealer is not None)
                    buf = self._opened_listing(run, step, buf, ref)
                    addresses = content.listed_addresses(buf, verify=verify, ref=ref)
                    found = self._read_objects(c, addresses, sealed=True) if addresses is not None else {}
                finally:
                    c.execute("COMMIT")
            except sqlite3.Error as e:
                raise StoreError(f"read failed: {e}", ref=ref) from None
        return decode_read(self, buf, found, addresses, run=run, step=step, verify=verify,
                           map_location=map_location, ref=ref,
                           fetch_into=self._sealed.found_into(found) if self._sealed is not None else None)

    def _read_objects(self, c: sqlite3.Connection, addresses: list[bytes], *, sealed: bool = False) -> dict:
        """address -> the bytes stored for it (opened, in an encrypted store, unless
        ``sealed``: then as stored, for :meth:`SealedObjects.found_into` to open in place)."""
        found = {}
        names = self._sealed.names(addresses) if self._sealed is not None else None
        for batch in batches(list(dict.fromkeys(addresses)) if names is None else list(names), _IN_BATCH):
            rows = c.execute(f"SELECT address, data FROM {self._t_objects} WHERE address IN "
                             f"({','.join('?' * len(batch))})", batch)
            found.update((bytes(a), d) for a, d in rows)
        if names is None:
            return found
        return self._sealed.by_address(found, names) if sealed else self._sealed.opened(found, names)

    def _read_locked(self, c, run, step, ref):
        row = c.execute(f"SELECT size, checksum, nchunks FROM {self._t_manifest} WHERE run = ? AND step = ?",
                        (run, step)).fetchone()
        if row is None:
            raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=ref,
                                          hint=f"store.steps({run!r}) lists the steps")
        size, checksum, nchunks = row
        layout = c.execute(f"SELECT idx, length(data) FROM {self._t_chunks} WHERE run = ? AND step = ? "
                           f"ORDER BY idx", (run, step)).fetchall()
        expected = chunk_plan(size, nchunks, [i for i, _ in layout], [n for _, n in layout],
                              manifest_ref=ref, chunk_ref=lambda i: self._chunk_ref(run, step, i))
        buf = new_buffer(size)
        mv = memoryview(buf)
        pos = 0
        rows = c.execute(f"SELECT idx, data FROM {self._t_chunks} WHERE run = ? AND step = ? ORDER BY idx",
                         (run, step))
        for i, (idx, data) in enumerate(rows):
            n = len(data) if data is not None else -1
            if idx != i or i >= len(expected) or n != expected[i]:
                raise CorruptCheckpointError("chunk rows changed while being read", ref=self._chunk_ref(run, step, i),
                                             section="chunks", hint="retry the read")
            mv[pos:pos + n] = data
            pos += n
        if pos != size:
            raise CorruptCheckpointError(f"chunks hold {pos} bytes, the manifest says {size}", ref=ref,
                                         section="chunks")
        return buf, checksum

    # -- shared content --------------------------------------------------------
    def collect_garbage(self) -> content.Collected:
        """Delete the objects no listing refers to, in one write transaction (so no
        writer is between checking an object and committing its listing). A damaged
        listing keeps nothing alive (nothing could ever rebuild its content); one
        that cannot be read here (a newer format) stops the collection before
        anything is deleted."""
        m, o = self._t_manifest, self._t_objects
        with self._lock:
            c = self._db()
            try:
                with _immediate(c):
                    def load(run, step, ref):   # as stored: what it names is kept whatever its verdict
                        return self._opened_listing(run, step, self._read_locked(c, run, step, ref)[0], ref)

                    refs = [(self.ref(r, s), r, s) for r, s in
                            c.execute(f"SELECT run, step FROM {m} WHERE listing ORDER BY run, step").fetchall()]
                    live = content.live_chunks([(ref, partial(load, r, s, ref)) for ref, r, s in refs])
                    if not live.complete:
                        return live.collected()
                    c.execute("CREATE TEMP TABLE IF NOT EXISTS agck_live (address BLOB PRIMARY KEY)")
                    c.execute("DELETE FROM agck_live")
                    kept = live.addresses if self._sealed is None else self._sealed.names(live.addresses)
                    c.executemany("INSERT INTO agck_live (address) VALUES (?)", ((a,) for a in kept))
                    dead = f"NOT EXISTS (SELECT 1 FROM agck_live l WHERE l.address = {o}.address)"
                    n, nbytes = c.execute(f"SELECT count(*), coalesce(sum(size), 0) FROM {o} WHERE {dead}").fetchone()
                    c.execute(f"DELETE FROM {o} WHERE {dead}")
                    if self._has_table(c, self._t_quarantine):   # kept until healed or listed by no checkpoint
                        q = self._t_quarantine
                        c.execute(f"DELETE FROM {q} WHERE NOT EXISTS (SELECT 1 FROM agck_live l WHERE l.address = "
                                  f"{q}.address) OR EXISTS (SELECT 1 FROM {o} WHERE {o}.address = {q}.address)")
                    c.execute("DELETE FROM agck_live")
            except sqlite3.Error as e:
                raise DurabilityError(f"collecting garbage failed: {e}", ref=self.path) from None
        return live.collected(n, nbytes)

    # -- damaged chunks --------------------------------------------------------
    def _quarantine_rows(self, c: sqlite3.Connection, bad: dict[bytes, str]) -> None:
        """In a write transaction: move the objects ``bad`` names (address -> why) to
        the quarantine table."""
        q, o = self._t_quarantine, self._t_objects
        c.execute(f"CREATE TABLE IF NOT EXISTS {q} (address BLOB NOT NULL, size INTEGER NOT NULL, "
                  "data BLOB NOT NULL, detected_at REAL NOT NULL, reason TEXT NOT NULL)")
        now = time.time()
        if self._sealed is not None:     # rows keyed by name (FORMAT.md 18.3)
            bad = {self.sealer.name(a): why for a, why in bad.items()}
        for a, why in bad.items():
            c.execute(f"INSERT INTO {q} (address, size, data, detected_at, reason) "
                      f"SELECT address, length(data), data, ?, ? FROM {o} WHERE address = ?", (now, why, a))
            c.execute(f"DELETE FROM {o} WHERE address = ?", (a,))

    def quarantine(self, addresses) -> dict[bytes, str]:
        addresses = check_addresses(addresses)
        with self._lock:
            c = self._db()
            try:
                with _immediate(c):     # serialised with every writer and the collector
                    wanted = list(dict.fromkeys(bytes(a) for a in addresses))
                    out, bad = damage.judge(wanted, self._read_objects(c, wanted))
                    if bad:
                        self._quarantine_rows(c, bad)
            except sqlite3.Error as e:
                raise DurabilityError(f"quarantining damaged objects failed: {e}", ref=self.path) from None
        return out

    def quarantined(self) -> list[damage.QuarantinedChunk]:
        with self._lock:
            c = self._db()
            try:
                if not self._has_table(c, self._t_quarantine):
                    return []
                rows = c.execute(f"SELECT rowid, address, size, detected_at, reason FROM {self._t_quarantine} "
                                 "ORDER BY detected_at, rowid").fetchall()
            except sqlite3.Error as e:
                raise StoreError(f"query failed: {e}", ref=self.path) from None
        return [damage.QuarantinedChunk(address=bytes(a).hex(), size=n, detected_at=t, reason=why,
                                          ref=f"{self.path}::{self._t_quarantine}(rowid={i})")
                for i, a, n, t, why in rows]

    def _scrub(self, progress) -> damage.ScrubReport:
        """In one read transaction: one snapshot of every listing and every object."""
        m, o = self._t_manifest, self._t_objects
        with self._lock:
            c = self._db()
            try:
                c.execute("BEGIN")
                try:
                    def listed(run, step, ref):
                        buf, checksum = self._read_locked(c, run, step, ref)
                        check_checksum(buf, checksum, ref, sealed=self.sealer is not None)
                        return content.listed_addresses(self._opened_listing(run, step, buf, ref), verify=True,
                                                        ref=ref)

                    keys = c.execute(f"SELECT run, step FROM {m} WHERE listing ORDER BY run, step").fetchall()
                    listings = [(self.ref(r, s), partial(listed, r, s, self.ref(r, s))) for r, s in keys]
                    rows = c.cursor().execute(f"SELECT address, size, data FROM {o} ORDER BY address")
                    stored = ((bytes(a), n, f"{self.path}::{o}(address=x'{bytes(a).hex()}')",
                               lambda a=a, d=d: self._opened_object(a, d)) for a, n, d in rows)
                    return damage.scrub(self.url, listings, stored, progress,
                                        name=None if self.sealer is None else self.sealer.name)
                finally:
                    c.execute("COMMIT")
            except sqlite3.Error as e:
                raise StoreError(f"scrub failed: {e}", ref=self.path) from None

    # -- housekeeping ----------------------------------------------------------
    def _orphan_rows(self, c, run):
        sql = (f"SELECT DISTINCT c.run, c.step FROM {self._t_chunks} c WHERE NOT EXISTS "
               f"(SELECT 1 FROM {self._t_manifest} m WHERE m.run = c.run AND m.step = c.step)")
        if run is not None:
            return c.execute(sql + " AND c.run = ? ORDER BY c.run, c.step", (check_run(run),)).fetchall()
        return c.execute(sql + " ORDER BY c.run, c.step").fetchall()

    def orphans(self, run: str | None = None) -> list[str]:
        with self._lock:
            try:
                rows = self._orphan_rows(self._db(), run)
            except sqlite3.Error as e:
                raise StoreError(f"query failed: {e}", ref=self.path) from None
        return [f"{self.path}::{self._t_chunks}(run='{r}', step={s})" for r, s in rows]

    def clean_orphans(self, run: str | None = None) -> list[str]:
        with self._lock:
            c = self._db()
            try:
                with _immediate(c):
                    rows = self._orphan_rows(c, run)
                    for r, s in rows:
                        c.execute(f"DELETE FROM {self._t_chunks} WHERE run = ? AND step = ?", (r, s))
            except sqlite3.Error as e:
                raise DurabilityError(f"cleaning orphans failed: {e}", ref=self.path) from None
        return [f"{self.path}::{self._t_chunks}(run='{r}', step={s})" for r, s in rows]

    def _open_parts(self, create: bool) -> "SqliteStore | None":
        if self.path == ":memory:":
            raise UsageError("an in-memory SQLite store cannot hold multi-rank checkpoints: each rank opens "
                             "its own", ref=self.url, hint="use a database file")
        try:
            return SqliteStore(self.url, prefix=parts_prefix(self.prefix), chunk_size=self.chunk_size,
                               busy_timeout=self._busy_timeout, create=create, key=self.sealer and encryption.Inherited(self.sealer),
                               seal_meta=self.seal_meta, **self._policy())
        except StoreConnectionError:
            if create:
                raise
            return None

    def close(self) -> None:
        super().close()
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.close()
                finally:
                    self._conn = None


class _KeySlots:
    """A SQLite store's key slots (FORMAT.md 18.6): rows of ``<prefix>_keys`` (id, the
    slot's JSON), made by the first slot; nothing secret in them."""

    def __init__(self, store: SqliteStore):
        # a proxy, not the store: no cycle, so a store dropped without close() is freed at once
        self.store, self.table = weakref.proxy(store), f"{store.prefix}_keys"

    def load(self) -> list[dict]:
        st = self.store
        with st._lock:
            c = st._db()
            try:
                if not st._has_table(c, self.table):
                    return []
                rows = c.execute(f"SELECT id, slot FROM {self.table} ORDER BY id").fetchall()
            except sqlite3.Error as e:
                raise StoreError(f"cannot read the key slots: {e}", ref=st.path) from None
        return [encryption.parse_slot(text, i, f"{st.path}::{self.table}(id={i!r})") for i, text in rows]

    def save(self, slot: dict) -> None:
        st = self.store
        with st._lock:
            c = st._db()
            try:
                with _immediate(c):
                    c.execute(f"CREATE TABLE IF NOT EXISTS {self.table} (id TEXT PRIMARY KEY, slot TEXT NOT NULL)")
                    c.execute(f"INSERT INTO {self.table} (id, slot) VALUES (?, ?)",
                              (slot["id"], encryption.slot_json(slot)))
            except sqlite3.IntegrityError:
                raise CheckpointExistsError(f"key slot {slot['id']} exists", ref=st.path) from None
            except sqlite3.Error as e:
                raise DurabilityError(f"cannot write a key slot: {e}", ref=st.path) from None

    def remove(self, slot_id: str, check) -> None:
        """In one write transaction (BEGIN IMMEDIATE): the check sees the slots no other
        writer can change before the delete commits (FORMAT.md rule 18.12)."""
        st = self.store
        with st._lock:
            c = st._db()
            try:
                with _immediate(c):
                    rows = c.execute(f"SELECT id, slot FROM {self.table} ORDER BY id").fetchall() \
                        if st._has_table(c, self.table) else []
                    check([encryption.parse_slot(text, i, f"{st.path}::{self.table}(id={i!r})") for i, text in rows])
                    c.execute(f"DELETE FROM {self.table} WHERE id = ?", (slot_id,))
            except sqlite3.Error as e:
                raise DurabilityError(f"cannot remove a key slot: {e}", ref=st.path) from None
